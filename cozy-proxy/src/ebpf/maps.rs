//! The pinned BPF maps, opened by path: what the programs read, kept equal
//! to the node's state, and read back for `dump`.
use super::addr_bits::AddrBits;
use super::{batch, EbpfError};
use crate::datapath::{
    AllowedPort, Change, Count, Counters, DatapathState, RemotePods, ServiceCount, StateDiff,
};
use crate::model::{merge_ranges, Cidr, IpRange};
use aya::maps::{
    lpm_trie::Key, Array, HashMap, IterableMap, LpmTrie, Map, MapData, MapError, PerCpuArray,
};
use cozy_proxy_common::{
    addr, flow, maps as names, prefilter, AddrInfo, Config, Counter, DropReason, FlowKey,
    FlowState, IpKey, LbSource, PortKey, Prefilter, RevKey, RevValue, ServiceCounters, FAMILY_BITS,
    IP_KEY_BITS,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    mem::size_of,
    net::IpAddr,
    path::Path,
};
use tracing::debug;

fn key(ip: &IpAddr) -> IpKey {
    IpKey::from(*ip)
}

fn ip(k: &IpKey) -> IpAddr {
    IpAddr::from(*k)
}

fn port_key(p: &AllowedPort) -> PortKey {
    PortKey {
        pod: key(&p.pod),
        proto: p.proto,
        _pad: 0,
        port: p.port,
    }
}

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
const BPF_NOEXIST: u64 = 1;

