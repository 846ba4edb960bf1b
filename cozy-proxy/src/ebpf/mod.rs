//! The eBPF datapath: TC programs on the node's interfaces, BPF maps kept
//! equal to the node's state, and one host route per mapping that steers
//! the LB IP toward its pod (see docs/ebpf-datapath.md for why).
mod addr_bits;
mod apply_plan;
mod batch;
mod bpffs;
pub mod chain;
mod cluster_hint;
mod config;
mod counters;
mod error;
mod flow_seed;
mod flow_sweep;
pub mod hairpin;
mod ifaces;
pub mod layouts;
mod links;
mod maps;
pub mod shape;
mod slots;
mod xdp;
pub mod xdp_place;

use crate::datapath::{
    Applied, BackendKind, Capacity, Counters, DatapathState, Desired, Dump, Kernel, PathOf, Paths,
    Routes, StateDiff,
};
use crate::netlink::{route, NlSocket};
use crate::steer::Steering;
use apply_plan::ip;
use aya::{programs::SchedClassifier, EbpfLoader};
pub use config::{EbpfConfig, Interfaces, TcAttach};
use cozy_proxy_common::{maps as names, RevValue};
use error::io;
pub use error::EbpfError;
use maps::Maps;
use serde_json::json;
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use tracing::{debug, info, warn};
pub use xdp_place::XdpChoice;

/// The object built from `cozy-proxy-ebpf` by build.rs (empty when the
/// crate was built without the eBPF toolchain: see build.rs).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("COZY_PROXY_EBPF_OBJ"));

pub use cozy_proxy_common::PIN_DIR;

/// The loaded programs and where they are attached.
struct Programs {
    ebpf: aya::Ebpf,
    /// A second load of the same object, on the same pinned maps: what puts
    /// ours first again on a tcx hook where another agent's program got
    /// ahead (see links.rs). Loaded the first time it is needed.
    spare: Option<aya::Ebpf>,
    /// Link notifications (RTMGRP_LINK): interfaces to follow.
    link_events: NlSocket,
    attached: BTreeSet<u32>,
    /// Interfaces whose attachment failed (warned once; retried at each
    /// upkeep).
    failed: BTreeSet<u32>,
    /// Attached (or re-pointed) only once the first sync has filled the
    /// maps: until then the programs of a previous instance keep running
    /// with their own maps, so even an upgrade that changes the maps' layout
    /// translates without a gap.
    live: bool,
    /// Entries of maps of an older layout, copied into ours right before
    /// ours go live (until then the previous programs add to them).
    carried: layouts::Carried,
    /// Hooks where ours could not be put first (warned once each).
    behind: BTreeSet<(u32, &'static str)>,
    /// The interfaces' roles for the anti-spoofing check.
    ifaces: ifaces::Ifaces,
    /// The masquerade of the hairpins the programs mark.
    hairpin: hairpin::HairpinMasq,
    /// The XDP program on the uplinks (`None`: `--xdp off`, or it could
    /// not be loaded, which start says).
    xdp: Option<xdp::XdpUplinks>,
}

impl Programs {
    /// The ids of both instances of program `name` (0: the spare is not
    /// loaded).
    fn ids(&mut self, name: &str) -> Result<[u32; 2], EbpfError> {
        let id = |ebpf: &mut aya::Ebpf| -> Result<u32, EbpfError> {
            let prog = links::program(ebpf, name)?;
            let info = prog.info().map_err(|source| EbpfError::Program {
                name: name.to_string(),
                source,
            })?;
            Ok(info.id())
        };
        let spare = match self.spare.as_mut() {
            Some(s) => id(s)?,
            None => 0,
        };
        Ok([id(&mut self.ebpf)?, spare])
    }

