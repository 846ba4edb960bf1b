//! The programs' counters: per mapping (by its slot) and per drop reason,
//! per CPU, without a hash insert.
use crate::frame::Frame;
use crate::maps::{DROP_STATS, STATS};
use cozy_proxy_common::{AddrInfo, DropReason};

/// Counts a packet dropped for `reason` (the caller returns its hook's
/// verdict for a drop).
#[inline(always)]
pub fn dropped(ctx: &impl Frame, reason: DropReason) {
    if let Some(c) = DROP_STATS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += ctx.len() as u64;
        }
    }
}

/// Counts a rewritten packet of a local mapping: no hash insert, an array
/// slot userspace gave the mapping.
#[inline(always)]
pub fn count(ctx: &impl Frame, info: &AddrInfo, toward_pod: bool) {
    if let Some(s) = STATS.get_ptr_mut(info.slot as u32) {
        // SAFETY: per-CPU value, only this CPU writes it.
        let c = unsafe {
            if toward_pod {
                &mut (*s).ingress
            } else {
                &mut (*s).egress
            }
        };
        c.packets += 1;
        c.bytes += ctx.len() as u64;
    }
}
