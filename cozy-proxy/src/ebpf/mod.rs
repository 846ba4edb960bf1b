//! The eBPF datapath: TC programs on the node's interfaces, BPF hash maps
//! kept equal to the plan, and one host route per mapping that steers the
//! LB IP to its pod (see docs/ebpf-datapath.md for why).
mod links;
mod maps;

use crate::datapath::{BackendKind, Datapath, DatapathState, Dump, StateDiff, SyncReport};
use crate::netlink::{route, NetlinkError, NlSocket};
use aya::{maps::MapError, programs::SchedClassifier, EbpfLoader};
use cozy_proxy_common::{
    maps as names, Counter, FilterPolicy, FlowKey, FragKey, IpKey, PortKey, ServiceCounters,
    ROUTE_PROTO,
};
use maps::Maps;
use serde_json::json;
use std::{
    collections::BTreeSet,
    fs,
    mem::size_of,
    net::IpAddr,
    path::{Path, PathBuf},
};
use tracing::warn;

/// The object built from `cozy-proxy-ebpf` by build.rs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("COZY_PROXY_EBPF_OBJ"));

pub use cozy_proxy_common::PIN_DIR;

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {0} missing from the object")]
    Missing(String),
    #[error("program {name}: {source}")]
    Program {
        name: String,
        source: aya::programs::ProgramError,
    },
    #[error("attaching to {interface}: {source}")]
    Attach {
        interface: String,
        source: aya::programs::ProgramError,
    },
    #[error("map {name}: {source}")]
    Map { name: String, source: MapError },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("interface {0} does not exist")]
    NoSuchInterface(String),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
}

impl From<MapError> for EbpfError {
    fn from(source: MapError) -> Self {
        EbpfError::Map {
            name: "?".into(),
            source,
        }
    }
}

/// Which interfaces get the programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Interfaces {
    /// Every Ethernet-type interface but loopback, following links that
    /// appear and disappear.
    Auto,
    Named(Vec<String>),
}

impl std::str::FromStr for Interfaces {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Interfaces::Auto);
        }
        let names: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Err("give \"auto\" or a comma-separated list of interfaces".into());
        }
        Ok(Interfaces::Named(names))
    }
}

#[derive(Clone, Debug)]
pub struct EbpfConfig {
    /// bpffs directory for the pinned maps and links.
    pub pin_dir: PathBuf,
    pub interfaces: Interfaces,
}

/// Key and value sizes the current programs expect, to refuse reusing a
/// pinned map of an older, different layout.
fn expected_sizes(name: &str) -> Option<(usize, usize)> {
    Some(match name {
        names::POD_SVC | names::SVC_POD => (size_of::<IpKey>(), size_of::<IpKey>()),
        names::FILTERED_PODS => (size_of::<IpKey>(), size_of::<FilterPolicy>()),
        names::ALLOWED_PORTS => (size_of::<PortKey>(), 1),
        names::UNMAPPED_LBS => (size_of::<IpKey>(), 1),
        names::FLOWS => (size_of::<FlowKey>(), 8),
        names::FRAGS => (size_of::<FragKey>(), 8),
        names::SVC_STATS => (size_of::<IpKey>(), size_of::<ServiceCounters>()),
        names::DROP_STATS => (4, size_of::<Counter>()),
        _ => return None,
    })
}

fn drop_incompatible_pins(pin_dir: &Path) {
    for name in names::ALL {
        let path = pin_dir.join(name);
        let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
            continue;
        };
        if let Some((k, v)) = expected_sizes(name) {
            if info.key_size() as usize != k || info.value_size() as usize != v {
                warn!(map = name, "pinned map has another layout; replacing it");
                let _ = fs::remove_file(&path);
            }
        }
    }
}

pub struct EbpfBackend {
    cfg: EbpfConfig,
    ebpf: aya::Ebpf,
    maps: Maps,
    rtnl: NlSocket,
    /// Link notifications (RTMGRP_LINK): interfaces to follow.
    link_events: NlSocket,
    known: Option<DatapathState>,
    /// LB IPs our host routes steer, as of our last change.
    known_routes: Option<BTreeSet<IpAddr>>,
    attached: BTreeSet<u32>,
}