/// Names a map error after its map.
fn named(name: &'static str) -> impl Fn(MapError) -> EbpfError {
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

fn absent_ok(r: Result<(), MapError>) -> Result<(), MapError> {
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
    flows: HashMap<MapData, FlowKey, FlowState>,
    rev_nat: HashMap<MapData, RevKey, RevValue>,
    flow_counts: Array<MapData, u64>,
    stats: PerCpuArray<MapData, ServiceCounters>,
    drop_stats: PerCpuArray<MapData, Counter>,
    config: Array<MapData, Config>,
    prefilter: Array<MapData, Prefilter>,
    /// The addresses in `addrs` and their prefilter bits as of our last
    /// apply (`None`: not known, read them).
    in_addrs: Option<AddrBits>,
    /// `addrs` as this process last wrote it (`None`: read it): a change
    /// costs what it touches, not a read of every entry.
    known: Option<BTreeMap<IpAddr, Written>>,
    /// The counter slots in use (`None`: count them from `known`).
    slots: Option<Slots>,
    /// Pod -> LB IP of the remote mappings of the state last applied
    /// (`None`: build it from the next state).
    remote_pods: Option<RemotePods>,
    /// Counter slots the last count of flows found flows for.
    counted: std::collections::HashSet<u16>,
    /// Pods whose remembered flows are to be forgotten: at once where the
    /// programs consult that pod's flows again (it is filtered or ranged
    /// after an apply: its IP reused, say), else at the next sweep. One
    /// pass over the flow map walks all its buckets (about 0.5 ms for
    /// 2^20, even empty): on every change that removed a pod, that was
    /// most of an incremental round.
    stale_flows: BTreeSet<IpKey>,
    /// (LB IP, pod) of mappings removed or moved to another pod: the
    /// reverse translations of in-cluster clients' flows through them are
    /// forgotten at the next sweep (one walk of `rev_nat`, only then).
    stale_rev: BTreeSet<(IpKey, IpKey)>,
    prefilter_written: bool,
    /// The programs stand by (a backend switch: the other backend still
    /// serves): the prefilter is kept empty, so they pass every packet
    /// untouched, until [`Maps::wake`] writes it.
    standby: bool,
}

impl Maps {
    /// Opens the maps pinned in `dir`.
    pub fn open(dir: &Path) -> Result<Self, EbpfError> {
        Ok(Maps {
            addrs: typed!(dir, names::ADDRS),
            allowed_ports: typed!(dir, names::ALLOWED_PORTS),
            cluster: typed!(dir, names::CLUSTER),
            src_ranges: typed!(dir, names::SRC_RANGES),
            flows: typed!(dir, names::FLOWS),
            rev_nat: typed!(dir, names::REV_NAT),
            flow_counts: typed!(dir, names::FLOW_COUNTS),
            stats: typed!(dir, names::STATS),
            drop_stats: typed!(dir, names::DROP_STATS),
            config: typed!(dir, names::CONFIG),
            prefilter: typed!(dir, names::PREFILTER),
            in_addrs: None,
            known: None,
            slots: None,
            remote_pods: None,
            counted: Default::default(),
            stale_flows: BTreeSet::new(),
            stale_rev: BTreeSet::new(),
            prefilter_written: false,
            standby: false,
        })
    }

    /// From now until [`Maps::wake`], the programs pass every packet
    /// untouched: the prefilter says no address is ours.
    pub fn stand_by(&mut self) -> Result<(), EbpfError> {
        self.standby = true;
        self.write_prefilter(&AddrBits::of([]), &BTreeSet::new())
    }

    /// The programs act on the maps again: the prefilter is written whole,
    /// in one update.
    pub fn wake(&mut self) -> Result<(), EbpfError> {
        if !self.standby {
            return Ok(());
        }
        let bits = self.addr_bits()?;
        let cidrs = self.trie_cidrs()?;
        self.standby = false;
        self.write_prefilter(&bits, &cidrs)?;
        self.in_addrs = Some(bits);
        Ok(())
    }

    fn entries(&self) -> Result<Vec<(IpKey, AddrInfo)>, EbpfError> {
        self.addrs
            .iter()
            .collect::<Result<_, _>>()
            .map_err(named(names::ADDRS))
    }

    /// `addrs` as known here, read from the kernel when not known.
    fn known_entries(&mut self) -> Result<&mut BTreeMap<IpAddr, Written>, EbpfError> {
        if self.known.is_none() {
            let read = self
                .entries()?
                .into_iter()
                .map(|(k, v)| (ip(&k), Written::of(&v)))
                .collect();
            self.known = Some(read);
        }
        Ok(self.known.get_or_insert_with(BTreeMap::new))
    }

    /// The state the maps hold (all but the routes).
    pub fn read_state(&self) -> Result<DatapathState, EbpfError> {
        let mut s = DatapathState::default();
        for (k, info) in self.entries()? {
            let (x, peer) = (ip(&k), ip(&info.peer));
            let f = info.flags;
            s.guard.insert(x, info.src_ifindex);
            if f & addr::UNMAPPED != 0 {
                s.unmapped_lbs.insert(x);
                continue;
            }
            if f & addr::LB != 0 {
                if f & addr::RANGED != 0 {
                    s.ranged_lbs.insert(x);
                }
                if f & addr::LOCAL != 0 {
                    s.svc_pod.insert(x, peer);
                } else {
                    s.remote.insert(x, peer);
                }
            } else if f & addr::POD != 0 && f & addr::LOCAL != 0 {
                s.pod_svc.insert(x, peer);
                if f & addr::FILTERED != 0 {
                    s.filtered_pods.insert(x);
                    if f & addr::ICMP_ALLOWED != 0 {
                        s.icmp_allowed_pods.insert(x);
                    }
                }
            }
        }
        for k in self.allowed_ports.keys() {
            let k = k.map_err(named(names::ALLOWED_PORTS))?;
            s.allowed_ports.insert(AllowedPort {
                pod: ip(&k.pod),
                proto: k.proto,
                port: k.port,
            });
        }
        let mut cluster = Vec::new();
        for entry in self.cluster.iter() {
            let (k, v) = entry.map_err(named(names::CLUSTER))?;
            if v == CLUSTER_RANGE {
                cluster.extend(cidr_of(&k.data(), k.prefix_len(), 0));
            }
        }
        s.cluster = merge_ranges(cluster);
        let mut ranges: BTreeMap<IpAddr, Vec<Cidr>> = BTreeMap::new();
        for k in self.src_ranges.keys() {
            let k = k.map_err(named(names::SRC_RANGES))?;
            let d = k.data();
            if let Some(c) = cidr_of(&d.src, k.prefix_len(), IP_KEY_BITS) {
                ranges.entry(ip(&d.lb)).or_default().push(c);
            }
        }
        for (lb, cidrs) in ranges {
            s.source_ranges
                .extend(merge_ranges(cidrs).into_iter().map(|r| (lb, r)));
        }
        Ok(s)
    }

    /// Applies `diff` (from the kernel's state to `desired`), in an order
    /// that never lets traffic through unfiltered: policies (ports, ranges,
    /// a filtered pod's flow map) are in place before the addresses that
    /// need them, and leave after.
    /// Makes the maps hold `desired` (`diff` from what they hold).
    /// `peer_links`: interfaces whose peer is a pod's end (see
    /// [`addr::PATH_PEER`]).
    pub fn apply(
        &mut self,
        diff: &StateDiff,
        desired: &DatapathState,
        peer_links: &BTreeSet<u32>,
    ) -> Result<(), EbpfError> {
        let remote_pods = self.remote_pods_after(diff, desired);
        // What `addrs` is to say of each address the diff touches, decided
        // once (a full sync's step asks it of 8 000 addresses).
        let wanted: Vec<(IpAddr, Option<AddrInfo>)> = touched_addresses(diff, desired)
            .into_iter()
            .map(|a| (a, entry(&a, desired, &remote_pods, peer_links)))
            .collect();
        // Every address about to be in `addrs` gets its prefilter bit
        // first; bits of addresses that left are cleared at the end.
        // So do the in-cluster ranges about to enter the trie.
        let mut bits = self.addr_bits()?;
        // The addresses with a bit are those `addrs` holds, in the bitmaps
        // of their entries' roles.
        let held = self.known_entries()?;
        let (mut entering, mut leaving) = (Vec::new(), Vec::new());
        for (a, info) in &wanted {
            let had = held.get(a).map_or(0, |w| prefilter::roles(w.flags));
            let has = info.as_ref().map_or(0, |i| prefilter::roles(i.flags));
            if has & !had != 0 {
                entering.push((key(a), has & !had));
            }
            if had & !has != 0 {
                leaving.push((key(a), had & !has));
            }
        }
        let adding: Vec<Cidr> = diff.cluster.add.iter().flat_map(IpRange::cidrs).collect();
        // A write (400 KiB) only where bits go up before the entries that
        // need them, or down after the entries left: a Service added or
        // removed is one write, not two.
        let growing = !entering.is_empty() || !adding.is_empty();
        let shrinking = !leaving.is_empty() || !diff.cluster.remove.is_empty();
        if growing {
            for (k, roles) in entering {
                bits.add(k, roles);
            }
            let mut cidrs = self.trie_cidrs()?;
            cidrs.extend(adding);
            self.write_prefilter(&bits, &cidrs)?;
        }
        let mut room_made = false;
        let adding: Vec<PortKey> = diff.allowed_ports.add.iter().map(port_key).collect();
        // As many as a batch takes; the rest (a full map) one by one.
        let written = batch::write(&self.allowed_ports, &adding, &vec![1u8; adding.len()]);
        for k in adding.iter().skip(written) {
            self.insert_or_make_room(
                names::ALLOWED_PORTS,
                &mut room_made,
                |m| m.allowed_ports.insert(*k, 1, 0),
                |m| m.remove_ports(&diff.allowed_ports.remove),
            )?;
        }
        self.update_ranges(diff, desired, true)?;
        // The flows of pods that no longer remember them, and of a pod
        // mapped anew (its IP reused by another pod), are forgotten: before
        // its entry is written where they would be consulted, else at the
        // next sweep (see `stale_flows`).
        let mut forgotten: BTreeSet<IpKey> = diff
            .pod_svc
            .remove
            .iter()
            .map(|(pod, _)| key(pod))
            .collect();
        forgotten.extend(
            diff.filtered_pods
                .remove
                .iter()
                .filter(|p| !remembers(p, desired))
                .map(key),
        );
        for lb in &diff.ranged_lbs.remove {
            if let Some(pod) = desired.svc_pod.get(lb).filter(|p| !remembers(p, desired)) {
                forgotten.insert(key(pod));
            }
        }
        self.stale_flows.extend(forgotten);
        let pairs = |c: &Change<(IpAddr, IpAddr)>, add: bool| -> Vec<(IpKey, IpKey)> {
            (c.side(add).iter())
                .map(|(lb, pod)| (key(lb), key(pod)))
                .collect()
        };
        for c in [&diff.svc_pod, &diff.remote] {
            self.stale_rev.extend(pairs(c, false));
        }
        for c in [&diff.svc_pod, &diff.remote] {
            for pair in pairs(c, true) {
                self.stale_rev.remove(&pair);
            }
        }
        // A stale pod is consulted once it remembers flows again, which
        // takes a change of its entry: only touched pods are asked (after
        // an emptying every pod is stale, and a step of a full sync asked
        // 50 000 of them).
        let consulted: BTreeSet<IpKey> = wanted
            .iter()
            .map(|(a, _)| key(a))
            .filter(|k| self.stale_flows.contains(k) && remembers(&ip(k), desired))
            .collect();
        self.forget_flows_of(&consulted)?;
        for k in &consulted {
            self.stale_flows.remove(k);
        }
        self.update_addrs(wanted)?;
        // A pod mapped here anew starts with no flows (a reused IP's were
        // forgotten above): its count too, whatever its slot held before.
        let known = self.known.as_ref();
        let slots: Vec<u32> = diff
            .pod_svc
            .add
            .iter()
            .filter_map(|(pod, _)| known.and_then(|k| k.get(pod)).map(|i| u32::from(i.slot)))
            .collect();
        let written = batch::write(&self.flow_counts, &slots, &vec![0u64; slots.len()]);
        for slot in slots.iter().skip(written) {
            self.flow_counts
                .set(*slot, 0, 0)
                .map_err(named(names::FLOW_COUNTS))?;
        }
        self.update_ranges(diff, desired, false)?;
        self.remove_ports(&diff.allowed_ports.remove)?;
        for (k, roles) in &leaving {
            bits.remove(k, *roles);
        }
        // Rewritten in full at every sync that follows a read (startup,
        // resync): a prefilter lost or stale is repaired there.
        if shrinking || !self.prefilter_written {
            let cidrs = self.trie_cidrs()?;
            self.write_prefilter(&bits, &cidrs)?;
            self.prefilter_written = true;
        }
        self.in_addrs = Some(bits);
        self.remote_pods = Some(remote_pods);
        Ok(())
    }

    fn remove_ports(&mut self, ports: &[AllowedPort]) -> Result<(), EbpfError> {
        let keys: Vec<PortKey> = ports.iter().map(port_key).collect();
        let deleted = batch::delete(&self.allowed_ports, &keys);
        for k in keys.iter().skip(deleted) {
            absent_ok(self.allowed_ports.remove(k)).map_err(named(names::ALLOWED_PORTS))?;
        }
        Ok(())
    }

    /// Inserts with `insert`; where the map is full, `make_room` first
    /// (once per apply: removing what the diff removes, early) and again.
    /// Policies normally leave after the addresses that need them; a port
    /// or source range removed early only denies a moment sooner (fails
    /// closed), so room is made this way only when the map is full.
    fn insert_or_make_room(
        &mut self,
        name: &'static str,
        room_made: &mut bool,
        mut insert: impl FnMut(&mut Self) -> Result<(), MapError>,
        make_room: impl FnOnce(&mut Self) -> Result<(), EbpfError>,
    ) -> Result<(), EbpfError> {
        match insert(self) {
            Err(e) if is_full(&e) && !*room_made => {
                *room_made = true;
                make_room(self)?;
                insert(self).map_err(named(name))
            }
            r => r.map_err(named(name)),
        }
    }

    /// `desired`'s remote pods: the last state's, changed by `diff`
    /// (built once after a read).
    fn remote_pods_after(&mut self, diff: &StateDiff, desired: &DatapathState) -> RemotePods {
        match self.remote_pods.take() {
            Some(mut m) => {
                m.apply(&diff.remote);
                m
            }
            None => RemotePods::of(desired),
        }
    }

    /// Every prefix the `cluster` trie holds (ranges and node addresses).
    fn trie_cidrs(&self) -> Result<BTreeSet<Cidr>, EbpfError> {
        let mut out = BTreeSet::new();
        for k in self.cluster.keys() {
            let k = k.map_err(named(names::CLUSTER))?;
            out.extend(cidr_of(&k.data(), k.prefix_len(), 0));
        }
        Ok(out)
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
        let bits = self.addr_bits()?;
        // The hint covers an address before the trie holds it.
        let mut cidrs = self.trie_cidrs()?;
        cidrs.extend(adding.iter().map(|a| Cidr::host(*a)));
        self.write_prefilter(&bits, &cidrs)?;
        for a in &adding {
            self.cluster
                .insert(&cluster_key(&Cidr::host(*a)), NODE_ADDRESS, 0)
                .map_err(named(names::CLUSTER))?;
        }
        for a in &removing {
            absent_ok(self.cluster.remove(&cluster_key(&Cidr::host(*a))))
                .map_err(named(names::CLUSTER))?;
        }
        let cidrs = self.trie_cidrs()?;
        self.write_prefilter(&bits, &cidrs)?;
        self.in_addrs = Some(bits);
        Ok(())
    }

    /// The prefilter's address bits as of our last apply, or of what
    /// `addrs` holds.
    fn addr_bits(&mut self) -> Result<AddrBits, EbpfError> {
        if let Some(bits) = self.in_addrs.take() {
            return Ok(bits);
        }
        let held = self.known_entries()?;
        Ok(AddrBits::of(held.iter().map(|(a, w)| (key(a), w.flags))))
    }

    /// Forgets what this process believes the maps hold: the next apply
    /// reads the kernel again (after a resync or a failure).
    pub fn forget(&mut self) {
        self.in_addrs = None;
        self.known = None;
        self.slots = None;
        self.remote_pods = None;
        self.prefilter_written = false;
    }

    /// Writes the prefilter with the address bits `addr_bits`. A bit
    /// set before and after is never cleared in between (the map update
    /// copies the same word over itself).
    fn write_prefilter(
        &mut self,
        addr_bits: &AddrBits,
        cluster: &BTreeSet<Cidr>,
    ) -> Result<(), EbpfError> {
        // Zeroed where it lives (400 KiB: not built on the stack first).
        // SAFETY: `Prefilter` is integers only; all zeroes is a value.
        let mut bits = unsafe { Box::<Prefilter>::new_zeroed().assume_init() };
        if !self.standby {
            addr_bits.write_into(&mut bits);
            for c in cluster {
                mark_cluster(&mut bits, c);
            }
        }
        self.prefilter
            .set(0, bits.as_ref(), 0)
            .map_err(named(names::PREFILTER))
    }

    /// The cluster and source-range tries: what `diff` adds (`adding`) or
    /// removes. A range is held as the prefixes that cover it; a prefix two
    /// ranges share stays while either needs it.
    fn update_ranges(
        &mut self,
        diff: &StateDiff,
        desired: &DatapathState,
        adding: bool,
    ) -> Result<(), EbpfError> {
        if adding {
            for c in diff.cluster.add.iter().flat_map(IpRange::cidrs) {
                self.cluster
                    .insert(&cluster_key(&c), CLUSTER_RANGE, 0)
                    .map_err(named(names::CLUSTER))?;
            }
            let mut room_made = false;
            for (lb, r) in &diff.source_ranges.add {
                for c in r.cidrs() {
                    self.insert_or_make_room(
                        names::SRC_RANGES,
                        &mut room_made,
                        |m| m.src_ranges.insert(&range_key(lb, &c), 1, 0),
                        |m| m.update_ranges(diff, desired, false),
                    )?;
                }
            }
            return Ok(());
        }
        // What stays (a prefix two ranges share), read only when
        // something goes.
        let want_cluster: BTreeSet<Cidr> = match diff.cluster.remove.is_empty() {
            true => BTreeSet::new(),
            false => desired.cluster.iter().flat_map(IpRange::cidrs).collect(),
        };
        let leaving: BTreeSet<&IpAddr> =
            diff.source_ranges.remove.iter().map(|(lb, _)| lb).collect();
        let want_ranges: BTreeSet<(IpAddr, Cidr)> = desired
            .source_ranges
            .iter()
            .filter(|(lb, _)| leaving.contains(lb))
            .flat_map(|(lb, r)| r.cidrs().into_iter().map(move |c| (*lb, c)))
            .collect();
        for c in diff.cluster.remove.iter().flat_map(IpRange::cidrs) {
            if !want_cluster.contains(&c) {
                absent_ok(self.cluster.remove(&cluster_key(&c))).map_err(named(names::CLUSTER))?;
            }
        }
        for (lb, r) in &diff.source_ranges.remove {
            for c in r.cidrs() {
                if !want_ranges.contains(&(*lb, c)) {
                    absent_ok(self.src_ranges.remove(&range_key(lb, &c)))
                        .map_err(named(names::SRC_RANGES))?;
                }
            }
        }
        Ok(())
    }

    /// Writes the `addrs` entry each `wanted` address is to have; one to
    /// have none is removed.
    fn update_addrs(&mut self, wanted: Vec<(IpAddr, Option<AddrInfo>)>) -> Result<(), EbpfError> {
        if wanted.is_empty() {
            return Ok(());
        }
        self.known_entries()?;
        // Taken out while written: after an error both are read again.
        let mut known = self.known.take().unwrap_or_default();
        let all_new = known.is_empty();
        let mut slots = self.slots.take().unwrap_or_else(|| Slots::of(&known));
        slots.given.clear();
        // Removals first: a slot freed here may serve a mapping added below.
        // The entries to write, as the batch takes them (no third copy of
        // them: a full sync's are several MiB).
        let (mut keys, mut infos) = (Vec::new(), Vec::new());
        // Known to be in the map (deleted in batches), or not (one by one,
        // a missing key being no error).
        let (mut gone, mut gone_unknown) = (Vec::new(), Vec::new());
        for (a, info) in wanted {
            match info {
                None => match known.remove(&a) {
                    Some(old) => {
                        slots.release(&old);
                        gone.push(key(&a));
                    }
                    None => gone_unknown.push(key(&a)),
                },
                Some(info) => {
                    keys.push(key(&a));
                    infos.push(info);
                }
            }
        }
        let deleted = batch::delete(&self.addrs, &gone);
        for k in gone.iter().skip(deleted).chain(&gone_unknown) {
            absent_ok(self.addrs.remove(k)).map_err(named(names::ADDRS))?;
        }
        for (k, info) in keys.iter().zip(infos.iter_mut()) {
            let a = ip(k);
            if let Some(old) = known
                .get(&a)
                .filter(|old| old.local_lb() && !Written::of(info).local_lb())
            {
                // No longer a local mapping (its pod went elsewhere): its
                // slot is free again.
                slots.release(old);
            }
            if info.flags & addr::LOCAL != 0 {
                // The LB IP and its pod share the mapping's slot.
                let lb = if info.flags & addr::LB != 0 {
                    a
                } else {
                    ip(&info.peer)
                };
                info.slot = slots.of_lb(&lb, &known)?;
            }
            known.insert(a, Written::of(info));
        }
        // The counters of slots freed or given anew start at zero, before
        // an address that counts in them is written.
        zero_slots(&mut self.stats, &std::mem::take(&mut slots.to_zero))?;
        let written = batch::write(&self.addrs, &keys, &infos);
        for (k, info) in keys.iter().zip(&infos).skip(written) {
            self.addrs.insert(k, info, 0).map_err(named(names::ADDRS))?;
        }
        if all_new {
            crate::datapath::repack(&mut known);
        }
        self.known = Some(known);
        self.slots = Some(slots);
        Ok(())
    }

    /// The flows remembered, keys and states.
    fn flow_entries(&self) -> Result<Vec<(FlowKey, FlowState)>, EbpfError> {
        self.flows
            .iter()
            .collect::<Result<_, _>>()
            .map_err(named(names::FLOWS))
    }

    /// Forgets every flow of `pods` (none: nothing read).
    fn forget_flows_of(&mut self, pods: &BTreeSet<IpKey>) -> Result<(), EbpfError> {
        if pods.is_empty() {
            return Ok(());
        }
        for (k, _) in self.flow_entries()? {
            if pods.contains(&k.pod) {
                absent_ok(self.flows.remove(&k)).map_err(named(names::FLOWS))?;
            }
        }
        Ok(())
    }

    /// Recounts each mapping's remembered flows into `flow_counts` (the
    /// programs keep the counts as they go; this corrects what races and
    /// removals from here left, and zeroes slots that changed hands).
    /// `every`: write every local pod's count (after a read of the maps);
    /// else only the pods with flows, those counted with flows last time
    /// and the pods in `swept` (whose flows were just forgotten): not a
    /// write per pod at every sweep, a syscall each on the datapath's
    /// thread, holding up the changes meanwhile.
    pub fn count_flows(&mut self, every: bool, swept: &BTreeSet<IpKey>) -> Result<(), EbpfError> {
        let mut per_pod: BTreeMap<IpKey, u64> = BTreeMap::new();
        for (k, _) in self.flow_entries()? {
            *per_pod.entry(k.pod).or_default() += 1;
        }
        let last = std::mem::take(&mut self.counted);
        let writes: Vec<(u16, u64)> = self
            .known_entries()?
            .iter()
            .filter(|(_, i)| i.local_pod())
            .filter_map(|(a, i)| {
                let n = per_pod.get(&key(a)).copied().unwrap_or(0);
                let wanted = every || n > 0 || last.contains(&i.slot) || swept.contains(&key(a));
                wanted.then_some((i.slot, n))
            })
            .collect();
        for (slot, n) in writes {
            self.flow_counts
                .set(slot as u32, n, 0)
                .map_err(named(names::FLOW_COUNTS))?;
            if n > 0 {
                self.counted.insert(slot);
            }
        }
        Ok(())
    }

    /// Forgets the flows that have been quiet longer than their timeout
    /// (`now_ns` on the programs' clock, CLOCK_MONOTONIC), as conntrack's
    /// garbage collection does, and recounts; returns how many were
    /// forgotten. The programs forget an expired flow when they meet it;
    /// this frees the room of those nobody asks about again.
    /// Also forgets the flows of the pods left to the sweep (see
    /// `stale_flows`), and sweeps `rev_nat` ([`Maps::sweep_rev`]).
    pub fn expire_flows(&mut self, now_ns: u64) -> Result<usize, EbpfError> {
        let stale = std::mem::take(&mut self.stale_flows);
        let expired: Vec<FlowKey> = self
            .flow_entries()?
            .into_iter()
            .filter(|(k, s)| {
                stale.contains(&k.pod)
                    || now_ns.saturating_sub(s.last_seen_ns) > flow::timeout_ns(s.state)
            })
            .map(|(k, _)| k)
            .collect();
        for k in &expired {
            absent_ok(self.flows.remove(k)).map_err(named(names::FLOWS))?;
        }
        let mut swept: BTreeSet<IpKey> = expired.iter().map(|k| k.pod).collect();
        swept.extend(stale);
        self.count_flows(false, &swept)?;
        self.sweep_rev(now_ns)?;
        Ok(expired.len())
    }

    /// Forgets the reverse translations whose client has been quiet longer
    /// than [`RevValue::idle_s`] (`now_ns` on the programs' clock), and
    /// those through mappings removed or moved since the last sweep: a
    /// reply of that pod to that client must not come from an LB IP that
    /// no longer leads to it (a kubelet probe from a reused port would get
    /// it).
    fn sweep_rev(&mut self, now_ns: u64) -> Result<(), EbpfError> {
        let now_s = RevValue::seconds(now_ns);
        let stale = std::mem::take(&mut self.stale_rev);
        let gone: Vec<RevKey> = (self.rev_nat.iter())
            .filter_map(Result::ok)
            .filter(|(k, v)| {
                stale.contains(&(v.lb, k.backend))
                    || now_s.saturating_sub(v.seen_s) > RevValue::idle_s(k.proto)
            })
            .map(|(k, _)| k)
            .collect();
        for k in &gone {
            absent_ok(self.rev_nat.remove(k)).map_err(named(names::REV_NAT))?;
        }
        Ok(())
    }

    /// Takes the reverse translations an older layout of `rev_nat` held
    /// (an upgrade), where the programs have none for those flows yet.
    pub fn carry_over_rev(&mut self, entries: &[(RevKey, RevValue)]) -> Result<(), EbpfError> {
        for (k, v) in entries {
            match self.rev_nat.insert(k, v, BPF_NOEXIST) {
                Ok(()) => {}
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(named(names::REV_NAT)(e)),
            }
        }
        Ok(())
    }

    /// Tells the programs whether to take the fast path.
    pub fn configure(&mut self, config: Config) -> Result<(), EbpfError> {
        self.config.set(0, config, 0).map_err(named(names::CONFIG))
    }

    /// Per-service counters (summed over CPUs) and drops by reason.
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let count = |c: &Counter| Count {
            packets: c.packets,
            bytes: c.bytes,
        };
        let mut out = Counters::default();
        // The slots of our local LB IPs: from what we last wrote when we
        // know it (reading `addrs` back is a syscall per entry, on the
        // datapath's thread, holding up changes meanwhile).
        let read;
        let local_lbs: Box<dyn Iterator<Item = (IpAddr, Written)>> = match &self.known {
            Some(known) => Box::new(known.iter().map(|(a, w)| (*a, *w))),
            None => {
                read = self.entries()?;
                Box::new(read.iter().map(|(k, i)| (ip(k), Written::of(i))))
            }
        };
        let mut by_slot: Vec<(u32, IpAddr)> = local_lbs
            .filter(|(_, w)| w.local_lb())
            .map(|(a, w)| (u32::from(w.slot), a))
            .collect();
        by_slot.sort_unstable();
        // Gathered in slot order, sorted into the map once at the end.
        let mut services = Vec::with_capacity(by_slot.len());
        let mut add = |a: IpAddr, per_cpu: &[ServiceCounters]| {
            let mut sum = ServiceCount::default();
            for c in per_cpu {
                sum.ingress += count(&c.ingress);
                sum.egress += count(&c.egress);
            }
            services.push((a, sum));
        };
        // The whole array in a few reads, the slots in use picked as they
        // come (in order); one lookup per slot where the kernel has no
        // batch read.
        let mut next = 0;
        let batched = if by_slot.is_empty() {
            Ok(())
        } else {
            batch::read_per_cpu(
                IterableMap::map(&self.stats),
                possible_cpus()?,
                |index, per_cpu| {
                    while by_slot.get(next).is_some_and(|(slot, _)| *slot < index) {
                        next += 1;
                    }
                    while let Some((_, a)) = by_slot.get(next).filter(|(slot, _)| *slot == index) {
                        add(*a, per_cpu);
                        next += 1;
                    }
                    // Nothing to read past the last slot in use.
                    next < by_slot.len()
                },
            )
        };
        if let Err(error) = batched {
            debug!(%error, "no batch read of the counters; one slot at a time");
            for (slot, a) in &by_slot[next..] {
                let per_cpu = self.stats.get(slot, 0).map_err(named(names::STATS))?;
                add(*a, &per_cpu[..]);
            }
        }
        out.services = services.into_iter().collect();
        for reason in DropReason::ALL {
            let per_cpu = self
                .drop_stats
                .get(&(reason as u32), 0)
                .map_err(named(names::DROP_STATS))?;
            let sum = out.drops.entry(reason.name()).or_default();
            for c in per_cpu.iter() {
                *sum += count(c);
            }
        }
        Ok(out)
    }
}

