//! The XDP program on the node's uplinks (`--xdp`; where and in which mode:
//! `xdp_place.rs`): attached as a BPF link pinned at
//! `<pin dir>/links/if<index>-xdp`, which outlives the process; a restart
//! re-points it to the new program (`bpf_link_update`), never detaching.
//! And `xdp_targets`, the device map of the interfaces the program may
//! redirect into: every interface whose driver takes redirected frames
//! now, as the kernel reports it (a veth while its peer has an XDP program
//! or GRO on). Both are looked at again at every upkeep (each second), so
//! a pod whose peer turns GRO on is a target within a second, and one
//! that turns it off stops being one within a second (a vanished
//! interface leaves the map with the interface itself).
use super::links;
use super::xdp_place::{decide, takes_frames, Placement, Uplink, XdpChoice, XdpMode};
use super::EbpfError;
use crate::netlink::{netdev, route, NlSocket};
use aya::{
    maps::{DevMapHash, Map, MapData},
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
        Xdp,
    },
    Ebpf,
};
use cozy_proxy_common::maps as names;
use serde_json::json;
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};
use tracing::{info, warn};

pub const PROGRAM: &str = "cozy_xdp";
const HOOK: &str = "xdp";

fn pin_path(pin_dir: &Path, ifindex: u32) -> PathBuf {
    links::links_dir(pin_dir).join(format!("if{ifindex}-{HOOK}"))
}

/// The interface's driver: a virtual device's kind, else the name of the
/// driver bound to its device in sysfs ("" when neither says).
fn driver(link: &route::Link) -> String {
    if !link.info_kind.is_empty() {
        return link.info_kind.clone();
    }
    fs::read_link(format!("/sys/class/net/{}/device/driver", link.name))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

/// An uplink as last seen: its name and what became of it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    name: String,
    placement: Placement,
    /// Why attaching failed, if it did (retried at each upkeep).
    error: Option<String>,
}

pub struct XdpUplinks {
    choice: XdpChoice,
    genl: NlSocket,
    targets: DevMapHash<MapData>,
    /// What `targets` holds.
    held: BTreeSet<u32>,
    seen: BTreeMap<u32, Seen>,
}

impl XdpUplinks {
    pub fn open(choice: XdpChoice, pin_dir: &Path) -> Result<Self, EbpfError> {
        let name = names::XDP_TARGETS;
        let data = MapData::from_pin(super::layouts::pin_path(pin_dir, name))
            .map_err(super::maps::named(name))?;
        let targets =
            DevMapHash::try_from(Map::from_map_data(data).map_err(super::maps::named(name))?)
                .map_err(super::maps::named(name))?;
        let held = targets.keys().filter_map(Result::ok).collect();
        Ok(XdpUplinks {
            choice,
            genl: NlSocket::open(libc::NETLINK_GENERIC)?,
            targets,
            held,
            seen: BTreeMap::new(),
        })
    }

