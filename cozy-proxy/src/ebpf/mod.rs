//! The eBPF datapath: TC programs on the node's interfaces, BPF hash maps
//! kept equal to the plan, and one host route per mapping that steers the
//! LB IP to its pod (see docs/ebpf-datapath.md for why).
mod links;
mod maps;
mod routes;

use crate::datapath::{Applied, BackendKind, Counters, DatapathState, Dump, Kernel, StateDiff};
use crate::netlink::{route, NetlinkError, NlSocket};
use aya::{maps::MapError, programs::SchedClassifier, EbpfLoader};
use cozy_proxy_common::maps as names;
use maps::Maps;
use serde_json::json;
use std::{
    collections::BTreeSet,
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
};
use tracing::warn;

/// The object built from `cozy-proxy-ebpf` by build.rs (empty when the
/// crate was built without the eBPF toolchain: see build.rs).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("COZY_PROXY_EBPF_OBJ"));

pub use cozy_proxy_common::PIN_DIR;

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("this binary was built without its eBPF programs (COZY_PROXY_BUILD_EBPF=0)")]
    NotBuilt,
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
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("pinning {path}: {source}")]
    PinLink {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
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

/// The loaded programs and where they are attached.
struct Programs {
    ebpf: aya::Ebpf,
    /// Link notifications (RTMGRP_LINK): interfaces to follow.
    link_events: NlSocket,
    attached: BTreeSet<u32>,
}

pub struct EbpfKernel {
    cfg: EbpfConfig,
    /// `None` when opened only to inspect or clean up.
    programs: Option<Programs>,
    /// `None` when nothing is pinned (opened on a node without our state).
    maps: Option<Maps>,
    rtnl: NlSocket,
    /// LB IPs our host routes steer, as of our last change (reset by every
    /// read of the kernel).
    known_routes: Option<BTreeSet<IpAddr>>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EbpfError + '_ {
    move |source| EbpfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl EbpfKernel {
    /// What is pinned under `cfg.pin_dir`, without loading anything: for
    /// `dump` and `cleanup`.
    pub fn open(cfg: EbpfConfig) -> Result<Self, EbpfError> {
        let maps = if cfg.pin_dir.join(names::SVC_POD).exists() {
            Some(Maps::open(&cfg.pin_dir)?)
        } else {
            None
        };
        Ok(EbpfKernel {
            cfg,
            programs: None,
            maps,
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            known_routes: None,
        })
    }

    /// Loads the programs (reusing pinned maps) and attaches them.
    pub fn start(cfg: EbpfConfig) -> Result<Self, EbpfError> {
        if OBJECT.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        let links_dir = links::links_dir(&cfg.pin_dir);
        fs::create_dir_all(&links_dir).map_err(io(&links_dir))?;
        maps::drop_incompatible_pins(&cfg.pin_dir);
        let mut loader = EbpfLoader::new();
        for name in names::ALL {
            loader.map_pin_path(name, cfg.pin_dir.join(name));
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
        let mut kernel = EbpfKernel {
            maps: Some(Maps::open(&cfg.pin_dir)?),
            cfg,
            programs: Some(Programs {
                ebpf,
                link_events: NlSocket::subscribe(libc::NETLINK_ROUTE, libc::RTMGRP_LINK as u32)?,
                attached: BTreeSet::new(),
            }),
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            known_routes: None,
        };
        kernel.follow_interfaces()?;
        Ok(kernel)
    }

    /// Attaches to interfaces not yet attached (new pod veths), forgets
    /// vanished ones.
    fn follow_interfaces(&mut self) -> Result<(), EbpfError> {
        let Some(p) = self.programs.as_mut() else {
            return Ok(());
        };
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
                        None if p.attached.is_empty() => {
                            warn!(interface = %n, "interface not found yet")
                        }
                        None => {}
                    }
                }
                v
            }
        };
        for link in wanted {
            if p.attached.contains(&link.index) {
                continue;
            }
            links::attach(&mut p.ebpf, &self.cfg.pin_dir, link)?;
            p.attached.insert(link.index);
        }
        p.attached.retain(|i| live.contains(i));
        links::forget_vanished(&self.cfg.pin_dir, &live);
        Ok(())
    }

    /// The error for a sync or a read where nothing is pinned.
    fn no_pins(&self) -> EbpfError {
        EbpfError::Io {
            path: self.cfg.pin_dir.join(names::SVC_POD),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }
    }

    fn maps(&self) -> Result<&Maps, EbpfError> {
        self.maps.as_ref().ok_or_else(|| self.no_pins())
    }
}