/// Sets the in-cluster hint bits of every address of `c`: its IPv4 /16s,
/// or its IPv6 /32 (an IPv6 range wider than that sets the "wide" flag).
fn mark_cluster(bits: &mut Prefilter, c: &Cidr) {
    let first = key(&c.addr()).words()[0];
    match c.addr() {
        IpAddr::V4(_) if c.prefix() >= 16 => {
            let (word, bit) = prefilter::cluster_slot_v4(first);
            bits.cluster[word] |= bit;
        }
        IpAddr::V4(a) => {
            let start = u32::from(a) >> 16;
            let count = 1u32 << (16 - c.prefix());
            for block in start..start + count {
                let w = u32::from_ne_bytes((block << 16).to_be_bytes());
                let (word, bit) = prefilter::cluster_slot_v4(w);
                bits.cluster[word] |= bit;
            }
        }
        IpAddr::V6(_) if c.prefix() >= 32 => {
            let (word, bit) = prefilter::cluster_slot_v6(first);
            bits.cluster[word] |= bit;
        }
        IpAddr::V6(_) => bits.cluster_v6_wide = 1,
    }
}

/// The addresses whose `addrs` entry `diff` may change: those it names,
/// and the other half of a local mapping whose policy it changes (a
/// filtered pod's policy is on its LB IP too, an LB IP's ranges on its pod).
fn touched_addresses(diff: &StateDiff, desired: &DatapathState) -> BTreeSet<IpAddr> {
    let mut touched = diff.mapping_addresses();
    for c in [
        &diff.filtered_pods,
        &diff.icmp_allowed_pods,
        &diff.ranged_lbs,
    ] {
        touched.extend(c.elements().copied());
    }
    touched.extend(diff.guard.elements().map(|(a, _)| *a));
    touched.extend(diff.routes.elements().map(|(a, _)| *a));
    let policies = diff
        .filtered_pods
        .elements()
        .chain(diff.icmp_allowed_pods.elements());
    touched.extend(policies.filter_map(|pod| desired.pod_svc.get(pod)));
    let ranged = diff.ranged_lbs.elements();
    touched.extend(ranged.filter_map(|lb| desired.svc_pod.get(lb)));
    touched
}

