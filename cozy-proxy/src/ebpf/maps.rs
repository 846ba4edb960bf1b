//! The pinned BPF maps, opened by path: what the programs read, kept equal
//! to the node's state, and read back for `dump`.
use super::addr_bits::AddrBits;
use super::apply_plan::{self, ip, key, AddrWrites, ApplyPlan, Belief, FlowSweep, Ranges, Step};
use super::cluster_hint;
use super::slots::Written;
use super::{batch, EbpfError};
use crate::datapath::{AllowedPort, DatapathState, Desired, NextHop, StateDiff};
use crate::model::{merge_ranges, Cidr, IpRange};
use aya::maps::{lpm_trie::Key, Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray};
use cozy_proxy_common::{
    addr, maps as names, AddrInfo, Config, Counter, FlowKey, FlowState, IpKey, LbSource, PortKey,
    Prefilter, RevKey, RevValue, ServiceCounters, FAMILY_BITS, IP_KEY_BITS,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
};

fn addr_bits(ip: &IpAddr) -> u32 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// Values of the `cluster` trie: a range of the plan, or one of this node's
/// own addresses. The backend keeps the latter there itself, so that the
/// programs tell "toward the node" from "leaving the cluster" with the one
/// trie lookup they make anyway, not a route lookup per packet.
const CLUSTER_RANGE: u8 = 1;
const NODE_ADDRESS: u8 = 2;

/// A prefix as an LPM key of the `cluster` trie.
fn cluster_key(c: &Cidr) -> Key<IpKey> {
    Key::new(FAMILY_BITS + c.prefix() as u32, key(&c.addr()))
}

fn range_key(lb: &IpAddr, c: &Cidr) -> Key<LbSource> {
    Key::new(
        IP_KEY_BITS + FAMILY_BITS + c.prefix() as u32,
        LbSource {
            lb: key(lb),
            src: key(&c.addr()),
        },
    )
}

/// The prefix an LPM key of an address holds (`extra` bits before it).
fn cidr_of(k: &IpKey, prefix_len: u32, extra: u32) -> Option<Cidr> {
    let ip = ip(k);
    let bits = prefix_len.checked_sub(extra + FAMILY_BITS)?;
    if bits > addr_bits(&ip) {
        return None;
    }
    Cidr::new(ip, bits as u8)
}

/// `bpf_map_update_elem`'s flag: only where the key is absent.
pub(super) const BPF_NOEXIST: u64 = 1;

/// Names a map error after its map.
pub(super) fn named(name: &'static str) -> impl Fn(MapError) -> EbpfError {
    move |source| EbpfError::Map { name, source }
}

fn open(dir: &Path, name: &'static str) -> Result<Map, EbpfError> {
    let data = MapData::from_pin(super::layouts::pin_path(dir, name)).map_err(named(name))?;
    Map::from_map_data(data).map_err(named(name))
}

macro_rules! typed {
    ($dir:expr, $name:expr) => {
        open($dir, $name)?.try_into().map_err(named($name))?
    };
}

/// Removing what is already gone is fine: the goal is its absence.
/// A hash map refuses a new key with E2BIG when full, an LPM trie with
/// ENOSPC.
fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s)
        if matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)))
}