    /// Keeps program `name` first on `link`'s `hook` (see links.rs).
    fn keep_first(
        &mut self,
        rtnl: &NlSocket,
        cfg: &EbpfConfig,
        link: &route::Link,
        (name, hook, hook_name): (&str, aya::programs::TcAttachType, &'static str),
    ) -> Result<(), EbpfError> {
        if !(cfg.tc_attach == TcAttach::Auto && links::tcx_available()) {
            let prog = links::program(&mut self.ebpf, name)?;
            return links::keep_tc_first(rtnl, prog, link, (hook, hook_name)).map(|_| ());
        }
        let ids = self.ids(name)?;
        let chain_ids =
            chain::tcx_program_ids(link.index, hook).map_err(|source| EbpfError::Io {
                path: PathBuf::from(format!("tcx {hook_name} of {}", link.name)),
                source,
            })?;
        if chain::place(&chain_ids, |id| ids.contains(&id)) == chain::Place::First {
            return Ok(());
        }
        if self.spare.is_none() {
            self.spare = Some(load_object(&cfg.pin_dir)?);
        }
        let ids = self.ids(name)?;
        let Some(spare) = self.spare.as_mut() else {
            return Ok(());
        };
        let instances = [
            links::program(&mut self.ebpf, name)?,
            links::program(spare, name)?,
        ];
        links::keep_tcx_first(instances, ids, &cfg.pin_dir, link, (hook, hook_name)).map(|_| ())
    }
}

/// Loads the embedded object on the maps pinned under `pin_dir` (created
/// and pinned where absent), with both TC programs loaded into the kernel.
fn load_object(pin_dir: &Path) -> Result<aya::Ebpf, EbpfError> {
    let mut loader = EbpfLoader::new();
    for name in names::ALL {
        loader.map_pin_path(name, layouts::pin_path(pin_dir, name));
    }
    let mut ebpf = loader.load(OBJECT)?;
    for (name, _, _) in links::PROGRAMS {
        links::program(&mut ebpf, name)?
            .load()
            .map_err(|source| EbpfError::Program {
                name: name.into(),
                source,
            })?;
    }
    Ok(ebpf)
}

/// The XDP program loaded into `ebpf` and its uplinks' keeper, unless
/// `--xdp off`; a kernel that refuses it leaves the TC programs serving
/// every interface, said once.
fn load_xdp(ebpf: &mut aya::Ebpf, cfg: &EbpfConfig) -> Option<xdp::XdpUplinks> {
    if cfg.xdp == XdpChoice::Off {
        return None;
    }
    let loaded = xdp::load(ebpf).and_then(|()| xdp::XdpUplinks::open(cfg.xdp, &cfg.pin_dir));
    match loaded {
        Ok(x) => Some(x),
        Err(e) => {
            warn!(error = %e, "the XDP program could not be loaded; the TC programs serve the uplinks");
            None
        }
    }
}

/// The interfaces the programs go on: with `auto`, every Ethernet-type
/// interface but loopback; else those named that exist (`warn_missing`:
/// say which do not yet).
fn wanted_links<'a>(
    all: &'a [route::Link],
    interfaces: &Interfaces,
    warn_missing: bool,
) -> Vec<&'a route::Link> {
    match interfaces {
        Interfaces::Auto => all
            .iter()
            .filter(|l| l.kind == route::ARPHRD_ETHER && l.name != "lo")
            .collect(),
        Interfaces::Named(names) => {
            let mut v = Vec::new();
            for n in names {
                match all.iter().find(|l| &l.name == n) {
                    Some(l) => v.push(l),
                    // Named but absent: attached when it appears.
                    None if warn_missing => warn!(interface = %n, "interface not found yet"),
                    None => {}
                }
            }
            // A named bridge's ports come with it: frames are judged at
            // the port they enter by (see ifaces.rs).
            let bridges: BTreeSet<u32> = v
                .iter()
                .filter(|l| l.is_bridge())
                .map(|l| l.index)
                .collect();
            v.extend(all.iter().filter(|l| {
                l.is_bridge_port()
                    && l.master.is_some_and(|m| bridges.contains(&m))
                    && !names.contains(&l.name)
            }));
            v
        }
    }
}