/// Whether the programs remember `pod`'s flows: replies to it pass the
/// port filter (a filtered pod) and the source ranges (a ranged LB IP's).
fn remembers(pod: &IpAddr, desired: &DatapathState) -> bool {
    desired.filtered_pods.contains(pod)
        || desired
            .pod_svc
            .get(pod)
            .is_some_and(|lb| desired.ranged_lbs.contains(lb))
}

/// What `addrs` must say about address `a` in `desired` (`None`: nothing).
fn entry(
    a: &IpAddr,
    desired: &DatapathState,
    remote_pods: &RemotePods,
    peer_links: &BTreeSet<u32>,
) -> Option<AddrInfo> {
    let guard = desired.guard.get(a).copied().unwrap_or(0);
    let path = |lb: &IpAddr| desired.routes.get(lb).map_or(0, |h| h.oif);
    let policy = |pod: &IpAddr| {
        let mut f = 0;
        if desired.filtered_pods.contains(pod) {
            f |= addr::FILTERED;
            if desired.icmp_allowed_pods.contains(pod) {
                f |= addr::ICMP_ALLOWED;
            }
        }
        f
    };
    let ranged = |lb: &IpAddr| {
        if desired.ranged_lbs.contains(lb) {
            addr::RANGED
        } else {
            0
        }
    };
    let info = |peer: &IpAddr, src_ifindex, path_ifindex: u32, flags| AddrInfo {
        peer: key(peer),
        src_ifindex,
        path_ifindex,
        flags: if peer_links.contains(&path_ifindex) {
            flags | addr::PATH_PEER
        } else {
            flags
        },
        slot: 0,
    };
    if let Some(pod) = desired.svc_pod.get(a) {
        let flags = addr::LB | addr::LOCAL | policy(pod) | ranged(a);
        return Some(info(pod, guard, path(a), flags));
    }
    if let Some(lb) = desired.pod_svc.get(a) {
        let flags = addr::POD | addr::LOCAL | policy(a) | ranged(lb);
        return Some(info(lb, guard, path(lb), flags));
    }
    if let Some(pod) = desired.remote.get(a) {
        return Some(info(pod, guard, path(a), addr::LB | ranged(a)));
    }
    if let Some(lb) = remote_pods.lb_of(a) {
        return Some(info(lb, guard, path(lb), addr::POD));
    }
    if desired.unmapped_lbs.contains(a) {
        return Some(AddrInfo {
            flags: addr::LB | addr::UNMAPPED,
            ..Default::default()
        });
    }
    None
}