    /// Keeps the targets and the uplinks' attachments as the kernel's
    /// state asks (see the module's doc). One uplink that cannot be
    /// attached keeps the others from nothing.
    pub fn upkeep(
        &mut self,
        ebpf: &mut Ebpf,
        rtnl: &NlSocket,
        all: &[route::Link],
        pin_dir: &Path,
    ) -> Result<(), EbpfError> {
        // Without the netdev family (before 6.3) no driver's abilities are
        // known: nothing is a target, and `auto` attaches nowhere.
        let features = netdev::xdp_features(&self.genl).unwrap_or_default();
        self.sync_targets(&features)?;
        let uplinks = route::default_route_interfaces(rtnl)?;
        let prog = program(ebpf)?;
        let our_id = prog.info().map(|i| i.id()).ok();
        let mut seen = BTreeMap::new();
        for link in all.iter().filter(|l| uplinks.contains(&l.index)) {
            let pin = pin_path(pin_dir, link.index);
            let pinned_id = pinned_program(&pin);
            let ours = link
                .xdp
                .is_some_and(|a| Some(a.prog_id) == our_id || Some(a.prog_id) == pinned_id);
            let driver = driver(link);
            let u = Uplink {
                driver: &driver,
                features: features.get(&link.index).copied(),
                attached: link.xdp,
                ours,
            };
            let placement = decide(self.choice, &u);
            let error = match &placement {
                Placement::Attach { mode } => attach(prog, link, *mode, &pin, our_id)
                    .err()
                    .map(|e| e.to_string()),
                _ => {
                    if ours || pinned_id.is_some() {
                        let _ = fs::remove_file(&pin);
                    }
                    None
                }
            };
            let now = Seen {
                name: link.name.clone(),
                placement,
                error,
            };
            if self.seen.get(&link.index) != Some(&now) {
                say(&now);
            }
            seen.insert(link.index, now);
        }
        // An interface that is no uplink any more loses our program.
        for (index, path) in links::pinned(pin_dir) {
            if path.to_string_lossy().ends_with(&format!("-{HOOK}")) && !seen.contains_key(&index) {
                let _ = fs::remove_file(&path);
                info!(ifindex = index, "no longer an uplink; XDP program detached");
            }
        }
        self.seen = seen;
        Ok(())
    }

    /// `xdp_targets` equal to the interfaces that take redirected frames.
    fn sync_targets(&mut self, features: &BTreeMap<u32, u64>) -> Result<(), EbpfError> {
        let want: BTreeSet<u32> = (features.iter())
            .filter(|(_, f)| takes_frames(**f))
            .map(|(i, _)| *i)
            .collect();
        let named = super::maps::named(names::XDP_TARGETS);
        for gone in self.held.difference(&want).copied().collect::<Vec<_>>() {
            super::maps::absent_ok(self.targets.remove(gone)).map_err(&named)?;
            self.held.remove(&gone);
        }
        for new in want.difference(&self.held).copied().collect::<Vec<_>>() {
            // An interface that vanished since the dump is refused; the
            // next upkeep no longer asks for it.
            if self.targets.insert(new, new, None, 0).is_ok() {
                self.held.insert(new);
            }
        }
        Ok(())
    }
}

/// For `dump`, from the kernel alone (a process of its own reads it): the
/// interfaces our pinned XDP links are on, each with the mode IFLA_XDP
/// reports; the uplinks another agent's XDP program holds (`uplinks`: the
/// default routes' interfaces), which the TC programs serve; and the
/// interfaces in `xdp_targets`.
pub fn describe(pin_dir: &Path, all: &[route::Link], uplinks: &BTreeSet<u32>) -> serde_json::Value {
    let name_of = |index: u32| {
        all.iter()
            .find(|l| l.index == index)
            .map(|l| l.name.clone())
    };
    let pins: Vec<(u32, PathBuf)> = (links::pinned(pin_dir).into_iter())
        .filter(|(_, path)| path.to_string_lossy().ends_with(&format!("-{HOOK}")))
        .collect();
    let ours: BTreeSet<u32> = pins.iter().filter_map(|(_, p)| pinned_program(p)).collect();
    let theirs: Vec<(u32, u32)> = (all.iter())
        .filter(|l| uplinks.contains(&l.index))
        .filter_map(|l| l.xdp.map(|a| (l.index, a.prog_id)))
        .filter(|(_, id)| !ours.contains(id))
        .collect();
    let their_names =
        super::chain::program_names(&theirs.iter().map(|(_, id)| *id).collect::<Vec<_>>());
    let held: Vec<_> = (theirs.iter())
        .map(|(index, id)| {
            json!({ "ifindex": index, "interface": name_of(*index), "program_id": id, "program": their_names.get(id) })
        })
        .collect();
    let attached: Vec<_> = (pins.into_iter())
        .map(|(index, _)| {
            let link = all.iter().find(|l| l.index == index);
            let mode = match link.and_then(|l| l.xdp).map(|a| a.mode) {
                Some(m) if m == XdpMode::Native.attached() => "native",
                Some(m) if m == XdpMode::Generic.attached() => "generic",
                Some(_) => "other",
                None => "detached",
            };
            json!({ "ifindex": index, "interface": name_of(index), "mode": mode })
        })
        .collect();
    let targets: Vec<_> = MapData::from_pin(super::layouts::pin_path(pin_dir, names::XDP_TARGETS))
        .ok()
        .and_then(|d| Map::from_map_data(d).ok())
        .and_then(|m| DevMapHash::try_from(m).ok())
        .map(|m| m.keys().filter_map(Result::ok).collect::<Vec<u32>>())
        .unwrap_or_default()
        .into_iter()
        .map(|index| json!({ "ifindex": index, "interface": name_of(index) }))
        .collect();
    json!({ "attached": attached, "held_by_others": held, "targets": targets })
}