/// With tc filters: refuses to start where another agent's filter (or tcx
/// program) would run before ours on a hook of an interface we attach to
/// and ours cannot be put ahead of it (see `links::tc_blocker`).
fn refuse_blocked_tc_hooks(rtnl: &NlSocket, cfg: &EbpfConfig) -> Result<(), EbpfError> {
    let all = route::links(rtnl)?;
    // Our own tcx links of an earlier start go once our filters are in.
    let ours = links::pinned_program_ids(&cfg.pin_dir);
    for link in wanted_links(&all, &cfg.interfaces, false) {
        for (_, hook, hook_name) in links::PROGRAMS {
            if let Some(why) = links::tc_blocker(rtnl, link, hook, hook_name, &ours)? {
                return Err(EbpfError::Blocked(why));
            }
        }
    }
    Ok(())
}

pub struct EbpfKernel {
    cfg: EbpfConfig,
    /// `None` when opened only to inspect or clean up.
    programs: Option<Programs>,
    /// `None` when nothing is pinned (opened on a node without our state).
    maps: Option<Maps>,
    rtnl: NlSocket,
    steering: Steering,
    /// When expired flows were last swept (see [`EbpfKernel::expire_flows`]).
    last_sweep: Instant,
    /// This node's own addresses as last written to the `cluster` trie
    /// (`None`: read them again).
    node_addresses: Option<BTreeSet<IpAddr>>,
    /// The node's interfaces as last read, each with whether its peer is
    /// a pod's end (see `addr::PATH_PEER`); `None`: read them again (after
    /// a link change, or when a diff names an interface not in it).
    peer_links: Option<BTreeMap<u32, bool>>,
    /// Where in-cluster clients' hairpins may leave (`iface::HAIRPIN`).
    hairpin_paths: ifaces::HairpinPaths,
}

/// How often the upkeep sweeps expired flows out of the `flows` map
/// (conntrack's garbage collection runs on a similar scale).
const FLOW_SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Remembers the flows conntrack holds of filtered or ranged pods of this
/// node (none such: conntrack is not read); returns how many were added.
fn remember_tracked_flows(maps: &mut Maps) -> Result<usize, EbpfError> {
    let addrs = maps.addr_infos()?;
    if !addrs.values().any(flow_seed::guarded_local_pod) {
        return Ok(0);
    }
    let sock = NlSocket::open(libc::NETLINK_NETFILTER)?;
    let tracked = crate::netlink::conntrack::tracked(&sock, |t| addrs.contains_key(&t.src))?;
    let flows = flow_seed::pod_flows(&tracked, &addrs);
    maps.remember_flows(&flows, monotonic_ns())
}

/// The programs' clock (`bpf_ktime_get_ns`): CLOCK_MONOTONIC.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

impl EbpfKernel {
    /// What is pinned under `cfg.pin_dir`, without loading anything: for
    /// `dump` and `cleanup`.
    pub fn open(cfg: EbpfConfig) -> Result<Self, EbpfError> {
        let maps = if layouts::pin_path(&cfg.pin_dir, names::ADDRS).exists() {
            Some(Maps::open(&cfg.pin_dir)?)
        } else {
            None
        };
        Ok(EbpfKernel {
            cfg,
            programs: None,
            maps,
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            steering: Steering::open()?,
            last_sweep: Instant::now(),
            node_addresses: None,
            peer_links: None,
            hairpin_paths: ifaces::HairpinPaths::default(),
        })
    }

