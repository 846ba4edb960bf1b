//! Attaching the two programs to interfaces, with links pinned under
//! `<pin dir>/links/` so they outlive the process: a restart re-points them
//! to the new programs atomically (`bpf_link_update`), never detaching.
//!
//! Before tcx (kernels before 6.6, or `--tc-attach netlink`) a program is a
//! tc filter in the interface's clsact qdisc, which is no BPF link and
//! cannot be pinned (nor can a record of it: a bpffs holds no plain
//! files). Our filters therefore sit at a fixed place, priority
//! [`TC_PRIORITY`] and handle [`TC_HANDLE`] on each hook, as Cilium's do:
//! a restart replaces the program of that very filter in place (netlink,
//! without NLM_F_CREATE), and cleanup deletes it on every interface.
//! Without that, each restart added one more filter and cleanup left them
//! running.
use super::EbpfError;
use super::TcAttach;
use crate::netlink::route::Link;
use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions},
        SchedClassifier, TcAttachType,
    },
    Ebpf,
};
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};
use tracing::{debug, info, warn};

/// (program, hook, name in pin files)
pub const PROGRAMS: [(&str, TcAttachType, &str); 2] = [
    ("cozy_ingress", TcAttachType::Ingress, "ingress"),
    ("cozy_egress", TcAttachType::Egress, "egress"),
];

pub fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

fn pin_path(pin_dir: &Path, ifindex: u32, hook: &str) -> PathBuf {
    links_dir(pin_dir).join(format!("if{ifindex}-{hook}"))
}

/// Where our tc filters sit on each clsact hook (legacy attachments).
pub const TC_PRIORITY: u16 = 1;
pub const TC_HANDLE: u32 = 0xc0;

fn our_filter(interface: &str, hook: TcAttachType) -> std::io::Result<SchedClassifierLink> {
    SchedClassifierLink::attached(interface, hook, TC_PRIORITY, TC_HANDLE.into(), None)
}

/// Attaches `prog` to `link`'s `hook` as our tc filter: the program of the
/// one already there is replaced in place, else the filter is added.
fn attach_tc_filter(
    prog: &mut SchedClassifier,
    link: &Link,
    hook: TcAttachType,
) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Attach {
        interface: link.name.clone(),
        source,
    };
    let _ = tc::qdisc_add_clsact(&link.name);
    let existing = our_filter(&link.name, hook).map_err(|e| err(e.into()))?;
    let id = match prog.attach_to_link(existing) {
        Ok(id) => id,
        // Not there yet (or gone): added at our place.
        Err(_) => prog
            .attach_with_options(
                &link.name,
                hook,
                TcAttachOptions::Netlink(NlOptions {
                    priority: TC_PRIORITY,
                    handle: TC_HANDLE.into(),
                    ..Default::default()
                }),
            )
            .map_err(err)?,
    };
    // Not dropped: dropping a tc link deletes the filter.
    std::mem::forget(prog.take_link(id).map_err(err)?);
    Ok(())
}

/// Deletes our tc filters (if any) from `interface`'s hooks.
pub fn delete_tc_filters(interface: &str) {
    for (_, hook, _) in PROGRAMS {
        // Dropping the link deletes the filter; absent, nothing happens.
        if let Ok(link) = our_filter(interface, hook) {
            drop(link);
        }
    }
}

pub fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier, EbpfError> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| EbpfError::Missing(name.to_string()))?;
    prog.try_into().map_err(|source| EbpfError::Program {
        name: name.to_string(),
        source,
    })
}

/// Attaches both programs to `link`, or re-points its pinned links (or
/// its recorded tc filters).
pub fn attach(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    link: &Link,
    mode: TcAttach,
) -> Result<(), EbpfError> {
    let tcx = mode == TcAttach::Auto && tcx_available();
    for (name, hook, hook_name) in PROGRAMS {
        let pin = pin_path(pin_dir, link.index, hook_name);
        let prog = program(ebpf, name)?;
        if !tcx {
            attach_tc_filter(prog, link, hook)?;
            info!(interface = %link.name, hook = hook_name, "attached (tc filter)");
            continue;
        }
        let err = |source| EbpfError::Attach {
            interface: link.name.clone(),
            source,
        };
        if let Ok(pinned) = PinnedLink::from_pin(&pin) {
            match SchedClassifierLink::try_from(FdLink::from(pinned)) {
                Ok(l) => match prog.attach_to_link(l) {
                    Ok(id) => {
                        // The pin keeps the link; our handle can go.
                        drop(prog.take_link(id).map_err(err)?);
                        debug!(interface = %link.name, hook = hook_name, "re-pointed pinned link");
                        continue;
                    }
                    Err(e) => {
                        warn!(interface = %link.name, error = %e, "stale pinned link; attaching anew")
                    }
                },
                Err(e) => {
                    warn!(interface = %link.name, error = %e, "pinned file is not a TC link; attaching anew")
                }
            }
            let _ = fs::remove_file(&pin);
        }
        // clsact is only needed where the kernel has no tcx; harmless else.
        let _ = tc::qdisc_add_clsact(&link.name);
        let id = prog.attach(&link.name, hook).map_err(err)?;
        let tc_link = prog.take_link(id).map_err(err)?;
        match FdLink::try_from(tc_link) {
            Ok(fd_link) => {
                fd_link.pin(&pin).map_err(|source| EbpfError::PinLink {
                    path: pin.clone(),
                    source,
                })?;
            }
            // tcx_available() said yes: not expected.
            Err(_) => {
                warn!(interface = %link.name, "attached as a tc filter although tcx was expected")
            }
        }
        info!(interface = %link.name, hook = hook_name, "attached");
    }
    Ok(())
}

/// Does this kernel attach TC programs as tcx links? They came in 6.6;
/// read once from the kernel's release.
fn tcx_available() -> bool {
    static TCX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TCX.get_or_init(|| {
        let (major, minor) = kernel_version();
        (major, minor) >= (6, 6)
    })
}

/// The running kernel's (major, minor), from uname.
fn kernel_version() -> (u32, u32) {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse().ok());
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// `(ifindex, pin file)` of every pinned link.
pub fn pinned(pin_dir: &Path) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = fs::read_dir(links_dir(pin_dir)) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?;
            let index = name.strip_prefix("if")?.split('-').next()?.parse().ok()?;
            Some((index, p))
        })
        .collect()
}

/// Drops pins of interfaces that are gone (their links died with them).
pub fn forget_vanished(pin_dir: &Path, live: &BTreeSet<u32>) {
    for (index, path) in pinned(pin_dir) {
        if !live.contains(&index) {
            let _ = fs::remove_file(&path);
            info!(ifindex = index, "interface gone; dropped its pinned link");
        }
    }
}

/// Detaches everything: removing the pins releases the links.
pub fn detach_all(pin_dir: &Path) {
    for (_, path) in pinned(pin_dir) {
        let _ = fs::remove_file(&path);
    }
}