impl EbpfBackend {
    /// Loads the programs (reusing pinned maps) and attaches them.
    pub fn new(cfg: EbpfConfig) -> Result<Self, EbpfError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EbpfError::Pin { path, source }
        };
        let links_dir = links::links_dir(&cfg.pin_dir);
        fs::create_dir_all(&links_dir).map_err(io(&links_dir))?;
        drop_incompatible_pins(&cfg.pin_dir);
        let mut loader = EbpfLoader::new();
        for name in names::ALL {
            loader.map_pin_path(name, cfg.pin_dir.join(name));
        }
        let mut ebpf = loader.load(OBJECT)?;
        for (name, _, _) in links::PROGRAMS {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| EbpfError::Missing(name.into()))?
                .try_into()
                .map_err(|source| EbpfError::Program {
                    name: name.into(),
                    source,
                })?;
            prog.load().map_err(|source| EbpfError::Program {
                name: name.into(),
                source,
            })?;
        }
        let maps = Maps::open(&cfg.pin_dir)?;
        let mut backend = EbpfBackend {
            cfg,
            ebpf,
            maps,
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            link_events: NlSocket::subscribe(libc::NETLINK_ROUTE, libc::RTMGRP_LINK as u32)?,
            known: None,
            known_routes: None,
            attached: BTreeSet::new(),
        };
        backend.follow_interfaces()?;
        Ok(backend)
    }

    /// Attaches to interfaces not yet attached (new pod veths), forgets
    /// vanished ones.
    fn follow_interfaces(&mut self) -> Result<(), EbpfError> {
        let all = route::links(&self.rtnl)?;
        let live: BTreeSet<u32> = all.iter().map(|l| l.index).collect();
        let wanted: Vec<&route::Link> = match &self.cfg.interfaces {
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
                        None if self.attached.is_empty() => {
                            warn!(interface = %n, "interface not found yet")
                        }
                        None => {}
                    }
                }
                v
            }
        };
        for link in wanted {
            if self.attached.contains(&link.index) {
                continue;
            }
            links::attach(&mut self.ebpf, &self.cfg.pin_dir, link)?;
            self.attached.insert(link.index);
        }
        self.attached.retain(|i| live.contains(i));
        links::forget_vanished(&self.cfg.pin_dir, &live);
        Ok(())
    }

    /// One host route per mapping: the LB IP goes where the kernel sends
    /// the pod IP (its own route: the pod's veth on this node, or the next
    /// hop toward the pod's node), so the egress program on that interface
    /// rewrites it. A mapping whose pod cannot be routed to is reported and
    /// retried at the next resync; it does not hold up the others.
    fn sync_routes(
        &mut self,
        diff: &StateDiff,
        desired: &DatapathState,
    ) -> Result<usize, EbpfError> {
        let first = self.known_routes.is_none();
        let have = match self.known_routes.take() {
            Some(h) => h,
            None => route::tagged_destinations(&self.rtnl, ROUTE_PROTO)?,
        };
        let remove: Vec<IpAddr> = have
            .iter()
            .filter(|lb| !desired.svc_pod.contains_key(lb))
            .copied()
            .collect();
        route::delete_host_routes(&self.rtnl, ROUTE_PROTO, &remove)?;
        // New or moved mappings; at the first sync (or after drift) all of
        // them, since a pod's path may have changed meanwhile.
        let changed: BTreeSet<IpAddr> = diff.svc_pod.add.iter().map(|(lb, _)| *lb).collect();
        let mut installed: BTreeSet<IpAddr> = have
            .into_iter()
            .filter(|lb| desired.svc_pod.contains_key(lb))
            .collect();
        let mut count = remove.len();
        for (lb, pod) in &desired.svc_pod {
            if !first && installed.contains(lb) && !changed.contains(lb) {
                continue;
            }
            // On the pod's own link (no gateway), the pod itself is the
            // next hop: the frame gets its MAC.
            let result = route::lookup(&self.rtnl, pod).and_then(|via| {
                let via = route::NextHop {
                    gateway: via.gateway.or(Some(*pod)),
                    ..via
                };
                route::set_host_route(&self.rtnl, ROUTE_PROTO, lb, &via)
            });
            match result {
                Ok(()) => {
                    installed.insert(*lb);
                    count += 1;
                }
                Err(e) => {
                    installed.remove(lb);
                    warn!(lb = %lb, pod = %pod, error = %e, "no route to the pod; this LB IP is not steered until the next resync");
                }
            }
        }
        self.known_routes = Some(installed);
        Ok(count)
    }

    fn try_sync(&mut self, desired: &DatapathState) -> Result<SyncReport, EbpfError> {
        let mut report = SyncReport::default();
        let known = match self.known.take() {
            Some(k) => k,
            None => {
                report.installed_schema = true;
                crate::datapath::adopt(BackendKind::Ebpf, self.maps.read_state()?)
            }
        };
        let diff = known.diff(desired);
        report.changed_elements = diff.size();
        self.maps.apply(&diff, desired)?;
        self.known = Some(desired.clone());
        // Routes after the maps: an LB IP is steered to its pod only once
        // the rewrite for it is in place.
        report.changed_elements += self.sync_routes(&diff, desired)?;
        Ok(report)
    }

    /// The live state from the pinned maps, without loading anything.
    pub fn inspect(pin_dir: &Path) -> Result<Dump, EbpfError> {
        if !pin_dir.join(names::SVC_POD).exists() {
            return Ok(Dump {
                backend: BackendKind::Ebpf,
                installed: false,
                state: DatapathState::default(),
                details: json!({}),
            });
        }
        let maps = Maps::open(pin_dir)?;
        let rtnl = NlSocket::open(libc::NETLINK_ROUTE)?;
        let links_by_index = route::links(&rtnl)?;
        let attachments: Vec<_> = links::pinned(pin_dir)
            .into_iter()
            .map(|(index, path)| {
                let name = links_by_index
                    .iter()
                    .find(|l| l.index == index)
                    .map(|l| l.name.clone());
                json!({ "ifindex": index, "interface": name, "pin": path })
            })
            .collect();
        let routes: Vec<String> = route::host_routes(&rtnl, ROUTE_PROTO)?
            .iter()
            .map(|(dst, gw)| format!("{dst} via {gw}"))
            .collect();
        Ok(Dump {
            backend: BackendKind::Ebpf,
            installed: true,
            state: maps.read_state()?,
            details: json!({
                "pin_dir": pin_dir,
                "attachments": attachments,
                "routes": routes,
                "counters": maps.counters()?,
            }),
        })
    }

    /// Removes routes, attachments and pinned maps.
    pub fn remove_all(pin_dir: &Path) -> Result<(), EbpfError> {
        let rtnl = NlSocket::open(libc::NETLINK_ROUTE)?;
        let routes: Vec<IpAddr> = route::tagged_destinations(&rtnl, ROUTE_PROTO)?
            .into_iter()
            .collect();
        route::delete_host_routes(&rtnl, ROUTE_PROTO, &routes)?;
        links::detach_all(pin_dir);
        for name in names::ALL {
            let _ = fs::remove_file(pin_dir.join(name));
        }
        let _ = fs::remove_dir(links::links_dir(pin_dir));
        let _ = fs::remove_dir(pin_dir);
        Ok(())
    }
}