    /// Loads the programs (reusing pinned maps) and attaches them.
    pub fn start(cfg: EbpfConfig) -> Result<Self, EbpfError> {
        if OBJECT.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        bpffs::ensure(&cfg.pin_dir)?;
        let links_dir = links::links_dir(&cfg.pin_dir);
        fs::create_dir_all(&links_dir).map_err(io(&links_dir))?;
        let carried = layouts::drop_other_layouts(&cfg.pin_dir);
        let rtnl = NlSocket::open(libc::NETLINK_ROUTE)?;
        if let Some(why) = shape::unserved(&route::links(&rtnl)?, &cfg.interfaces) {
            return Err(EbpfError::Unserved(why));
        }
        let mut ebpf = load_object(&cfg.pin_dir)?;
        let xdp = load_xdp(&mut ebpf, &cfg);
        if cfg.tc_attach == TcAttach::Netlink {
            refuse_blocked_tc_hooks(&rtnl, &cfg)?;
        }
        let mut maps = Maps::open(&cfg.pin_dir)?;
        maps.set_fast_path(cfg.fast_path)?;
        let iface_roles = ifaces::Ifaces::open(&cfg.pin_dir)?;
        Ok(EbpfKernel {
            maps: Some(maps),
            cfg,
            programs: Some(Programs {
                ebpf,
                spare: None,
                link_events: NlSocket::subscribe(libc::NETLINK_ROUTE, libc::RTMGRP_LINK as u32)?,
                attached: BTreeSet::new(),
                failed: BTreeSet::new(),
                live: false,
                carried,
                behind: BTreeSet::new(),
                ifaces: iface_roles,
                hairpin: hairpin::HairpinMasq::default(),
                xdp,
            }),
            rtnl,
            steering: Steering::open()?,
            last_sweep: Instant::now(),
            node_addresses: None,
            peer_links: None,
            hairpin_paths: ifaces::HairpinPaths::default(),
        })
    }

    /// Attaches to interfaces not yet attached (new pod veths), forgets
    /// vanished ones, and keeps ours first on every hook.
    fn follow_interfaces(&mut self) -> Result<(), EbpfError> {
        let Some(p) = self.programs.as_mut().filter(|p| p.live) else {
            return Ok(());
        };
        let all = route::links(&self.rtnl)?;
        let live: BTreeSet<u32> = all.iter().map(|l| l.index).collect();
        // Before any attachment: a bridge's port judges what the bridge
        // lets pass; and the masquerade of what the programs mark is there.
        let roles = ifaces::roles(&all, &self.hairpin_paths.interfaces());
        if let Some(maps) = self.maps.as_mut() {
            maps.set_hairpin_iface(ifaces::hairpin_config(&roles))?;
        }
        p.ifaces.sync(roles)?;
        p.hairpin.keep();
        let wanted = wanted_links(&all, &self.cfg.interfaces, p.attached.is_empty());
        // One interface that cannot be attached does not keep the others
        // from being attached.
        for link in &wanted {
            if p.attached.contains(&link.index) {
                continue;
            }
            let attached = links::attach(
                &mut p.ebpf,
                &self.rtnl,
                &self.cfg.pin_dir,
                link,
                self.cfg.tc_attach,
            );
            match attached {
                Ok(()) => {
                    p.attached.insert(link.index);
                    p.failed.remove(&link.index);
                }
                Err(e) if p.failed.insert(link.index) => {
                    warn!(interface = %link.name, error = %e, "attaching failed; retrying every second")
                }
                Err(e) => debug!(interface = %link.name, error = %e, "attaching failed again"),
            }
        }
        p.attached.retain(|i| live.contains(i));
        p.failed.retain(|i| live.contains(i));
        links::forget_vanished(&self.cfg.pin_dir, &live);
        let mut behind = 0;
        let attached: Vec<&route::Link> = (wanted.iter().copied())
            .filter(|l| p.attached.contains(&l.index))
            .collect();
        for link in attached {
            for (name, hook, hook_name) in links::PROGRAMS {
                if let Err(e) = p.keep_first(&self.rtnl, &self.cfg, link, (name, hook, hook_name)) {
                    behind += 1;
                    if p.behind.insert((link.index, hook_name)) {
                        warn!(interface = %link.name, hook = hook_name, error = %e, "another program runs before ours and ours cannot be put first: traffic here is not translated");
                    }
                } else {
                    p.behind.remove(&(link.index, hook_name));
                }
            }
        }
        p.behind.retain(|(i, _)| live.contains(i));
        chain::set_behind(behind);
        if let Some(x) = p.xdp.as_mut() {
            if let Err(e) = x.upkeep(&mut p.ebpf, &self.rtnl, &all, &self.cfg.pin_dir) {
                warn!(error = %e, "keeping the XDP program on the uplinks failed; retrying every second");
            }
        }
        Ok(())
    }

