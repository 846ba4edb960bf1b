//! Rewriting an address with its checksums: the IPv4 header checksum and the
//! L4 checksum over the pseudo-header (TCP, UDP, ICMPv6); and, in an ICMP
//! error, the quoted packet's address with every checksum it touches.
use crate::csum::{halves, halves_neg, replace};
use crate::frame::Frame;
use crate::hdr::*;
use crate::parse::{
    be16, byte, is_icmp, is_icmp_error, load_words, put_words, Packet, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};
use aya_ebpf::bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR};
use cozy_proxy_common::IpKey;

#[derive(Clone, Copy)]
pub enum Field {
    Src,
    Dst,
}

/// The checksum difference between two IPv6 addresses (a 32-bit
/// one's-complement sum, as `bpf_csum_diff` would return it), computed
/// here rather than by a helper call.
#[inline(always)]
fn addr_diff(old: &IpKey, new: &IpKey) -> Result<u64, i64> {
    let (o, n) = (old.words(), new.words());
    let mut sum: u32 = 0;
    let mut i = 0;
    while i < 4 {
        sum += halves_neg(o[i]) + halves(n[i]);
        i += 1;
    }
    Ok(sum as u64)
}

/// An IPv4 header checksum after its 32-bit field `old` became `new`
/// (RFC 1624, eqn. 3), computed here rather than by a helper call. Words
/// in memory order on both sides: one's-complement sums do not depend on
/// byte order.
#[inline(always)]
fn ip4_csum_replace(csum: u16, old: u32, new: u32) -> u16 {
    replace(csum, halves_neg(old) + halves(new))
}

/// Rewrites the IPv4 address at `at` from `old` to `new` and the header
/// checksum at `csum_at` with it; `Err` if either is out of the packet.
#[inline(always)]
fn rewrite_ip4<C: Frame>(ctx: &C, at: usize, csum_at: usize, old: u32, new: u32) -> Result<(), i64> {
    let csum: u16 = load_words(ctx, csum_at).ok_or(-1i64)?;
    let csum = ip4_csum_replace(csum, old, new);
    put_words(ctx, at, new).ok_or(-1i64)?;
    put_words(ctx, csum_at, csum).ok_or(-1i64)?;
    Ok(())
}

/// An IPv4 address as its one word.
#[inline(always)]
fn word4(k: &IpKey) -> u32 {
    k.words()[0]
}

#[inline(always)]
fn v4(k: &IpKey) -> u64 {
    word4(k) as u64
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
fn pseudo_csum<C: Frame>(ctx: &C, v6: bool, proto: u8, l4: usize) -> L4Csum {
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
pub fn rewrite<C: Frame>(ctx: &mut C, p: &Packet, field: Field, old: &IpKey, new: &IpKey) -> Result<(), i64> {
    let mut l4 = pseudo_csum(ctx, p.v6, p.proto, p.l4);
    if p.later_fragment {
        l4.off = 0;
    }
    if !p.v6 {
        let off = p.l3 + if matches!(field, Field::Src) { IP4_SADDR } else { IP4_DADDR };
        rewrite_ip4(ctx, off, p.l3 + IP4_CSUM, word4(old), word4(new))?;
        if l4.off != 0 {
            ctx.l4_csum_replace(l4.off, v4(old), v4(new), l4.flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
        }
        return Ok(());
    }
    let off = p.l3 + if matches!(field, Field::Src) { IP6_SADDR } else { IP6_DADDR };
    put_words(ctx, off, new.words()).ok_or(-1i64)?;
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
pub fn rewrite_quoted<C: Frame>(ctx: &mut C, p: &Packet, field: Field, old: &IpKey, new: &IpKey) -> Result<(), i64> {
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
        let Some(found) = load_words::<u32>(ctx, at) else {
            return Ok(());
        };
        if ver_ihl >> 4 != 4 || ihl < IP4_MIN_HLEN || found != word4(old) {
            return Ok(());
        }
        let Some(proto) = byte(ctx, inner + IP4_PROTO) else {
            return Ok(());
        };
        // The quoted address and the quoted IPv4 header's checksum, then
        // the ICMP checksum over both changes.
        let ip_csum = inner + IP4_CSUM;
        match be16(ctx, ip_csum) {
            Some(before) => {
                rewrite_ip4(ctx, at, ip_csum, word4(old), word4(new))?;
                ctx.l4_csum_replace(icmp_csum, v4(old), v4(new), 4)?;
                if let Some(after) = be16(ctx, ip_csum) {
                    ctx.l4_csum_replace(icmp_csum, before.to_be() as u64, after.to_be() as u64, 2)?;
                }
            }
            None => {
                put_words(ctx, at, word4(new)).ok_or(-1i64)?;
                ctx.l4_csum_replace(icmp_csum, v4(old), v4(new), 4)?;
            }
        }
        return quoted_l4(ctx, false, proto, inner + ihl, icmp_csum, v4(old), v4(new), 4);
    }
    let at = inner + if matches!(field, Field::Src) { IP6_SADDR } else { IP6_DADDR };
    let Some(found) = load_words::<[u32; 4]>(ctx, at) else {
        return Ok(());
    };
    if found != old.words() {
        return Ok(());
    }
    let Some(proto) = byte(ctx, inner + IP6_NEXT) else {
        return Ok(());
    };
    let diff = addr_diff(old, new)?;
    put_words(ctx, at, new.words()).ok_or(-1i64)?;
    ctx.l4_csum_replace(icmp_csum, 0, diff, 0)?;
    quoted_l4(ctx, true, proto, inner + IP6_HLEN, icmp_csum, 0, diff, 0)
}

/// Fixes the quoted transport checksum for an address change (`from`,
/// `to`, `size` as the helper takes them), and the ICMP checksum for that.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quoted_l4<C: Frame>(
    ctx: &mut C,
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

/// Rewrites `field` of `p` to `new`, and the quoted address of an ICMP
/// error the same way; `p` follows. `false`: the kernel refused a write
/// (the caller drops the packet, never lets it through half-translated).
#[inline(always)]
pub fn translate<C: Frame>(ctx: &mut C, p: &mut Packet, field: Field, new: &IpKey) -> bool {
    // An error about a flow quotes it reversed: a packet to the LB IP
    // quotes the LB IP as the source it was sent with, and vice versa.
    let (old, quoted) = match field {
        Field::Src => (p.src, Field::Dst),
        Field::Dst => (p.dst, Field::Src),
    };
    if rewrite(ctx, p, field, &old, new).is_err() || rewrite_quoted(ctx, p, quoted, &old, new).is_err() {
        return false;
    }
    match field {
        Field::Src => p.src = *new,
        Field::Dst => p.dst = *new,
    }
    true
}
