//! Attaching the two programs to interfaces, first on each hook, with links
//! pinned under `<pin dir>/links/` so they outlive the process: a restart
//! re-points them to the new programs atomically (`bpf_link_update`), never
//! detaching.
//!
//! Ours run first (see `chain.rs` for why): a tcx link is attached before
//! every other program (`BPF_F_BEFORE`); when another agent later puts its
//! program ahead, ours is put back first by attaching the other loaded
//! instance of the same program at the head (the kernel runs a program once
//! per hook, so it cannot be the same one) and pinning its link over the
//! old one's pin, which lets the old link go: no moment without ours.
//!
//! Before tcx (kernels before 6.6, or `--tc-attach netlink`) a program is a
//! tc filter in the interface's clsact qdisc, which is no BPF link and
//! cannot be pinned (nor can a record of it: a bpffs holds no plain
//! files). Our filters sit at priority [`TC_PRIORITY`] (1, the first there
//! is) under one of the handles [`TC_HANDLES`]: a restart replaces the
//! program of that very filter in place (netlink, without NLM_F_CREATE),
//! and cleanup deletes both on every interface. Within one priority the
//! kernel runs the filter added last first: ours is put ahead of another
//! agent's filter at priority 1 by adding it again under the other handle,
//! then deleting the first.
use super::chain::{self, Place};
use super::EbpfError;
use super::TcAttach;
use crate::netlink::{route::Link, tc, NlSocket};
use aya::{
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::{self as aya_tc, NlOptions, SchedClassifierLink, TcAttachOptions},
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
pub const TC_HANDLES: [u32; 2] = [0xc0, 0xc1];
/// ETH_P_ALL: the protocol our filters (aya's) match.
const ETH_P_ALL: u16 = 3;

/// Is this tc filter one of ours?
pub fn is_our_filter(f: &tc::Filter) -> bool {
    f.priority == TC_PRIORITY && TC_HANDLES.contains(&f.handle) && f.kind == "bpf"
}

/// A filter that runs at our priority or before, and that ours cannot be
/// put ahead of: at a lower priority number (none is lower than ours), or
/// at ours but not of ours' kind (one priority holds one classifier kind
/// and protocol: the kernel refuses ours there).
fn blocks_ours(f: &tc::Filter) -> bool {
    !is_our_filter(f)
        && (f.priority < TC_PRIORITY
            || (f.priority == TC_PRIORITY && (f.kind != "bpf" || f.protocol != ETH_P_ALL)))
}

/// Describes a filter for an error or a log line.
fn describe(f: &tc::Filter) -> String {
    let prog = f
        .program
        .as_ref()
        .map(|(name, id)| format!(" program {name} (id {id})"))
        .unwrap_or_default();
    format!(
        "{} filter{prog} at priority {} handle {:#x}",
        f.kind, f.priority, f.handle
    )
}

/// What keeps our tc filters from running first on `link`'s `hook`, if
/// anything: a filter ours cannot be put ahead of, or (on a kernel with
/// tcx) another agent's tcx programs, which run before every tc filter.
pub fn tc_blocker(
    sock: &NlSocket,
    link: &Link,
    hook: TcAttachType,
    hook_name: &str,
    our_tcx: &BTreeSet<u32>,
) -> Result<Option<String>, EbpfError> {
    if tcx_available() {
        let mut others =
            chain::tcx_program_ids(link.index, hook).map_err(|source| EbpfError::Io {
                path: PathBuf::from(format!("tcx {hook_name} of {}", link.name)),
                source,
            })?;
        others.retain(|id| !our_tcx.contains(id));
        if !others.is_empty() {
            let names = chain::program_names(&others);
            return Ok(Some(format!(
                "tcx programs {:?} on {} {hook_name} run before every tc filter: attach with tcx \
                 (--tc-attach auto) or move that agent to tc filters",
                names.values().collect::<Vec<_>>(),
                link.name
            )));
        }
    }
    let filters = tc::filters(sock, link.index, chain::tc_parent(hook))?;
    Ok(filters.iter().find(|f| blocks_ours(f)).map(|f| {
        format!(
            "a {} on {} {hook_name} runs before ours, which cannot be put ahead of it (ours sit at \
             priority {TC_PRIORITY}, the first there is): give that agent's filters a priority of \
             {} or more (Cilium: --bpf-filter-priority), or attach with tcx on kernels 6.6+",
            describe(f),
            link.name,
            TC_PRIORITY + 1
        )
    }))
}

fn our_filter(
    interface: &str,
    hook: TcAttachType,
    handle: u32,
) -> std::io::Result<SchedClassifierLink> {
    SchedClassifierLink::attached(interface, hook, TC_PRIORITY, handle.into(), None)
}

/// Adds `prog` to `link`'s `hook` as a filter of ours under `handle`.
fn add_tc_filter(
    prog: &mut SchedClassifier,
    link: &Link,
    hook: TcAttachType,
    handle: u32,
) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Attach {
        interface: link.name.clone(),
        source,
    };
    let id = prog
        .attach_with_options(
            &link.name,
            hook,
            TcAttachOptions::Netlink(NlOptions {
                priority: TC_PRIORITY,
                handle: handle.into(),
                ..Default::default()
            }),
        )
        .map_err(err)?;
    // Not dropped: dropping a tc link deletes the filter.
    std::mem::forget(prog.take_link(id).map_err(err)?);
    Ok(())
}

