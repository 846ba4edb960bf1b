//! Where our programs run among the other programs on a hook. Other agents
//! (Cilium above all) attach their own programs to the same interfaces, and
//! theirs end the chain (`TC_ACT_OK`, never `TCX_NEXT`): a program behind
//! them never runs. Ours therefore run first and pass on what is not theirs
//! (`TC_ACT_UNSPEC`, which tcx reads as "next").
//!
//! - tcx (kernels 6.6+): the hook's programs in order, from
//!   `BPF_PROG_QUERY` (ids only, cheap enough for every upkeep).
//! - tc filters (`--tc-attach netlink`): the clsact hook's filters in the
//!   order the kernel runs them (`netlink::tc`).
use crate::netlink::{tc, NetlinkError, NlSocket};
use aya::programs::TcAttachType;
use serde::Serialize;
use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicU64, Ordering},
};

/// Times another agent's program (or filter) was found running before ours
/// and ours was put first again, since the start (a metric).
static RECLAIMED: AtomicU64 = AtomicU64::new(0);
/// Hooks where another program runs before ours and ours could not be put
/// first, as of the last check (a metric).
static BEHIND: AtomicU64 = AtomicU64::new(0);

pub fn count_reclaimed() {
    RECLAIMED.fetch_add(1, Ordering::Relaxed);
}

pub fn reclaimed() -> u64 {
    RECLAIMED.load(Ordering::Relaxed)
}

pub fn set_behind(hooks: u64) {
    BEHIND.store(hooks, Ordering::Relaxed);
}

pub fn behind() -> u64 {
    BEHIND.load(Ordering::Relaxed)
}

/// `enum bpf_attach_type` (<linux/bpf.h>).
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// `enum bpf_cmd`.
const BPF_PROG_QUERY: libc::c_long = 16;

pub fn tcx_attach_type(hook: TcAttachType) -> u32 {
    match hook {
        TcAttachType::Egress => BPF_TCX_EGRESS,
        _ => BPF_TCX_INGRESS,
    }
}

pub fn tc_parent(hook: TcAttachType) -> u32 {
    match hook {
        TcAttachType::Egress => tc::PARENT_EGRESS,
        _ => tc::PARENT_INGRESS,
    }
}

/// The `query` member of `union bpf_attr` (<linux/bpf.h>).
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    count: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// The ids of the programs on `ifindex`'s tcx hook, in the order they run.
pub fn tcx_program_ids(ifindex: u32, hook: TcAttachType) -> std::io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 16];
    loop {
        let mut attr = QueryAttr {
            target_ifindex: ifindex,
            attach_type: tcx_attach_type(hook),
            prog_ids: ids.as_mut_ptr() as u64,
            count: ids.len() as u32,
            ..Default::default()
        };
        // SAFETY: bpf(2) with a query attribute of the size given; the
        // kernel writes at most `count` ids into `ids`, which has room.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_QUERY,
                &mut attr as *mut QueryAttr,
                std::mem::size_of::<QueryAttr>(),
            )
        };
        if rc == 0 {
            ids.truncate(attr.count as usize);
            return Ok(ids);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            // More programs than room: the kernel said how many.
            Some(libc::ENOSPC) if attr.count as usize > ids.len() => {
                ids = vec![0u32; attr.count as usize];
            }
            // An interface that is gone has no programs.
            Some(libc::ENODEV) | Some(libc::ENOENT) => return Ok(Vec::new()),
            _ => return Err(err),
        }
    }
}

/// Our place on one hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Ours runs before any other program.
    First,
    /// Other programs run before ours (which may never run).
    Behind,
    /// Ours is not there.
    Missing,
}

/// Where the first of `ours` sits in `chain` (program ids in run order).
pub fn place(chain: &[u32], ours: impl Fn(u32) -> bool) -> Place {
    match chain.iter().position(|id| ours(*id)) {
        Some(0) => Place::First,
        Some(_) => Place::Behind,
        None => Place::Missing,
    }
}

/// One program of a hook's chain, as `dump` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChainProgram {
    pub id: u32,
    pub name: String,
    pub ours: bool,
    /// tc filters only: where the filter sits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handle: Option<u32>,
}

/// A hook's chain: every program in the order they run, ours marked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HookChain {
    pub interface: String,
    pub hook: &'static str,
    /// "tcx" or "tc".
    pub attach: &'static str,
    /// Index of our first program in `programs` (`None`: not attached).
    pub ours_at: Option<usize>,
    pub programs: Vec<ChainProgram>,
}

/// Names of the loaded programs with these ids (for `dump`).
pub fn program_names(ids: &[u32]) -> BTreeMap<u32, String> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| ids.contains(&p.id()))
        .map(|p| (p.id(), p.name_as_str().unwrap_or_default().to_string()))
        .collect()
}

/// The tcx chain of one hook.
pub fn tcx_chain(
    interface: &str,
    ifindex: u32,
    hook: (TcAttachType, &'static str),
    ours: &impl Fn(u32) -> bool,
) -> std::io::Result<HookChain> {
    let ids = tcx_program_ids(ifindex, hook.0)?;
    let names = program_names(&ids);
    let programs: Vec<ChainProgram> = ids
        .iter()
        .map(|id| ChainProgram {
            id: *id,
            name: names.get(id).cloned().unwrap_or_default(),
            ours: ours(*id),
            priority: None,
            handle: None,
        })
        .collect();
    Ok(HookChain {
        interface: interface.to_string(),
        hook: hook.1,
        attach: "tcx",
        ours_at: programs.iter().position(|p| p.ours),
        programs,
    })
}

/// The tc filter chain of one hook; `ours`: is this filter one of ours?
pub fn tc_chain(
    sock: &NlSocket,
    interface: &str,
    ifindex: u32,
    hook: (TcAttachType, &'static str),
    ours: &impl Fn(&tc::Filter) -> bool,
) -> Result<HookChain, NetlinkError> {
    let filters = tc::filters(sock, ifindex, tc_parent(hook.0))?;
    let programs: Vec<ChainProgram> = filters
        .iter()
        .map(|f| ChainProgram {
            id: f.program.as_ref().map_or(0, |p| p.1),
            name: f
                .program
                .as_ref()
                .map_or_else(|| f.kind.clone(), |p| p.0.clone()),
            ours: ours(f),
            priority: Some(f.priority),
            handle: Some(f.handle),
        })
        .collect();
    Ok(HookChain {
        interface: interface.to_string(),
        hook: hook.1,
        attach: "tc",
        ours_at: programs.iter().position(|p| p.ours),
        programs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_first_behind_or_missing() {
        let ours = |id: u32| id == 7 || id == 8;
        assert_eq!(place(&[7, 3], ours), Place::First);
        assert_eq!(place(&[3, 8], ours), Place::Behind);
        assert_eq!(place(&[3, 4], ours), Place::Missing);
        assert_eq!(place(&[], ours), Place::Missing);
    }
}
