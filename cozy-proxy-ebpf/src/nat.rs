//! Rewriting an address with its checksums: the IPv4 header checksum and the
//! L4 checksum over the pseudo-header (TCP, UDP, ICMPv6); and, in an ICMP
//! error, the quoted packet's address with every checksum it touches.
use crate::hdr::*;
use crate::parse::{be16, byte, is_icmp, is_icmp_error, Packet, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP};
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use cozy_proxy_common::IpKey;

#[derive(Clone, Copy)]
pub enum Field {
    Src,
    Dst,
}

/// The checksum difference between two addresses, as `bpf_csum_diff` folds
/// it (for 16-byte IPv6 addresses; IPv4 ones go to the helpers directly).
#[inline(always)]
fn addr_diff(old: &IpKey, new: &IpKey) -> Result<u64, i64> {
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
        Err(diff)
    } else {
        Ok(diff as u64)
    }
}

#[inline(always)]
fn v4(k: &IpKey) -> u64 {
    u32::from_ne_bytes([k.addr[0], k.addr[1], k.addr[2], k.addr[3]]) as u64
}

/// Where the L4 checksum the pseudo-header feeds sits, and its flags.
/// `off` 0: there is none (ICMPv4, other protocols, a later fragment, or a
/// packet too short to hold it). Plain values, not an `Option` of a tuple:
/// LLVM spills the tuple's undefined half on the `None` path, and the
/// verifier refuses reading an uninitialized register even when dead.
#[derive(Clone, Copy)]
struct L4Csum {
    off: usize,
    flags: u64,
}

#[inline(always)]
fn pseudo_csum(ctx: &TcContext, v6: bool, proto: u8, l4: usize) -> L4Csum {
    let mut c = L4Csum { off: 0, flags: 0 };
    if proto == PROTO_TCP {
        c.off = l4 + TCP_CSUM;
    } else if proto == PROTO_UDP {
        // A zero UDP checksum (IPv4: none computed) stays zero.
        c.off = l4 + UDP_CSUM;
        c.flags = BPF_F_MARK_MANGLED_0 as u64;
    } else if proto == PROTO_ICMPV6 && v6 {
        c.off = l4 + ICMP_CSUM;
    }
    if c.off != 0 && (ctx.len() as usize) < c.off + 2 {
        c.off = 0;
    }
    c
}