/// Attaches `prog` to `link`'s `hook` as our tc filter: the program of the
/// one already there is replaced in place, else the filter is added; then
/// put first (see [`keep_tc_first`]).
fn attach_tc_filter(
    sock: &NlSocket,
    prog: &mut SchedClassifier,
    link: &Link,
    (hook, hook_name): (TcAttachType, &str),
) -> Result<(), EbpfError> {
    // tc filters need clsact. Adding it swaps the interface's queue out
    // and back, dropping what it sends meanwhile: once, where no agent
    // added it before; where it is there, the add is refused (EEXIST) and
    // the interface left alone.
    let _ = aya_tc::qdisc_add_clsact(&link.name);
    let filters = tc::filters(sock, link.index, chain::tc_parent(hook))?;
    let existing = filters.iter().find(|f| is_our_filter(f)).map(|f| f.handle);
    let replaced = existing.is_some_and(|handle| {
        our_filter(&link.name, hook, handle)
            .ok()
            .and_then(|l| prog.attach_to_link(l).ok())
            .and_then(|id| prog.take_link(id).ok())
            .map(std::mem::forget)
            .is_some()
    });
    if !replaced {
        if let Err(e) = add_tc_filter(prog, link, hook, TC_HANDLES[0]) {
            // Name what holds our place, if anything does.
            if let Some(why) = tc_blocker(sock, link, hook, hook_name, &BTreeSet::new())? {
                return Err(EbpfError::Blocked(why));
            }
            return Err(e);
        }
    }
    keep_tc_first(sock, prog, link, (hook, hook_name)).map(|_| ())
}

/// Puts our tc filter first on `link`'s `hook` if another runs before it:
/// added again under the other handle (the newest filter of a priority
/// runs first), then the displaced one deleted. Returns whether it moved.
pub fn keep_tc_first(
    sock: &NlSocket,
    prog: &mut SchedClassifier,
    link: &Link,
    (hook, hook_name): (TcAttachType, &str),
) -> Result<bool, EbpfError> {
    let filters = tc::filters(sock, link.index, chain::tc_parent(hook))?;
    let Some(at) = filters.iter().position(is_our_filter) else {
        add_tc_filter(prog, link, hook, TC_HANDLES[0])?;
        info!(interface = %link.name, hook = hook_name, "our tc filter was gone; added again");
        return Ok(true);
    };
    if at == 0 {
        return Ok(false);
    }
    if let Some(why) = tc_blocker(sock, link, hook, hook_name, &BTreeSet::new())? {
        return Err(EbpfError::Blocked(why));
    }
    let old = filters[at].handle;
    let new = TC_HANDLES.into_iter().find(|h| *h != old).unwrap_or(old);
    let ahead: Vec<String> = filters[..at].iter().map(describe).collect();
    add_tc_filter(prog, link, hook, new)?;
    if let Ok(l) = our_filter(&link.name, hook, old) {
        // Dropping the link deletes the filter.
        drop(l);
    }
    warn!(interface = %link.name, hook = hook_name, ahead = ?ahead, "another agent's tc filter ran before ours; ours is first again");
    chain::count_reclaimed();
    Ok(true)
}