/// The counter slots of local mappings: kept while a mapping lives (its
/// counts go on), zeroed when it goes (a new mapping starts at 0). Kept
/// from one apply to the next.
pub struct Slots {
    used: BTreeSet<u16>,
    /// Slots assigned during the current update, by LB IP.
    given: BTreeMap<IpAddr, u16>,
    /// Where the search for a free slot starts: after the last one given
    /// (a search from 0 each time made a full sync quadratic: 43 s for
    /// 50 000 mappings).
    cursor: u32,
    /// Slots given anew or freed, whose counters are to be zeroed (in one
    /// batch, before the addresses are written).
    to_zero: Vec<u16>,
}

/// What this process keeps of an `addrs` entry it wrote: the rest is the
/// state's to say, not kept twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Written {
    flags: u16,
    slot: u16,
}

impl Written {
    fn of(info: &AddrInfo) -> Written {
        Written {
            flags: info.flags,
            slot: info.slot,
        }
    }

    /// The LB IP of a mapping translated here: it owns a counter slot.
    fn local_lb(&self) -> bool {
        self.flags & addr::LB != 0 && self.flags & addr::LOCAL != 0
    }

    /// The pod of a mapping translated here (it shares its LB IP's slot).
    fn local_pod(&self) -> bool {
        self.flags & addr::POD != 0 && self.flags & addr::LOCAL != 0
    }
}