pub(super) fn absent_ok(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::ElementNotFound | MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

pub struct Maps {
    addrs: HashMap<MapData, IpKey, AddrInfo>,
    allowed_ports: HashMap<MapData, PortKey, u8>,
    cluster: LpmTrie<MapData, IpKey, u8>,
    src_ranges: LpmTrie<MapData, LbSource, u8>,
    pub(super) flows: HashMap<MapData, FlowKey, FlowState>,
    pub(super) rev_nat: HashMap<MapData, RevKey, RevValue>,
    pub(super) rev_held: HashMap<MapData, IpKey, u64>,
    pub(super) flow_counts: Array<MapData, u64>,
    pub(super) stats: PerCpuArray<MapData, ServiceCounters>,
    pub(super) drop_stats: PerCpuArray<MapData, Counter>,
    config_map: Array<MapData, Config>,
    prefilter: Array<MapData, Prefilter>,
    /// What this process believes the maps hold (`None`: read them).
    pub(super) belief: Option<Belief>,
    pub(super) sweep: FlowSweep,
    /// What `config_map` holds (its `standby` as the map held it at open:
    /// a process that stopped while standing by leaves the programs so).
    config: Config,
}

/// `belief`, read from `addrs` when not known.
fn loaded<'b>(
    belief: &'b mut Option<Belief>,
    addrs: &HashMap<MapData, IpKey, AddrInfo>,
) -> Result<&'b mut Belief, EbpfError> {
    match belief {
        Some(b) => Ok(b),
        None => {
            let read = entries(addrs)?
                .into_iter()
                .map(|(k, v)| (ip(&k), Written::of(&v)))
                .collect();
            Ok(belief.insert(Belief::of(read)))
        }
    }
}

fn entries(addrs: &HashMap<MapData, IpKey, AddrInfo>) -> Result<Vec<(IpKey, AddrInfo)>, EbpfError> {
    addrs
        .iter()
        .collect::<Result<_, _>>()
        .map_err(named(names::ADDRS))
}

/// Every prefix the `cluster` trie holds (ranges and node addresses).
fn trie_cidrs(cluster: &LpmTrie<MapData, IpKey, u8>) -> Result<BTreeSet<Cidr>, EbpfError> {
    let mut out = BTreeSet::new();
    for k in cluster.keys() {
        let k = k.map_err(named(names::CLUSTER))?;
        out.extend(cidr_of(&k.data(), k.prefix_len(), 0));
    }
    Ok(out)
}

/// Writes the prefilter with the address bits `addr_bits`. A bit set
/// before and after is never cleared in between (the map update copies
/// the same word over itself).
fn write_prefilter(
    prefilter: &mut Array<MapData, Prefilter>,
    addr_bits: &AddrBits,
    cluster: &BTreeSet<Cidr>,
) -> Result<(), EbpfError> {
    // Zeroed where it lives (400 KiB: not built on the stack first).
    // SAFETY: `Prefilter` is integers only; all zeroes is a value.
    let mut bits = unsafe { Box::<Prefilter>::new_zeroed().assume_init() };
    addr_bits.write_into(&mut bits);
    for c in cluster {
        cluster_hint::mark(&mut bits, c);
    }
    prefilter
        .set(0, bits.as_ref(), 0)
        .map_err(named(names::PREFILTER))
}

impl Maps {
    /// Opens the maps pinned in `dir`.
    pub fn open(dir: &Path) -> Result<Self, EbpfError> {
        let config_map: Array<MapData, Config> = typed!(dir, names::CONFIG);
        let config = config_map.get(&0, 0).map_err(named(names::CONFIG))?;
        Ok(Maps {
            addrs: typed!(dir, names::ADDRS),
            allowed_ports: typed!(dir, names::ALLOWED_PORTS),
            cluster: typed!(dir, names::CLUSTER),
            src_ranges: typed!(dir, names::SRC_RANGES),
            flows: typed!(dir, names::FLOWS),
            rev_nat: typed!(dir, names::REV_NAT),
            rev_held: typed!(dir, names::REV_HELD),
            flow_counts: typed!(dir, names::FLOW_COUNTS),
            stats: typed!(dir, names::STATS),
            drop_stats: typed!(dir, names::DROP_STATS),
            config_map,
            prefilter: typed!(dir, names::PREFILTER),
            belief: None,
            sweep: FlowSweep::default(),
            config,
        })
    }

    /// From now until [`Maps::wake`], the programs translate, filter and
    /// count nothing; they remember the flows filtered pods start.
    pub fn stand_by(&mut self) -> Result<(), EbpfError> {
        self.write_config(Config {
            standby: 1,
            ..self.config
        })
    }