    /// The error for a sync or a read where nothing is pinned.
    fn no_pins(&self) -> EbpfError {
        EbpfError::Io {
            path: layouts::pin_path(&self.cfg.pin_dir, names::ADDRS),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }
    }

    fn maps(&self) -> Result<&Maps, EbpfError> {
        self.maps.as_ref().ok_or_else(|| self.no_pins())
    }

    /// Recounts every pod's remembered flows (as after a read of the maps).
    pub fn count_flows(&mut self) -> Result<(), EbpfError> {
        match self.maps.as_mut() {
            Some(m) => m.count_flows(true, &Default::default()),
            None => Err(self.no_pins()),
        }
    }

    /// A backend switch: the programs stay attached but pass every packet
    /// untouched (while the other backend still serves) until
    /// [`EbpfKernel::wake`], remembering the flows filtered pods start; the
    /// syncs in between fill the maps.
    pub fn stand_by(&mut self) -> Result<(), EbpfError> {
        match self.maps.as_mut() {
            Some(m) => m.stand_by(),
            None => Err(self.no_pins()),
        }
    }

    /// The programs stand by (as [`EbpfKernel::stand_by`] left them, maybe
    /// in a process before this one).
    pub fn standing_by(&self) -> bool {
        self.maps.as_ref().is_some_and(Maps::standing_by)
    }

    /// The programs act on the maps: the flows filtered pods started
    /// before the standby are taken from conntrack (`flow_seed.rs`), then
    /// one write of `config`. Unreadable, conntrack costs those flows'
    /// replies until their pods send again; the programs act all the same.
    pub fn wake(&mut self) -> Result<(), EbpfError> {
        let Some(maps) = self.maps.as_mut().filter(|m| m.standing_by()) else {
            return Ok(());
        };
        match remember_tracked_flows(maps) {
            Ok(n) => info!(
                flows = n,
                "remembered the flows filtered pods started before the switch"
            ),
            Err(e) => {
                warn!(error = %e, "could not take the flows filtered pods started before the switch from conntrack; their replies are dropped until the pods send again")
            }
        }
        maps.wake()
    }

    /// Follows the paths of the pods `diff` touches (all of them after a
    /// read) into [`ifaces::HairpinPaths`]; `true` if the interfaces where
    /// hairpins may leave changed.
    fn follow_hairpin_paths(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
    ) -> Result<bool, EbpfError> {
        let look = self.hairpin_paths.touched_pods(diff, desired);
        if look.is_empty() {
            return Ok(false);
        }
        let paths = self.steering.paths(&look.keys().copied().collect())?;
        let mut moved = false;
        for (pod, host) in look {
            moved |= self.hairpin_paths.take(pod, paths.path_of(&pod), host);
        }
        Ok(moved)
    }

    /// Turns the fast path on or off (as `EbpfConfig::fast_path` at start).
    pub fn set_fast_path(&mut self, on: bool) -> Result<(), EbpfError> {
        self.cfg.fast_path = on;
        match self.maps.as_mut() {
            Some(m) => m.set_fast_path(on),
            None => Ok(()),
        }
    }

    /// Keeps this node's own addresses in the `cluster` trie, where the
    /// programs find them (a pod keeps its IP toward its node); read from
    /// the local routing table when unknown or `refetch`.
    fn follow_node_addresses(&mut self, refetch: bool) -> Result<(), EbpfError> {
        let Some(maps) = self.maps.as_mut() else {
            return Ok(());
        };
        let locals = match self.node_addresses.take() {
            Some(known) if !refetch => known,
            _ => route::local_addresses(&self.rtnl)?,
        };
        maps.sync_node_addresses(&locals)?;
        self.node_addresses = Some(locals);
        Ok(())
    }