impl Kernel for EbpfKernel {
    type Error = EbpfError;
    /// The LB IPs our routes steer now.
    type Found = BTreeSet<IpAddr>;

    fn kind(&self) -> BackendKind {
        BackendKind::Ebpf
    }

    fn read(&mut self) -> Result<(DatapathState, Self::Found), EbpfError> {
        self.known_routes = None;
        let state = self.maps()?.read_state()?;
        let routes = route::tagged_destinations(&self.rtnl, cozy_proxy_common::ROUTE_PROTO)?;
        Ok((state, routes))
    }

    /// Maps first, then routes: an LB IP is steered to its pod only once
    /// the rewrite for it is in place.
    fn apply(
        &mut self,
        diff: &StateDiff,
        desired: &DatapathState,
        found: Option<Self::Found>,
    ) -> Result<Applied, EbpfError> {
        let fresh = found.is_some();
        let have = match (found, self.known_routes.take()) {
            (Some(found), _) | (None, Some(found)) => found,
            (None, None) => route::tagged_destinations(&self.rtnl, cozy_proxy_common::ROUTE_PROTO)?,
        };
        match self.maps.as_mut() {
            Some(maps) => maps.apply(diff, desired)?,
            None => return Err(self.no_pins()),
        }
        let (installed, changes) = routes::sync(&self.rtnl, have, diff, desired, fresh)?;
        self.known_routes = Some(installed);
        Ok(Applied {
            extra_changes: changes,
            installed_schema: fresh,
        })
    }

    fn upkeep(&mut self) -> Result<(), EbpfError> {
        // Rescan only when the kernel announced a link change.
        let changed = match &self.programs {
            Some(p) => p.link_events.pending_events()? > 0,
            None => false,
        };
        if changed {
            self.follow_interfaces()?;
        }
        Ok(())
    }

    fn dump(&self) -> Result<Dump, EbpfError> {
        let Some(maps) = &self.maps else {
            return Ok(Dump {
                backend: BackendKind::Ebpf,
                installed: false,
                state: DatapathState::default(),
                counters: Counters::default(),
                details: json!({}),
            });
        };
        let pin_dir = &self.cfg.pin_dir;
        let links_by_index = route::links(&self.rtnl)?;
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
        let routes: Vec<String> = route::host_routes(&self.rtnl, cozy_proxy_common::ROUTE_PROTO)?
            .iter()
            .map(|(dst, gw)| format!("{dst} via {gw}"))
            .collect();
        Ok(Dump {
            backend: BackendKind::Ebpf,
            installed: true,
            state: maps.read_state()?,
            counters: maps.counters()?,
            details: json!({
                "pin_dir": pin_dir,
                "attachments": attachments,
                "routes": routes,
            }),
        })
    }

    fn counters(&self) -> Result<Counters, EbpfError> {
        self.maps()?.counters()
    }

    /// Removes routes, attachments and pinned maps.
    fn cleanup(&mut self) -> Result<(), EbpfError> {
        self.known_routes = None;
        self.maps = None;
        self.programs = None;
        let pin_dir = &self.cfg.pin_dir;
        let routes: Vec<IpAddr> =
            route::tagged_destinations(&self.rtnl, cozy_proxy_common::ROUTE_PROTO)?
                .into_iter()
                .collect();
        route::delete_host_routes(&self.rtnl, cozy_proxy_common::ROUTE_PROTO, &routes)?;
        links::detach_all(pin_dir);
        for name in names::ALL {
            let _ = fs::remove_file(pin_dir.join(name));
        }
        let _ = fs::remove_dir(links::links_dir(pin_dir));
        let _ = fs::remove_dir(pin_dir);
        Ok(())
    }
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
        let tc: &mut SchedClassifier = program.try_into().map_err(err)?;
        tc.load().map_err(err)?;
        names.push(name.to_string());
    }
    names.sort();
    Ok(names)
}