    /// Standing by (see [`Maps::stand_by`])?
    pub fn standing_by(&self) -> bool {
        self.config.standby != 0
    }

    /// The programs act on the maps: one write of `config`.
    pub fn wake(&mut self) -> Result<(), EbpfError> {
        if !self.standing_by() {
            return Ok(());
        }
        self.write_config(Config {
            standby: 0,
            ..self.config
        })
    }

    /// Writes the prefilter: the believed address bits, changed by
    /// `change` first, and the hint bits of the `cluster` trie's prefixes
    /// with `entering` (prefixes about to enter it: the hint covers a
    /// prefix before the trie holds it).
    fn rewrite_prefilter(
        &mut self,
        entering: &[Cidr],
        change: impl FnOnce(&mut AddrBits),
    ) -> Result<(), EbpfError> {
        let mut cidrs = trie_cidrs(&self.cluster)?;
        cidrs.extend(entering.iter().copied());
        let belief = loaded(&mut self.belief, &self.addrs)?;
        change(&mut belief.bits);
        write_prefilter(&mut self.prefilter, &belief.bits, &cidrs)
    }

    /// `addrs` as this process believes it holds it, read when not known.
    pub(super) fn known_entries(&mut self) -> Result<&BTreeMap<IpAddr, Written>, EbpfError> {
        Ok(&loaded(&mut self.belief, &self.addrs)?.addrs)
    }

    /// `addrs`' entries, read from the kernel.
    pub(super) fn entries(&self) -> Result<Vec<(IpKey, AddrInfo)>, EbpfError> {
        entries(&self.addrs)
    }

    /// The state the maps hold, with `routes` (the backend's, not a
    /// map's). Built as a literal naming every table, so a table added to
    /// the declaration and not read here does not compile.
    pub fn read_state(
        &self,
        routes: BTreeMap<IpAddr, NextHop>,
    ) -> Result<DatapathState, EbpfError> {
        let addrs = addr_tables(self.entries()?);
        let mut allowed_ports = BTreeSet::new();
        for k in self.allowed_ports.keys() {
            let k = k.map_err(named(names::ALLOWED_PORTS))?;
            allowed_ports.insert(AllowedPort {
                pod: ip(&k.pod),
                proto: k.proto,
                port: k.port,
            });
        }
        Ok(DatapathState {
            pod_svc: addrs.pod_svc,
            svc_pod: addrs.svc_pod,
            remote: addrs.remote,
            filtered_pods: addrs.filtered_pods,
            allowed_ports,
            icmp_allowed_pods: addrs.icmp_allowed_pods,
            unmapped_lbs: addrs.unmapped_lbs,
            cluster: self.read_cluster()?,
            ranged_lbs: addrs.ranged_lbs,
            source_ranges: self.read_source_ranges()?,
            guard: addrs.guard,
            routes,
            // Planned only: never held.
            remote_hosts: BTreeMap::new(),
        })
    }

    /// The in-cluster ranges of the `cluster` trie (not the node's own
    /// addresses the backend keeps there), merged.
    fn read_cluster(&self) -> Result<BTreeSet<IpRange>, EbpfError> {
        let mut cluster = Vec::new();
        for entry in self.cluster.iter() {
            let (k, v) = entry.map_err(named(names::CLUSTER))?;
            if v == CLUSTER_RANGE {
                cluster.extend(cidr_of(&k.data(), k.prefix_len(), 0));
            }
        }
        Ok(merge_ranges(cluster))
    }