/// Deletes our tc filters (if any) from `interface`'s hooks.
pub fn delete_tc_filters(interface: &str) {
    for (_, hook, _) in PROGRAMS {
        for handle in TC_HANDLES {
            // Dropping the link deletes the filter; absent, nothing happens.
            if let Ok(link) = our_filter(interface, hook, handle) {
                drop(link);
            }
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

/// Attaches `prog` to `link`'s `hook` as a new tcx link before every other
/// program, pinned at `pin` (replacing what was pinned there: a link
/// pinned only there is let go).
fn attach_tcx_first(
    prog: &mut SchedClassifier,
    link: &Link,
    hook: TcAttachType,
    pin: &Path,
) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Attach {
        interface: link.name.clone(),
        source,
    };
    // No clsact qdisc: tcx needs none, and adding one to an interface
    // that is up drops the packets it sends meanwhile (the kernel swaps
    // its queue out and back).
    let id = prog
        .attach_with_options(
            &link.name,
            hook,
            TcAttachOptions::TcxOrder(LinkOrder::first()),
        )
        .map_err(err)?;
    let tc_link = prog.take_link(id).map_err(err)?;
    let Ok(fd_link) = FdLink::try_from(tc_link) else {
        // tcx_available() said yes: not expected.
        warn!(interface = %link.name, "attached as a tc filter although tcx was expected");
        return Ok(());
    };
    // Pinned beside, then renamed over the old pin: the old link goes
    // only once the new one runs. (A bpffs refuses dots in names; the
    // prefix keeps it out of [`pinned`].)
    let fresh = pin.with_file_name(format!(
        "new-{}",
        pin.file_name().and_then(|n| n.to_str()).unwrap_or_default()
    ));
    let _ = fs::remove_file(&fresh);
    fd_link.pin(&fresh).map_err(|source| EbpfError::PinLink {
        path: fresh.clone(),
        source,
    })?;
    fs::rename(&fresh, pin).map_err(|source| EbpfError::Io {
        path: pin.to_path_buf(),
        source,
    })
}

/// Attaches both programs to `link`, or re-points its pinned links (or
/// its tc filters).
pub fn attach(
    ebpf: &mut Ebpf,
    sock: &NlSocket,
    pin_dir: &Path,
    link: &Link,
    mode: TcAttach,
) -> Result<(), EbpfError> {
    let tcx = mode == TcAttach::Auto && tcx_available();
    for (name, hook, hook_name) in PROGRAMS {
        let pin = pin_path(pin_dir, link.index, hook_name);
        let prog = program(ebpf, name)?;
        if !tcx {
            attach_tc_filter(sock, prog, link, (hook, hook_name))?;
            // A tcx link of ours from an earlier start goes: ours run once.
            let _ = fs::remove_file(&pin);
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
        }
        // The pin stays until the new link replaces it: a link the kernel
        // would not update keeps running (with the same maps) until then,
        // and keeps running if the new attach fails too.
        attach_tcx_first(prog, link, hook, &pin)?;
        // A tc filter of ours from an earlier start goes: ours run once.
        for handle in TC_HANDLES {
            if let Ok(l) = our_filter(&link.name, hook, handle) {
                drop(l);
            }
        }
        info!(interface = %link.name, hook = hook_name, "attached");
    }
    Ok(())
}

/// The program ids of our pinned tcx links.
pub fn pinned_program_ids(pin_dir: &Path) -> BTreeSet<u32> {
    pinned(pin_dir)
        .iter()
        .filter_map(|(_, path)| {
            let link = PinnedLink::from_pin(path).ok()?;
            Some(FdLink::from(link).info().ok()?.program_id())
        })
        .collect()
}

/// Puts ours first again on `link`'s tcx `hook`, or attaches it again where
/// it is gone: `instances` are the loaded instances of the program for
/// this hook (two, see the module's doc), `ids` their program ids in the
/// same order. Returns whether anything changed.
pub fn keep_tcx_first(
    instances: [&mut SchedClassifier; 2],
    ids: [u32; 2],
    pin_dir: &Path,
    link: &Link,
    (hook, hook_name): (TcAttachType, &str),
) -> Result<bool, EbpfError> {
    let io = |source| EbpfError::Io {
        path: PathBuf::from(format!("tcx {hook_name} of {}", link.name)),
        source,
    };
    let chain_ids = chain::tcx_program_ids(link.index, hook).map_err(io)?;
    let place = chain::place(&chain_ids, |id| ids.contains(&id));
    if place == Place::First {
        return Ok(false);
    }
    // The instance not on this hook (either, when none is).
    let on_hook = chain_ids
        .iter()
        .find_map(|id| ids.iter().position(|i| i == id));
    let [a, b] = instances;
    let fresh = if on_hook == Some(0) { b } else { a };
    let ahead: Vec<u32> = chain_ids
        .iter()
        .take_while(|id| !ids.contains(id))
        .copied()
        .collect();
    attach_tcx_first(fresh, link, hook, &pin_path(pin_dir, link.index, hook_name))?;
    if place == Place::Missing {
        info!(interface = %link.name, hook = hook_name, "our tcx link was gone; attached again");
    } else {
        let names = chain::program_names(&ahead);
        warn!(interface = %link.name, hook = hook_name, ahead = ?names, "another agent's program ran before ours; ours is first again");
        chain::count_reclaimed();
    }
    Ok(true)
}

/// Does this kernel attach TC programs as tcx links? They came in 6.6;
/// read once from the kernel's release.
pub fn tcx_available() -> bool {
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