/// Replaces the source or destination address `old` with `new`.
#[inline(always)]
pub fn rewrite(ctx: &mut TcContext, p: &Packet, field: Field, old: &IpKey, new: &IpKey) -> Result<(), i64> {
    let mut l4 = pseudo_csum(ctx, p.v6, p.proto, p.l4);
    if p.later_fragment {
        l4.off = 0;
    }
    if !p.v6 {
        let off = p.l3 + if matches!(field, Field::Src) { IP4_SADDR } else { IP4_DADDR };
        let to = new.addr;
        ctx.store(off, &[to[0], to[1], to[2], to[3]], 0)?;
        ctx.l3_csum_replace(p.l3 + IP4_CSUM, v4(old), v4(new), 4)?;
        if l4.off != 0 {
            ctx.l4_csum_replace(l4.off, v4(old), v4(new), l4.flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
        }
        return Ok(());
    }
    let off = p.l3 + if matches!(field, Field::Src) { IP6_SADDR } else { IP6_DADDR };
    ctx.store(off, &new.addr, 0)?;
    if l4.off != 0 {
        let diff = addr_diff(old, new)?;
        ctx.l4_csum_replace(l4.off, 0, diff, l4.flags | BPF_F_PSEUDO_HDR as u64)?;
    }
    Ok(())
}

/// In an ICMP error, the quoted packet's address (`field` of the quoted
/// header) goes from `old` to `new` when it is `old`. Every checksum it
/// touches is fixed: the quoted IPv4 header's, the quoted TCP/UDP/ICMPv6
/// checksum (pseudo-header), and the ICMP checksum over all of it. A quote
/// too short to hold the address is left alone; a quoted transport
/// checksum past the end is left alone too.
#[inline(always)]
pub fn rewrite_quoted(ctx: &mut TcContext, p: &Packet, field: Field, old: &IpKey, new: &IpKey) -> Result<(), i64> {
    if !is_icmp(p) {
        return Ok(());
    }
    let Some(t) = byte(ctx, p.l4 + ICMP_TYPE) else {
        return Ok(());
    };
    if !is_icmp_error(p, t) {
        return Ok(());
    }
    let inner = p.l4 + ICMP_HLEN;
    let icmp_csum = p.l4 + ICMP_CSUM;
    if !p.v6 {
        let Some(ver_ihl) = byte(ctx, inner + IP4_VER_IHL) else {
            return Ok(());
        };
        let ihl = ((ver_ihl & 0x0f) as usize) * 4;
        let at = inner + if matches!(field, Field::Src) { IP4_SADDR } else { IP4_DADDR };
        let Some(found) = crate::parse::load::<[u8; 4]>(ctx, at) else {
            return Ok(());
        };
        if ver_ihl >> 4 != 4 || ihl < IP4_MIN_HLEN || found != [old.addr[0], old.addr[1], old.addr[2], old.addr[3]] {
            return Ok(());
        }
        let Some(proto) = byte(ctx, inner + IP4_PROTO) else {
            return Ok(());
        };
        let to = new.addr;
        ctx.store(at, &[to[0], to[1], to[2], to[3]], 0)?;
        ctx.l4_csum_replace(icmp_csum, v4(old), v4(new), 4)?;
        // The quoted IPv4 header's checksum, and the ICMP checksum over
        // that change.
        let ip_csum = inner + IP4_CSUM;
        if let Some(before) = be16(ctx, ip_csum) {
            ctx.l3_csum_replace(ip_csum, v4(old), v4(new), 4)?;
            if let Some(after) = be16(ctx, ip_csum) {
                ctx.l4_csum_replace(icmp_csum, before.to_be() as u64, after.to_be() as u64, 2)?;
            }
        }
        return quoted_l4(ctx, false, proto, inner + ihl, icmp_csum, v4(old), v4(new), 4);
    }
    let at = inner + if matches!(field, Field::Src) { IP6_SADDR } else { IP6_DADDR };
    let Some(found) = crate::parse::load::<[u8; 16]>(ctx, at) else {
        return Ok(());
    };
    if found != old.addr {
        return Ok(());
    }
    let Some(proto) = byte(ctx, inner + IP6_NEXT) else {
        return Ok(());
    };
    let diff = addr_diff(old, new)?;
    ctx.store(at, &new.addr, 0)?;
    ctx.l4_csum_replace(icmp_csum, 0, diff, 0)?;
    quoted_l4(ctx, true, proto, inner + IP6_HLEN, icmp_csum, 0, diff, 0)
}

/// Fixes the quoted transport checksum for an address change (`from`,
/// `to`, `size` as the helper takes them), and the ICMP checksum for that.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quoted_l4(
    ctx: &mut TcContext,
    v6: bool,
    proto: u8,
    l4: usize,
    icmp_csum: usize,
    from: u64,
    to: u64,
    size: u64,
) -> Result<(), i64> {
    let L4Csum { off, flags } = pseudo_csum(ctx, v6, proto, l4);
    if off == 0 {
        return Ok(());
    }
    let Some(before) = be16(ctx, off) else {
        return Ok(());
    };
    // A zero UDP checksum: none was computed; it stays zero.
    if proto == PROTO_UDP && before == 0 {
        return Ok(());
    }
    ctx.l4_csum_replace(off, from, to, size | (flags & !(BPF_F_MARK_MANGLED_0 as u64)))?;
    if let Some(after) = be16(ctx, off) {
        ctx.l4_csum_replace(icmp_csum, before.to_be() as u64, after.to_be() as u64, 2)?;
    }
    Ok(())
}