    /// `(LB IP, source range)` of the `src_ranges` trie, merged per LB IP.
    fn read_source_ranges(&self) -> Result<BTreeSet<(IpAddr, IpRange)>, EbpfError> {
        let mut ranges: BTreeMap<IpAddr, Vec<Cidr>> = BTreeMap::new();
        for k in self.src_ranges.keys() {
            let k = k.map_err(named(names::SRC_RANGES))?;
            let d = k.data();
            if let Some(c) = cidr_of(&d.src, k.prefix_len(), IP_KEY_BITS) {
                ranges.entry(ip(&d.lb)).or_default().push(c);
            }
        }
        Ok(ranges
            .into_iter()
            .flat_map(|(lb, cidrs)| merge_ranges(cidrs).into_iter().map(move |r| (lb, r)))
            .collect())
    }

    /// Makes the maps hold `desired` (`diff` from what they hold), in the
    /// order of the plan's steps (see [`apply_plan`]). `peer_links`:
    /// interfaces whose peer is a pod's end (see [`addr::PATH_PEER`]).
    /// After a failed step the belief is forgotten: the next apply reads
    /// the maps again.
    pub fn apply(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
        peer_links: &BTreeSet<u32>,
    ) -> Result<(), EbpfError> {
        let belief = loaded(&mut self.belief, &self.addrs)?;
        let plan = apply_plan::plan(diff, desired, belief, &mut self.sweep, peer_links)?;
        let ran = self.run(&plan);
        if ran.is_err() {
            self.forget();
        }
        ran
    }

    /// Executes `plan`'s steps, in order.
    fn run(&mut self, plan: &ApplyPlan) -> Result<(), EbpfError> {
        // Policies normally leave after the addresses that need them; one
        // removed early only denies a moment sooner (fails closed), so a
        // full map makes room that way, once per apply.
        let (mut ports_room, mut ranges_room) = (false, false);
        for step in plan.steps() {
            match step {
                Step::PrefilterUp { addrs, cluster } => {
                    self.rewrite_prefilter(cluster, |bits| {
                        for (k, roles) in addrs {
                            bits.add(*k, *roles);
                        }
                    })?
                }
                Step::PortsIn(keys) => {
                    // As many as a batch takes; the rest (a full map) one
                    // by one.
                    let written = batch::write(&self.allowed_ports, keys, &vec![1u8; keys.len()]);
                    for k in keys.iter().skip(written) {
                        match self.allowed_ports.insert(*k, 1, 0) {
                            Err(e) if is_full(&e) && !ports_room => {
                                ports_room = true;
                                self.remove_ports(&plan.ports_out)?;
                                self.allowed_ports.insert(*k, 1, 0)
                            }
                            r => r,
                        }
                        .map_err(named(names::ALLOWED_PORTS))?;
                    }
                }
                Step::RangesIn(r) => {
                    for c in &r.cluster {
                        self.cluster
                            .insert(&cluster_key(c), CLUSTER_RANGE, 0)
                            .map_err(named(names::CLUSTER))?;
                    }
                    for (lb, c) in &r.sources {
                        match self.src_ranges.insert(&range_key(lb, c), 1, 0) {
                            Err(e) if is_full(&e) && !ranges_room => {
                                ranges_room = true;
                                self.remove_ranges(&plan.ranges_out)?;
                                self.src_ranges.insert(&range_key(lb, c), 1, 0)
                            }
                            r => r,
                        }
                        .map_err(named(names::SRC_RANGES))?;
                    }
                }
                Step::ForgetFlows(pods) => {
                    self.forget_flows_of(pods)?;
                    for k in pods {
                        self.sweep.stale_flows.remove(k);
                    }
                }
                Step::Addrs(w) => self.write_addrs(w)?,
                Step::ZeroFlowCounts(slots) => {
                    let written = batch::write(&self.flow_counts, slots, &vec![0u64; slots.len()]);
                    for slot in slots.iter().skip(written) {
                        self.flow_counts
                            .set(*slot, 0, 0)
                            .map_err(named(names::FLOW_COUNTS))?;
                    }
                }
                Step::RangesOut(r) => self.remove_ranges(r)?,
                Step::PortsOut(keys) => self.remove_ports(keys)?,
                Step::PrefilterDown(addrs) => self.rewrite_prefilter(&[], |bits| {
                    for (k, roles) in addrs {
                        bits.remove(k, *roles);
                    }
                })?,
            }
        }
        Ok(())
    }

