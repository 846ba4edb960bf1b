//! Attaching the two programs to interfaces, with links pinned under
//! `<pin dir>/links/` so they outlive the process: a restart re-points them
//! to the new programs atomically (`bpf_link_update`), never detaching.
use super::EbpfError;
use crate::netlink::route::Link;
use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        tc::{self, SchedClassifierLink},
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

pub fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier, EbpfError> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| EbpfError::Missing(name.to_string()))?;
    prog.try_into().map_err(|source| EbpfError::Program {
        name: name.to_string(),
        source,
    })
}

/// Attaches both programs to `link`, or re-points its pinned links.
pub fn attach(ebpf: &mut Ebpf, pin_dir: &Path, link: &Link) -> Result<(), EbpfError> {
    for (name, hook, hook_name) in PROGRAMS {
        let pin = pin_path(pin_dir, link.index, hook_name);
        let prog = program(ebpf, name)?;
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
            // A netlink (pre-tcx) attachment is not a BPF link: it stays in
            // the qdisc after we exit, as long as we do not detach it.
            Err(_) => {
                warn!(interface = %link.name, "no tcx on this kernel: legacy tc attachment, replaced on restart")
            }
        }
        info!(interface = %link.name, hook = hook_name, "attached");
    }
    Ok(())
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
