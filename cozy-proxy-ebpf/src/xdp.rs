//! `cozy_xdp`, the XDP program on the node's uplinks (`--xdp`): it runs on
//! a frame as the driver received it, before the kernel has built an skb
//! for it, and acts only on packets from outside to an LB IP whose pod is
//! on this node.
//!
//! - What the TC programs would drop is dropped here (`XDP_DROP`), counted
//!   under the same reasons: an unmapped LB IP, a source outside the LB
//!   IP's ranges, what the port filter refuses. A flood at one VM's
//!   unlisted ports costs the node no skb, no conntrack entry, no route
//!   lookup.
//! - With the fast path on, the rest is translated and handed to the pod's
//!   interface (`XDP_REDIRECT`), where that interface takes XDP frames
//!   (`xdp_targets`, a device map the controller keeps: a veth whose peer
//!   has an XDP program or GRO on).
//! - Everything else passes untouched (`XDP_PASS`) to the stack and the
//!   TC programs, which decide as without XDP: frames with a VLAN tag,
//!   guarded sources (anti-spoofing is judged at TC, by the interface's
//!   role), in-cluster clients (their reverse translations are TC's),
//!   another node's mappings, frames in several buffers, a next hop the
//!   FIB cannot give, and every packet while the programs stand by.
//!
//! The filter's decision here is the one TC egress makes again for what
//! passes: both read the same maps.
use crate::csum::{fold, halves};
use crate::fast;
use crate::filter;
use crate::frame::Frame;
use crate::hdr::{ETH_HLEN, IP6_HLEN, TCP_CSUM, UDP_CSUM};
use crate::lookup::{addr_info, in_cluster, prefilter, set_in, slot, source_allowed, standing_by};
use crate::maps::XDP_TARGETS;
use crate::nat::{translate, Field};
use crate::outline::OutOfLine;
use crate::parse::{load, Packet, PROTO_TCP, PROTO_UDP};
use crate::stats;
use aya_ebpf::{
    bindings::xdp_action,
    macros::xdp,
    programs::XdpContext,
};
use cozy_proxy_common::{addr, AddrInfo, DropReason, IpKey};

const PASS: u32 = xdp_action::XDP_PASS;
const DROP: u32 = xdp_action::XDP_DROP;
const REDIRECT: u32 = xdp_action::XDP_REDIRECT;

#[xdp(frags)]
pub fn cozy_xdp(mut ctx: XdpContext) -> u32 {
    at_uplink(&mut ctx)
}

/// An XDP program that only passes: never attached; the reference the
/// per-packet benchmark subtracts from the XDP cases.
#[xdp]
pub fn cozy_xdp_pass(_ctx: XdpContext) -> u32 {
    PASS
}

#[inline(always)]
fn drop(ctx: &XdpContext, reason: DropReason) -> u32 {
    stats::dropped(ctx, reason);
    DROP
}

#[inline(always)]
fn at_uplink(ctx: &mut XdpContext) -> u32 {
    let Some(p) = ctx.parsed() else { return PASS };
    // A tagged frame is its VLAN interface's, judged there at TC.
    if p.l3 != ETH_HLEN {
        return PASS;
    }
    let Some(f) = prefilter() else { return PASS };
    // Not ours for certain (one bit), or a source that may be guarded.
    if !set_in(&f.words, slot(&p.dst)) || set_in(&f.words, slot(&p.src)) {
        return PASS;
    }
    if standing_by() {
        return PASS;
    }
    let Some(d) = addr_info(&p.dst, true) else { return PASS };
    if d.flags & addr::LB == 0 {
        return PASS;
    }
    if d.flags & addr::UNMAPPED != 0 {
        return drop(ctx, DropReason::UnmappedLb);
    }
    if d.flags & addr::LOCAL == 0 || in_cluster(&p.src) {
        return PASS;
    }
    if !admitted(ctx, p, &d) {
        return DROP;
    }
    if !fast::enabled() {
        return PASS;
    }
    to_pod(ctx, p, &d)
}

/// The source ranges and the port filter, for `p` from outside to the LB
/// IP of `d`: judged as the pod would get it (the filter's keys name the
/// pod), the frame itself not rewritten yet. `false`: dropped, counted.
#[inline(always)]
fn admitted(ctx: &XdpContext, p: &mut Packet, d: &AddrInfo) -> bool {
    let lb = p.dst;
    p.dst = d.peer;
    let admitted = pod_admits(ctx, p, d, &lb);
    p.dst = lb;
    admitted
}