    fn remove_ports(&mut self, keys: &[PortKey]) -> Result<(), EbpfError> {
        let deleted = batch::delete(&self.allowed_ports, keys);
        for k in keys.iter().skip(deleted) {
            absent_ok(self.allowed_ports.remove(k)).map_err(named(names::ALLOWED_PORTS))?;
        }
        Ok(())
    }

    fn remove_ranges(&mut self, r: &Ranges) -> Result<(), EbpfError> {
        for c in &r.cluster {
            absent_ok(self.cluster.remove(&cluster_key(c))).map_err(named(names::CLUSTER))?;
        }
        for (lb, c) in &r.sources {
            absent_ok(self.src_ranges.remove(&range_key(lb, c)))
                .map_err(named(names::SRC_RANGES))?;
        }
        Ok(())
    }

    /// Deletes, zeroes the counters of the slots the plan gave or freed,
    /// then writes (see [`AddrWrites`]).
    fn write_addrs(&mut self, w: &AddrWrites) -> Result<(), EbpfError> {
        let deleted = batch::delete(&self.addrs, &w.gone);
        for k in w.gone.iter().skip(deleted).chain(&w.gone_unknown) {
            absent_ok(self.addrs.remove(k)).map_err(named(names::ADDRS))?;
        }
        zero_slots(&mut self.stats, &w.zero_slots)?;
        let written = batch::write(&self.addrs, &w.keys, &w.infos);
        for (k, info) in w.keys.iter().zip(&w.infos).skip(written) {
            self.addrs.insert(k, info, 0).map_err(named(names::ADDRS))?;
        }
        Ok(())
    }

    /// Makes the `cluster` trie hold exactly `locals` as this node's own
    /// addresses (besides the plan's ranges; an address that is also a
    /// range of its own stays the range's).
    pub fn sync_node_addresses(&mut self, locals: &BTreeSet<IpAddr>) -> Result<(), EbpfError> {
        let mut have = BTreeSet::new();
        let mut ranges = BTreeSet::new();
        for entry in self.cluster.iter() {
            let (k, v) = entry.map_err(named(names::CLUSTER))?;
            let Some(c) = cidr_of(&k.data(), k.prefix_len(), 0) else {
                continue;
            };
            if v == NODE_ADDRESS {
                have.insert(c.addr());
            } else if Cidr::host(c.addr()) == c {
                ranges.insert(c.addr());
            }
        }
        let adding: Vec<IpAddr> = locals
            .difference(&have)
            .filter(|a| !ranges.contains(a))
            .copied()
            .collect();
        let removing: Vec<IpAddr> = have.difference(locals).copied().collect();
        if adding.is_empty() && removing.is_empty() {
            return Ok(());
        }
        let hosts: Vec<Cidr> = adding.iter().map(|a| Cidr::host(*a)).collect();
        self.rewrite_prefilter(&hosts, |_| {})?;
        for a in &adding {
            self.cluster
                .insert(&cluster_key(&Cidr::host(*a)), NODE_ADDRESS, 0)
                .map_err(named(names::CLUSTER))?;
        }
        for a in &removing {
            absent_ok(self.cluster.remove(&cluster_key(&Cidr::host(*a))))
                .map_err(named(names::CLUSTER))?;
        }
        self.rewrite_prefilter(&[], |_| {})
    }

    /// Packs what this process believes `addrs` holds: a fresh install's
    /// steps fill it in key order, which leaves half of each B-tree node
    /// empty (2 MiB of 4 at 50 000 mappings); packed once, after the last.
    pub fn pack_belief(&mut self) {
        if let Some(belief) = self.belief.as_mut() {
            crate::datapath::repack(&mut belief.addrs);
        }
    }

