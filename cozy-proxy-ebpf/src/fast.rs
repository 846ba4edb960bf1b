//! The fast path (`config.fast_path`): a packet between the outside and a
//! mapping of this node is rewritten and handed on by the program itself,
//! skipping the host's routing, netfilter and conntrack (what Cilium calls
//! BPF host routing). Toward the pod it goes straight into the pod's
//! namespace (`bpf_redirect_peer`, for a veth whose peer is the pod's end)
//! or out of the pod's interface (`bpf_redirect`); from the pod, out of
//! the interface toward the destination. Only where the kernel's FIB knows
//! the route and the neighbour, the hop limit allows forwarding and the
//! packet fits the MTU; anything else takes the stack path, untouched.
use crate::csum::replace;
use crate::frame::Frame;
use crate::hdr::*;
use crate::maps::CONFIG;
use crate::parse::{byte, load_words, put, put_words, Packet};
use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_peer},
    programs::TcContext,
};
use core::mem::{size_of, MaybeUninit};
use cozy_proxy_common::IpKey;

/// Is the fast path on?
#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a map value, read whole.
    CONFIG.get_ptr(0).is_some_and(|c| unsafe { (*c).fast_path } != 0)
}

/// Where a packet goes next: out of `ifindex`, with these Ethernet
/// addresses.
#[derive(Clone, Copy)]
pub struct Hop {
    pub ifindex: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
}