    /// Each hook our programs are on, with every program there in the order
    /// they run: ours are those of our pinned links (tcx), or our filters.
    fn chains(&self, all: &[route::Link]) -> Result<Vec<chain::HookChain>, EbpfError> {
        let mut out = Vec::new();
        let pinned = links::pinned(&self.cfg.pin_dir);
        let our_ids = links::pinned_program_ids(&self.cfg.pin_dir);
        let with_pins: BTreeSet<u32> = pinned.iter().map(|(i, _)| *i).collect();
        for link in all {
            for (_, hook, hook_name) in links::PROGRAMS {
                let c = if with_pins.contains(&link.index) {
                    let ours = |id: u32| our_ids.contains(&id);
                    chain::tcx_chain(&link.name, link.index, (hook, hook_name), &ours)
                        .map_err(io(Path::new(&link.name)))?
                } else {
                    let ours = |f: &crate::netlink::tc::Filter| links::is_our_filter(f);
                    chain::tc_chain(&self.rtnl, &link.name, link.index, (hook, hook_name), &ours)?
                };
                if c.ours_at.is_some() {
                    out.push(c);
                }
            }
        }
        Ok(out)
    }

    /// Forgets the flows quiet for longer than their timeout; returns how
    /// many. Runs from the upkeep every [`FLOW_SWEEP_EVERY`].
    pub fn expire_flows(&mut self) -> Result<usize, EbpfError> {
        let Some(maps) = self.maps.as_mut() else {
            return Err(self.no_pins());
        };
        let forgotten = maps.expire_flows(monotonic_ns())?;
        if forgotten > 0 {
            debug!(forgotten, "expired flows swept");
        }
        Ok(forgotten)
    }
}

impl Kernel for EbpfKernel {
    type Error = EbpfError;
    type Found = ();

    fn kind(&self) -> BackendKind {
        BackendKind::Ebpf
    }

    /// The sizes of the maps (fixed when they are created).
    fn capacity(&self) -> Capacity {
        use cozy_proxy_common::limits;
        Capacity::new(
            limits::ADDRS,
            limits::MAPPINGS,
            limits::PORTS,
            limits::SOURCE_RANGES,
        )
    }

    fn paths(&mut self, pods: &BTreeSet<IpAddr>) -> Result<&Paths, EbpfError> {
        Ok(self.steering.paths(pods)?)
    }

    /// A fresh read: what this process believed of the maps is forgotten
    /// (the next apply rewrites the prefilter from the kernel's content).
    fn read(&mut self) -> Result<(DatapathState, ()), EbpfError> {
        if let Some(m) = self.maps.as_mut() {
            m.forget();
        }
        if let Some(p) = self.programs.as_mut() {
            p.ifaces.forget();
        }
        self.hairpin_paths.forget();
        self.node_addresses = None;
        self.peer_links = None;
        // The attachments are checked again too (others may have detached
        // a link): the next upkeep re-points every interface's links.
        if let Some(p) = self.programs.as_mut() {
            p.attached.clear();
        }
        let routes = self.steering.routes()?;
        Ok((self.maps()?.read_state(routes)?, ()))
    }