/// [`admitted`] of `p`, addressed to the pod already.
#[inline(always)]
fn pod_admits(ctx: &XdpContext, p: &Packet, d: &AddrInfo, lb: &IpKey) -> bool {
    if d.flags & addr::RANGED != 0
        && !source_allowed(lb, &p.src)
        && !filter::reply_to_own_flow(ctx, p, d.slot)
        && !filter::error_within_ranges(ctx, p, d.slot, |peer| source_allowed(lb, peer))
    {
        stats::dropped(ctx, DropReason::SourceRange);
        return false;
    }
    // Routed: the node forwards it, its hop limit not yet decremented.
    d.flags & addr::FILTERED == 0 || ctx.admitted(p, d.flags & addr::ICMP_ALLOWED != 0, d.slot, true)
}

/// The fast path from the uplink: translated, its hop's addresses set and
/// redirected to the pod's interface, if the frame is whole in its first
/// buffer, may be forwarded, the FIB knows its next hop and that hop's
/// interface takes XDP frames; else passed on untouched.
#[inline(always)]
fn to_pod(ctx: &mut XdpContext, p: &mut Packet, d: &AddrInfo) -> u32 {
    if ctx.data_end() - ctx.data() != ctx.len() as usize || !fast::forwardable(ctx, p) {
        return PASS;
    }
    if checksum_left_to_offload(ctx, p) {
        return PASS;
    }
    let Some(hop) = fast::next_hop(ctx, p, &p.src, &d.peer) else { return PASS };
    // Sets the redirect's target when the interface is in the map; the
    // frame goes there once the program returns XDP_REDIRECT.
    if XDP_TARGETS.redirect(hop.ifindex, PASS as u64).is_err() {
        return PASS;
    }
    if !translate(ctx, p, Field::Dst, &d.peer) || fast::to_hop(ctx, p, &hop).is_none() {
        return drop(ctx, DropReason::RewriteFailed);
    }
    stats::count(ctx, d, true);
    REDIRECT
}

/// Does the frame's TCP or UDP checksum hold only the pseudo-header's sum,
/// the rest left to a checksum offload (`CHECKSUM_PARTIAL`)? A veth's peer
/// sends such frames when its transmit checksum offload is on, and the
/// kernel completes the checksum only for an skb that knows it: a frame
/// redirected from XDP reaches the pod's stack as an skb with no checksum
/// state, which verifies the field and drops the segment. Those frames go
/// on to the stack, where the TC fast path hands them to the pod with
/// their state. A complete checksum equals the pseudo-header's sum by
/// chance once in 65 536 frames: it goes the same way, which is only
/// slower. A NIC hands over complete checksums: on a NIC's uplink this is
/// never true but by that chance.
#[inline(always)]
fn checksum_left_to_offload(ctx: &XdpContext, p: &Packet) -> bool {
    let field = match p.proto {
        PROTO_TCP => TCP_CSUM,
        PROTO_UDP => UDP_CSUM,
        _ => return false,
    };
    // A fragment's checksum covers the whole datagram: never offloaded.
    if p.fragment {
        return false;
    }
    // The upper layer's length, from the IP header (a short frame carries
    // padding after it).
    let (len_at, headers) = if p.v6 {
        (p.l3 + 4, p.l4 - p.l3 - IP6_HLEN)
    } else {
        (p.l3 + 2, p.l4 - p.l3)
    };
    let (Some(len), Some(csum)) = (load::<u16>(ctx, len_at), load::<u16>(ctx, p.l4 + field)) else {
        return false;
    };
    let l4_len = (u16::from_be(len) as usize).wrapping_sub(headers) as u16;
    // The pseudo-header (RFC 793, RFC 8200 8.1) in memory-order words:
    // the addresses, the protocol as the low byte of a big-endian word,
    // the length big-endian.
    let (s, d) = (p.src.words(), p.dst.words());
    let mut sum = halves(s[0]) + halves(d[0]) + ((p.proto as u32) << 8) + l4_len.to_be() as u32;
    if p.v6 {
        sum += halves(s[1]) + halves(s[2]) + halves(s[3]) + halves(d[1]) + halves(d[2]) + halves(d[3]);
    }
    fold(sum) == csum
}