    /// Forgets what this process believes the maps hold: the next apply
    /// reads the kernel again (after a resync or a failure).
    pub fn forget(&mut self) {
        self.belief = None;
    }

    /// Tells the programs whether to take the fast path.
    pub fn set_fast_path(&mut self, on: bool) -> Result<(), EbpfError> {
        self.write_config(Config {
            fast_path: on as u32,
            ..self.config
        })
    }

    /// Tells the programs where in-cluster clients' hairpins may leave
    /// ([`Config::hairpin_iface`]), if that changed.
    pub fn set_hairpin_iface(&mut self, iface: u32) -> Result<(), EbpfError> {
        if self.config.hairpin_iface == iface {
            return Ok(());
        }
        self.write_config(Config {
            hairpin_iface: iface,
            ..self.config
        })
    }

    fn write_config(&mut self, config: Config) -> Result<(), EbpfError> {
        (self.config_map.set(0, config, 0)).map_err(named(names::CONFIG))?;
        self.config = config;
        Ok(())
    }
}

/// The tables the `addrs` map holds (in a state whose other tables stay
/// empty), one entry per address: its flags say which tables the address
/// is in.
fn addr_tables(entries: Vec<(IpKey, AddrInfo)>) -> DatapathState {
    let mut t = DatapathState::default();
    for (k, info) in entries {
        let (x, peer) = (ip(&k), ip(&info.peer));
        let f = info.flags;
        t.guard.insert(x, info.src_ifindex);
        if f & addr::UNMAPPED != 0 {
            t.unmapped_lbs.insert(x);
            continue;
        }
        if f & addr::LB != 0 {
            if f & addr::RANGED != 0 {
                t.ranged_lbs.insert(x);
            }
            if f & addr::LOCAL != 0 {
                t.svc_pod.insert(x, peer);
            } else {
                t.remote.insert(x, peer);
            }
        } else if f & addr::POD != 0 && f & addr::LOCAL != 0 {
            t.pod_svc.insert(x, peer);
            if f & addr::FILTERED != 0 {
                t.filtered_pods.insert(x);
                if f & addr::ICMP_ALLOWED != 0 {
                    t.icmp_allowed_pods.insert(x);
                }
            }
        }
    }
    t
}

/// The number of possible CPUs (a per-CPU value holds one copy each).
pub(super) fn possible_cpus() -> Result<usize, EbpfError> {
    // Read once: it is a file read per call otherwise.
    static CPUS: std::sync::OnceLock<Result<usize, String>> = std::sync::OnceLock::new();
    CPUS.get_or_init(|| aya::util::nr_cpus().map_err(|(_, e)| e.to_string()))
        .clone()
        .map_err(|e| EbpfError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source: std::io::Error::other(e),
        })
}

/// Zeroes the counters of `slots`: as many as a batch takes, the rest one
/// by one.
fn zero_slots(
    stats: &mut PerCpuArray<MapData, ServiceCounters>,
    slots: &[u16],
) -> Result<(), EbpfError> {
    let indexes: Vec<u32> = slots.iter().map(|s| u32::from(*s)).collect();
    let written = batch::zero_per_cpu(
        aya::maps::IterableMap::map(stats),
        &indexes,
        size_of::<ServiceCounters>(),
        possible_cpus()?,
    );
    for slot in slots.iter().skip(written) {
        zero(stats, *slot)?;
    }
    Ok(())
}

fn zero(stats: &mut PerCpuArray<MapData, ServiceCounters>, slot: u16) -> Result<(), EbpfError> {
    let cpus = possible_cpus()?;
    let zeros = aya::maps::PerCpuValues::try_from(vec![ServiceCounters::default(); cpus]).map_err(
        |source| EbpfError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        },
    )?;
    stats
        .set(slot as u32, zeros, 0)
        .map_err(named(names::STATS))
}