fn say(s: &Seen) {
    match (&s.placement, &s.error) {
        (Placement::Attach { mode }, None) => {
            info!(interface = %s.name, mode = ?mode, "XDP program on the uplink")
        }
        (Placement::Attach { mode }, Some(e)) => {
            warn!(interface = %s.name, mode = ?mode, error = %e, "attaching the XDP program failed; the TC programs serve the uplink; retrying every second")
        }
        (Placement::Held { program_id }, _) => {
            warn!(interface = %s.name, program_id, "another XDP program is on the uplink; ours stays off it and the TC programs serve it")
        }
        (Placement::Skipped { why }, _) => {
            info!(interface = %s.name, why, "no XDP program on the uplink")
        }
    }
}

/// Loads the XDP program of `ebpf` into the kernel.
pub fn load(ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    program(ebpf)?.load().map_err(|source| EbpfError::Program {
        name: PROGRAM.to_string(),
        source,
    })
}

fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, EbpfError> {
    let prog = ebpf
        .program_mut(PROGRAM)
        .ok_or_else(|| EbpfError::Missing(PROGRAM.to_string()))?;
    prog.try_into().map_err(|source| EbpfError::Program {
        name: PROGRAM.to_string(),
        source,
    })
}

/// The program id of the link pinned at `pin`, if one is.
fn pinned_program(pin: &Path) -> Option<u32> {
    let link = PinnedLink::from_pin(pin).ok()?;
    Some(FdLink::from(link).info().ok()?.program_id())
}

/// Puts `prog` on `link` in `mode`: the pinned link re-pointed to it when
/// it runs another program, or a new link pinned (replacing a pinned one
/// of another mode only once the new one is attached is not possible: an
/// interface holds one program per mode, so that one goes first).
fn attach(
    prog: &mut Xdp,
    link: &route::Link,
    mode: XdpMode,
    pin: &Path,
    our_id: Option<u32>,
) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Attach {
        interface: link.name.clone(),
        source,
    };
    let same_mode = link.xdp.is_some_and(|a| a.mode == mode.attached());
    if let Ok(pinned) = PinnedLink::from_pin(pin) {
        let fd_link = FdLink::from(pinned);
        let current = fd_link.info().ok().map(|i| i.program_id());
        if same_mode && current.is_some() && current == our_id {
            return Ok(());
        }
        if same_mode {
            if let Ok(l) = XdpLink::try_from(fd_link) {
                let id = prog.attach_to_link(l).map_err(err)?;
                // The pin keeps the link; our handle can go.
                drop(prog.take_link(id).map_err(err)?);
                return Ok(());
            }
        }
        let _ = fs::remove_file(pin);
    }
    let aya_mode = match mode {
        XdpMode::Native => aya::programs::XdpMode::Driver,
        XdpMode::Generic => aya::programs::XdpMode::Skb,
    };
    let id = prog.attach_to_if_index(link.index, aya_mode).map_err(err)?;
    let fd_link =
        FdLink::try_from(prog.take_link(id).map_err(err)?).map_err(|e| EbpfError::Io {
            path: pin.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    fd_link.pin(pin).map_err(|source| EbpfError::PinLink {
        path: pin.to_path_buf(),
        source,
    })?;
    Ok(())
}