    /// Routes that go first, then the maps, then the routes that come: an
    /// LB IP is steered toward its pod only while the rewrite for it is in
    /// place. After the first sync the programs go live on the interfaces.
    fn apply_routed(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
        found: Option<()>,
        how: Routes,
    ) -> Result<Applied, EbpfError> {
        let Some(maps) = self.maps.as_mut() else {
            return Err(self.no_pins());
        };
        let known = |links: &BTreeMap<u32, bool>| {
            diff.routes
                .add
                .iter()
                .all(|(_, hop)| links.contains_key(&hop.oif))
        };
        if !self.peer_links.as_ref().is_some_and(known) {
            self.peer_links = Some(
                route::links(&self.rtnl)?
                    .into_iter()
                    .map(|l| (l.index, l.peer_elsewhere))
                    .collect(),
            );
        }
        let peer_links: BTreeSet<u32> = self
            .peer_links
            .iter()
            .flatten()
            .filter(|(_, &peer)| peer)
            .map(|(&index, _)| index)
            .collect();
        let started = std::time::Instant::now();
        self.steering.withdraw(&diff.routes)?;
        maps.apply(diff, desired, &peer_links)?;
        if found.is_some() {
            // After a read (startup, resync): the counts as they are.
            maps.count_flows(true, &Default::default())?;
        }
        let maps_took = started.elapsed();
        self.follow_node_addresses(false)?;
        self.steering.apply(&diff.routes, how)?;
        let hairpins_moved = self.follow_hairpin_paths(diff, desired)?;
        debug!(maps_took = ?maps_took, routes = diff.routes.size(), took = ?started.elapsed(), ?how, "eBPF maps and routes written");
        let mut installed_schema = false;
        if let Some(p) = self.programs.as_mut().filter(|p| !p.live) {
            if let Some(maps) = self.maps.as_mut() {
                let carried = std::mem::take(&mut p.carried);
                let rev = carried.rev_nat(RevValue::seconds(monotonic_ns()));
                if !rev.is_empty() {
                    maps.carry_over_rev(&rev)?;
                    info!(
                        entries = rev.len(),
                        "reverse translations carried over from the older rev_nat"
                    );
                }
            }
            p.live = true;
            installed_schema = true;
            self.follow_interfaces()?;
            info!("eBPF programs live on the node's interfaces");
        } else if hairpins_moved {
            self.follow_interfaces()?;
        }
        Ok(Applied {
            extra_changes: 0,
            installed_schema,
        })
    }

    fn settle(&mut self) -> Result<(), EbpfError> {
        if let Some(maps) = self.maps.as_mut() {
            maps.pack_belief();
        }
        Ok(self.steering.settle()?)
    }

    fn upkeep(&mut self) -> Result<bool, EbpfError> {
        let links_changed = match &self.programs {
            // An overrun (events lost) counts as a change.
            Some(p) => p
                .link_events
                .pending_events(|_| true)
                .map_or(true, |n| n > 0),
            None => false,
        };
        // Every second, not only on a link notification: an interface whose
        // notification was missed (the socket's buffer overran) is still
        // attached within a second, and a failed one is retried.
        self.follow_interfaces()?;
        if self.maps.is_some() && self.last_sweep.elapsed() >= FLOW_SWEEP_EVERY {
            self.last_sweep = Instant::now();
            self.expire_flows()?;
        }
        let changed = self.steering.changed()?;
        if changed || links_changed {
            self.peer_links = None;
        }
        if changed {
            // An address added or removed shows as a local route.
            self.follow_node_addresses(true)?;
        }
        Ok(changed)
    }

    fn paths_news(&mut self) -> Result<bool, EbpfError> {
        let changed = self.steering.changed()?;
        if changed {
            self.peer_links = None;
        }
        Ok(changed)
    }

    fn dump(&self) -> Result<Dump, EbpfError> {
        let Some(maps) = &self.maps else {
            return Ok(Dump {
                backend: BackendKind::Ebpf,
                installed: false,
                state: DatapathState::default(),
                counters: Counters::default(),
                details: json!({}),
                placement: Vec::new(),
            });
        };
        let pin_dir = &self.cfg.pin_dir;
        let links_by_index = route::links(&self.rtnl)?;
        let name_of = |index: u32| {
            links_by_index
                .iter()
                .find(|l| l.index == index)
                .map(|l| l.name.clone())
        };
        let attachments: Vec<_> = links::pinned(pin_dir)
            .into_iter()
            .map(|(index, path)| json!({ "ifindex": index, "interface": name_of(index), "pin": path }))
            .collect();
        let chains = self.chains(&links_by_index)?;
        let uplinks = route::default_route_interfaces(&self.rtnl)?;
        let xdp = xdp::describe(pin_dir, &links_by_index, &uplinks);
        // Per client address, as counted (recounted at each sweep).
        let reverse_held: BTreeMap<String, u64> = (maps.rev_held()?.into_iter())
            .map(|(client, n)| (ip(&client).to_string(), n))
            .collect();
        let state = maps.read_state(self.steering.routes()?)?;
        let routes: Vec<String> = state
            .routes
            .iter()
            .map(|(dst, hop)| match hop.gateway {
                Some(gw) => format!(
                    "{dst} via {gw} dev {}",
                    name_of(hop.oif).unwrap_or_default()
                ),
                None => format!("unreachable {dst}"),
            })
            .collect();
        Ok(Dump {
            backend: BackendKind::Ebpf,
            installed: true,
            counters: maps.counters()?,
            state,
            details: json!({
                "pin_dir": pin_dir,
                "attachments": attachments,
                "chains": chains,
                "xdp": xdp,
                "routes": routes,
                "hairpin_masquerade": hairpin::present(),
                "reverse_translations_held": reverse_held,
            }),
            placement: Vec::new(),
        })
    }