impl Slots {
    fn of(current: &BTreeMap<IpAddr, Written>) -> Slots {
        Slots {
            used: current
                .values()
                .filter(|w| w.local_lb())
                .map(|w| w.slot)
                .collect(),
            given: BTreeMap::new(),
            cursor: 0,
            to_zero: Vec::new(),
        }
    }

    fn release(&mut self, old: &Written) {
        if old.local_lb() && self.used.remove(&old.slot) {
            self.to_zero.push(old.slot);
        }
    }

    /// The slot of the local mapping of `lb`: the one it has, or a free one.
    fn of_lb(
        &mut self,
        lb: &IpAddr,
        current: &BTreeMap<IpAddr, Written>,
    ) -> Result<u16, EbpfError> {
        if let Some(s) = self.given.get(lb) {
            return Ok(*s);
        }
        let kept = current.get(lb).filter(|w| w.local_lb()).map(|w| w.slot);
        let slot = match kept {
            Some(s) => s,
            None => {
                // From the cursor to the end, then from the start (slots
                // released below it).
                let free = (self.cursor..=u32::from(u16::MAX))
                    .chain(0..self.cursor)
                    .map(|s| s as u16)
                    .find(|s| !self.used.contains(s))
                    .ok_or(EbpfError::Full { map: names::STATS })?;
                self.cursor = u32::from(free) + 1;
                self.used.insert(free);
                self.to_zero.push(free);
                free
            }
        };
        self.given.insert(*lb, slot);
        Ok(slot)
    }
}

/// The number of possible CPUs (a per-CPU value holds one copy each).
fn possible_cpus() -> Result<usize, EbpfError> {
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