/// Asks the kernel's FIB for a packet from `src` to `dst` arriving by
/// `iif`: the helper's answer, `params` filled. `tot_len` 0: no MTU check
/// before the interface is known.
#[inline(always)]
fn fib<C: Frame>(
    ctx: &C,
    p: &Packet,
    (src, dst): (&IpKey, &IpKey),
    iif: u32,
    tot_len: u16,
    params: &mut MaybeUninit<FibParams>,
) -> i64 {
    // Zeroed with volatile word stores: a plain zeroing became a call of
    // a byte loop (`memset`).
    let raw = params.as_mut_ptr() as *mut u64;
    let mut i = 0;
    while i < size_of::<FibParams>() / 8 {
        // SAFETY: within the parameter block, 8-aligned.
        unsafe { raw.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: every byte was written just above.
    let params = unsafe { &mut *params.as_mut_ptr() };
    params.ifindex = iif;
    params.__bindgen_anon_1.tot_len = tot_len;
    if p.v6 {
        params.family = 10;
        params.__bindgen_anon_3.ipv6_src = src.words();
        params.__bindgen_anon_4.ipv6_dst = dst.words();
    } else {
        params.family = 2;
        params.__bindgen_anon_3.ipv4_src = src.words()[0];
        params.__bindgen_anon_4.ipv4_dst = dst.words()[0];
    }
    // SAFETY: the context and a parameter block of the size given.
    unsafe { bpf_fib_lookup(ctx.raw() as *mut _, params, size_of::<FibParams>() as i32, 0) }
}

/// The kernel's forwarding decision for a packet from `src` to `dst` that
/// arrived where this one did: `None` unless the route and the neighbour
/// are known and the packet fits the outgoing MTU. Not inlined: the helper
/// call keeps its clobbered registers to itself.
#[inline(never)]
pub fn next_hop<C: Frame>(ctx: &C, p: &Packet, src: &IpKey, dst: &IpKey) -> Option<Hop> {
    let len = ctx.len().saturating_sub(p.l3 as u32);
    let tot_len = if len > u16::MAX as u32 { u16::MAX } else { len as u16 };
    let mut params = MaybeUninit::<FibParams>::uninit();
    if fib(ctx, p, (src, dst), ctx.ifindex(), tot_len, &mut params) != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    // SAFETY: filled by `fib`.
    let params = unsafe { params.assume_init_ref() };
    Some(Hop {
        ifindex: params.ifindex,
        smac: params.smac,
        dmac: params.dmac,
    })
}

/// The interface the kernel routes a packet from `src` to `dst` out of,
/// arriving where this one did, whether or not its next hop is resolved
/// yet: `None` without a route.
#[inline(never)]
pub fn route_oif<C: Frame>(ctx: &C, p: &Packet, src: &IpKey, dst: &IpKey) -> Option<u32> {
    Some(routed_oif(ctx, p, (src, dst), ctx.ifindex())).filter(|&oif| oif != 0 && oif != LOCAL)
}

/// [`way_back`]'s answer for an address of the node itself.
pub const LOCAL: u32 = u32::MAX;

/// The interface through which the node routes `peer`, for a packet from
/// `peer` to `local` that arrived by `iif` (the reverse path); [`LOCAL`]
/// for an address of the node's, 0 without a route. Not inlined, and
/// apart from [`route_oif`]: each call keeps its parameter block off its
/// caller's stack.
#[inline(never)]
pub fn way_back<C: Frame>(ctx: &C, p: &Packet, local: &IpKey, peer: &IpKey, iif: u32) -> u32 {
    routed_oif(ctx, p, (local, peer), iif)
}

/// The interface out of which the node routes a packet from `src` to
/// `dst` arriving by `iif`, whether or not its next hop is resolved yet;
/// [`LOCAL`] for a destination of the node's own (or broadcast), 0 without
/// a route.
#[inline(always)]
fn routed_oif<C: Frame>(ctx: &C, p: &Packet, route: (&IpKey, &IpKey), iif: u32) -> u32 {
    let mut params = MaybeUninit::<FibParams>::uninit();
    let rc = fib(ctx, p, route, iif, 0, &mut params);
    // The interface is known in these answers (the MTU and the neighbour
    // are looked at after it).
    let routed = rc == BPF_FIB_LKUP_RET_SUCCESS as i64
        || rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64
        || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64;
    if rc == BPF_FIB_LKUP_RET_NOT_FWDED as i64 {
        return LOCAL;
    }
    if !routed {
        return 0;
    }
    // SAFETY: filled by `fib`.
    unsafe { params.assume_init_ref() }.ifindex
}

/// Can the packet be forwarded here (a hop limit above 1, no VLAN tag)?
/// The stack answers the others (time exceeded; a frame of a VLAN the node
/// has no interface for is dropped there).
#[inline(always)]
pub fn forwardable<C: Frame>(ctx: &C, p: &Packet) -> bool {
    // Not with a VLAN tag in the frame, nor one the kernel moved into the
    // skb's metadata before TC ingress: a redirect would carry it on into
    // the pod.
    if p.l3 != ETH_HLEN || ctx.vlan_offloaded() {
        return false;
    }
    let at = p.l3 + if p.v6 { IP6_HOP_LIMIT } else { IP4_TTL };
    byte(ctx, at).is_some_and(|ttl| ttl > 1)
}

/// Decrements the TTL (and fixes the IPv4 header checksum) or the hop
/// limit, and sets the Ethernet addresses of `hop`: the packet as it
/// leaves for `hop`. `None` if the frame could not be written (the caller
/// drops it: it is already rewritten).
#[inline(always)]
pub fn to_hop<C: Frame>(ctx: &C, p: &Packet, hop: &Hop) -> Option<()> {
    if p.v6 {
        let at = p.l3 + IP6_HOP_LIMIT;
        let hl = byte(ctx, at)?;
        put(ctx, at, hl.wrapping_sub(1))?;
    } else {
        // TTL and protocol are one 16-bit word of the checksum (RFC 1624).
        let at = p.l3 + IP4_TTL;
        let old: u16 = load_words(ctx, at)?;
        let new = (old & 0xff00) | ((old as u8).wrapping_sub(1) as u16);
        let csum: u16 = load_words(ctx, p.l3 + IP4_CSUM)?;
        put_words(ctx, at, new)?;
        put_words(ctx, p.l3 + IP4_CSUM, replace(csum, (!old) as u32 + new as u32))?;
    }
    put(ctx, ETH_DST, hop.dmac)?;
    put(ctx, ETH_SRC, hop.smac)
}

/// [`to_hop`], then hands the packet on from TC: into the pod's namespace
/// when `peer` (a veth whose peer is the pod's end), else out of
/// `hop.ifindex`.
#[inline(always)]
pub fn forward(ctx: &TcContext, p: &Packet, hop: &Hop, peer: bool) -> Option<i32> {
    to_hop(ctx, p, hop)?;
    // SAFETY: helpers without pointer arguments.
    let rc = unsafe {
        if peer {
            bpf_redirect_peer(hop.ifindex, 0)
        } else {
            bpf_redirect(hop.ifindex, 0)
        }
    };
    Some(if rc == TC_ACT_REDIRECT as i64 {
        TC_ACT_REDIRECT as i32
    } else {
        crate::DROP
    })
}