impl Datapath for EbpfBackend {
    type Error = EbpfError;

    fn kind(&self) -> BackendKind {
        BackendKind::Ebpf
    }

    fn sync(&mut self, desired: &DatapathState) -> Result<SyncReport, EbpfError> {
        match self.try_sync(desired) {
            Ok(r) => Ok(r),
            Err(e) => {
                // Maps or routes changed behind our back: read again, retry.
                warn!(error = %e, "eBPF sync failed; re-reading the kernel's state and retrying");
                self.known = None;
                self.known_routes = None;
                self.try_sync(desired)
            }
        }
    }

    fn forget(&mut self) {
        self.known = None;
        self.known_routes = None;
    }

    fn tick(&mut self) -> Result<(), EbpfError> {
        // Rescan only when the kernel announced a link change.
        if self.link_events.pending_events()? > 0 {
            self.follow_interfaces()?;
        }
        Ok(())
    }

    fn dump(&self) -> Result<Dump, EbpfError> {
        Self::inspect(&self.cfg.pin_dir)
    }

    fn counters(&self) -> Result<serde_json::Value, EbpfError> {
        Ok(self.maps.counters()?)
    }

    fn cleanup(&mut self) -> Result<(), EbpfError> {
        self.known = None;
        self.known_routes = None;
        self.attached.clear();
        Self::remove_all(&self.cfg.pin_dir)
    }
}

/// Loads every program of the embedded object into the kernel (and unloads
/// them again); returns their names.
pub fn load_check() -> Result<Vec<String>, EbpfError> {
    let mut ebpf = aya::Ebpf::load(OBJECT)?;
    let mut names = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let err = |source| EbpfError::Program {
            name: name.to_string(),
            source,
        };
        let tc: &mut SchedClassifier = program.try_into().map_err(err)?;
        tc.load().map_err(err)?;
        names.push(name.to_string());
    }
    names.sort();
    Ok(names)
}
