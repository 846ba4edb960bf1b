//! Rewriting an address with its checksums: the IPv4 header checksum and
//! the L4 checksum over the pseudo-header (TCP, UDP, ICMPv6).
use crate::hdr::*;
use crate::parse::{Packet, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP};
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use cozy_proxy_common::IpKey;

pub enum Field {
    Src,
    Dst,
}

/// Offset of the L4 checksum the pseudo-header feeds, and extra flags; `None`
/// where there is none (ICMPv4, other protocols, later fragments, or a
/// packet too short to hold it).
#[inline(always)]
fn l4_csum(ctx: &TcContext, p: &Packet) -> Option<(usize, u64)> {
    if p.later_fragment {
        return None;
    }
    let (off, flags) = match p.proto {
        PROTO_TCP => (p.l4 + TCP_CSUM, 0),
        // A zero UDP checksum (IPv4: none computed) stays zero.
        PROTO_UDP => (p.l4 + UDP_CSUM, BPF_F_MARK_MANGLED_0 as u64),
        PROTO_ICMPV6 if p.v6 => (p.l4 + ICMP_CSUM, 0),
        _ => return None,
    };
    if (ctx.len() as usize) < off + 2 {
        return None;
    }
    Some((off, flags | BPF_F_PSEUDO_HDR as u64))
}

/// Replaces the source or destination address `old` with `new`.
#[inline(always)]
pub fn rewrite(ctx: &mut TcContext, p: &Packet, field: Field, old: &IpKey, new: &IpKey) -> Result<(), i64> {
    let l4 = l4_csum(ctx, p);
    if !p.v6 {
        let off = p.l3 + if matches!(field, Field::Src) { IP4_SADDR } else { IP4_DADDR };
        let from = u32::from_ne_bytes([old.addr[0], old.addr[1], old.addr[2], old.addr[3]]);
        let to = u32::from_ne_bytes([new.addr[0], new.addr[1], new.addr[2], new.addr[3]]);
        ctx.store(off, &to, 0)?;
        ctx.l3_csum_replace(p.l3 + IP4_CSUM, from as u64, to as u64, 4)?;
        if let Some((csum_off, flags)) = l4 {
            ctx.l4_csum_replace(csum_off, from as u64, to as u64, flags | 4)?;
        }
        return Ok(());
    }
    let off = p.l3 + if matches!(field, Field::Src) { IP6_SADDR } else { IP6_DADDR };
    ctx.store(off, &new.addr, 0)?;
    if let Some((csum_off, flags)) = l4 {
        let mut from = old.addr;
        let mut to = new.addr;
        // SAFETY: both buffers are 16 bytes on our stack, as passed.
        let diff = unsafe {
            bpf_csum_diff(
                from.as_mut_ptr() as *mut u32,
                16,
                to.as_mut_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(diff);
        }
        ctx.l4_csum_replace(csum_off, 0, diff as u64, flags)?;
    }
    Ok(())
}