    fn counters(&self) -> Result<Counters, EbpfError> {
        self.maps()?.counters()
    }

    /// Removes attachments and pinned maps (the routes go with the last
    /// backend: see `backend::remove`).
    fn cleanup(&mut self) -> Result<(), EbpfError> {
        self.maps = None;
        self.programs = None;
        remove_installed(&self.cfg)
    }
}

/// Is anything of the eBPF backend installed: pinned under `cfg`'s pin
/// directory, or its hairpin masquerade table? Read from the directory
/// and netlink alone, as [`remove_installed`] works.
pub fn is_installed(cfg: &EbpfConfig) -> bool {
    let pin_dir = &cfg.pin_dir;
    !links::pinned(pin_dir).is_empty()
        || !layouts::our_pins(pin_dir).is_empty()
        || hairpin::present()
}

/// Removes what the eBPF backend installed: its pins (a link goes with
/// its last pin, its program with the link; a map with its last pin) and
/// the legacy tc filters. Files and netlink only, no bpf(2): a process
/// without CAP_BPF, whose seccomp profile refuses bpf(2) (the chart's nft
/// pod), retires an eBPF datapath too. The pin directory stays where it is
/// a mount point (the chart mounts it into the pod).
///
/// The legacy tc filters (kernels before 6.6) go first, one netlink request
/// each (where tcx links are used there are none); then the map pins, which
/// the programs keep alive while attached; the link pins last, together. A
/// switch calls this only after the other backend is awake (`backend.rs`).
pub fn remove_installed(cfg: &EbpfConfig) -> Result<(), EbpfError> {
    let pin_dir = &cfg.pin_dir;
    // Legacy attachments (tc filters) are not pinned: deleted from
    // every interface at their fixed place.
    let rtnl = NlSocket::open(libc::NETLINK_ROUTE)?;
    for link in route::links(&rtnl)? {
        links::delete_tc_filters(&link.name);
    }
    // The programs hold their maps: the map pins can go first.
    for pin in layouts::our_pins(pin_dir) {
        let _ = fs::remove_file(pin);
    }
    links::detach_all(pin_dir);
    chain::set_behind(0);
    // Nothing marks packets for it any more.
    hairpin::remove()?;
    let _ = fs::remove_dir(links::links_dir(pin_dir));
    let _ = fs::remove_dir(pin_dir);
    Ok(())
}

/// Loads every program of the embedded object into the kernel (and unloads
/// them again); returns their names.
pub fn load_check() -> Result<Vec<String>, EbpfError> {
    if OBJECT.is_empty() {
        return Err(EbpfError::NotBuilt);
    }
    let mut ebpf = aya::Ebpf::load(OBJECT)?;
    let mut names = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let err = |source| EbpfError::Program {
            name: name.to_string(),
            source,
        };
        match program {
            aya::programs::Program::Xdp(xdp) => xdp.load().map_err(err)?,
            program => {
                let tc: &mut SchedClassifier = program.try_into().map_err(err)?;
                tc.load().map_err(err)?;
            }
        }
        names.push(name.to_string());
    }
    names.sort();
    Ok(names)
}
