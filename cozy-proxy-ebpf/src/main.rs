//! cozy-proxy TC programs: a stateless 1:1 NAT between LoadBalancer IPs and
//! pods, the port filter, and the client-side translation for in-cluster
//! clients. docs/ebpf-datapath.md explains the hook points, docs/traffic.md
//! the semantics (both backends have the same).
//!
//! - `cozy_ingress` (TC ingress of every interface, before conntrack):
//!   anti-spoofing; a local mapped pod's packets leaving the cluster get
//!   its LB IP as source; in-cluster clients' packets to an LB IP get the
//!   pod as destination; replies of flows translated at TC egress get the
//!   LB IP back; unmapped LB IPs and sources outside an LB IP's ranges are
//!   dropped.
//! - `cozy_egress` (TC egress of every interface, after conntrack and
//!   routing: the controller routes each LB IP toward its pod): the LB IP
//!   of a local mapping becomes the pod; the node's own flows to any LB IP
//!   are translated; the port filter guards filtered pods; replies to
//!   in-cluster clients translated at TC ingress get the LB IP back.
//! - Standing by (`config.standby`: a backend switch, nftables still
//!   serving), both only remember the flows filtered pods start.
//! - `cozy_xdp` (XDP on the uplinks, `--xdp`): see xdp.rs.
#![no_std]
#![no_main]
#![feature(asm_experimental_arch)]

mod csum;
mod fast;
mod filter;
mod frame;
mod hdr;
mod lookup;
mod maps;
mod nat;
mod outline;
mod parse;
mod stats;
mod xdp;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::classifier,
    programs::TcContext,
};
use cozy_proxy_common::{
    addr, iface, limits, AddrInfo, Config, DropReason, IpKey, RevKey, RevValue, FAMILY_V4, FAMILY_V6,
    HAIRPIN_MARK, HAIRPIN_SEVERAL,
};
use hdr::{
    ARP_ETHERNET_IPV4, ARP_SENDER_ADDR, ETH_HLEN, ETH_P_ARP, ETH_TYPE, ICMP_TYPE, ND_ADVERT, ND_TARGET, TCP_ACK,
    TCP_FLAGS, TCP_SYN,
};
use lookup::{addr_info, in_cluster, prefilter, set_in, slot, source_allowed, standing_by};
use maps::{CONFIG, IFACES, REV_HELD, REV_NAT};
use nat::Field;
use outline::OutOfLine;
use parse::{
    be16, byte, flow_ports, is_icmp, is_icmp_error, is_neighbour_discovery, load, load_words, quoted_flow, Packet,
    PROTO_ICMPV6,
};
use stats::count;

/// Let the packet continue (next TC program, or the stack).
const PASS: i32 = TC_ACT_UNSPEC;
pub(crate) const DROP: i32 = TC_ACT_SHOT as i32;

/// What the prefilter says of each address: `false` is certain, so the
/// hash lookup of that address is skipped (a mapped packet has one address
/// of ours and one from outside: one lookup, not a miss and a hit).
#[derive(Clone, Copy)]
struct Ours {
    src: bool,
    dst: bool,
}

const MAYBE_BOTH: Ours = Ours { src: true, dst: true };

/// At TC ingress: any source in `addrs` (the guard); as destination, an LB
/// IP of another node's mapping or without one, or any where a local
/// mapping's LB IP is acted on here ([`local_lbs_here`]; on the stack path
/// TC egress translates it). `None`: neither, the packet is left alone at
/// once.
#[inline(always)]
fn ours_at_ingress(p: &Packet, iif: u32) -> Option<Ours> {
    let Some(f) = prefilter() else {
        return Some(MAYBE_BOTH);
    };
    let d = slot(&p.dst);
    let o = Ours {
        src: set_in(&f.words, slot(&p.src)),
        dst: set_in(&f.words, d) && (set_in(&f.foreign_lbs, d) || local_lbs_here(iif)),
    };
    (o.src || o.dst).then_some(o)
}

/// Is a local mapping's LB IP acted on at TC ingress of `iif`: with the
/// fast path on, or where in-cluster clients' hairpins may leave again
/// (their flows are marked here)?
#[inline(always)]
fn local_lbs_here(iif: u32) -> bool {
    // SAFETY: a map value, read whole.
    CONFIG.get_ptr(0).is_some_and(|c| {
        let c = unsafe { *c };
        c.fast_path != 0 || hairpins_leave(&c, iif)
    })
}

/// May in-cluster clients' hairpins leave by `iif` (`Config::hairpin_iface`)?
#[inline(always)]
fn hairpins_leave(c: &Config, iif: u32) -> bool {
    match c.hairpin_iface {
        0 => false,
        // SAFETY: a map value, one field read.
        HAIRPIN_SEVERAL => IFACES
            .get_ptr(&iif)
            .is_some_and(|r| unsafe { (*r).flags } & iface::HAIRPIN != 0),
        one => one == iif,
    }
}

/// At TC egress: a source only if a pod (a reply translated back), any
/// destination in `addrs`.
#[inline(always)]
fn ours_at_egress(p: &Packet) -> Option<Ours> {
    let Some(f) = prefilter() else {
        return Some(MAYBE_BOTH);
    };
    let o = Ours {
        src: set_in(&f.pods, slot(&p.src)),
        dst: set_in(&f.words, slot(&p.dst)),
    };
    (o.src || o.dst).then_some(o)
}

/// The reverse-translation entry of a reply `p` (from the pod to the
/// client), if the client's flow was translated on this node. An ICMP
/// error the pod sends about the client's packet (a closed port, a
/// datagram too big) belongs to that flow too, as conntrack relates it:
/// keyed by the packet it quotes, which was sent to the pod.
#[inline(never)]
fn rev_of_reply(ctx: &TcContext, p: &Packet) -> Option<RevValue> {
    let error = is_icmp(p) && byte(ctx, p.l4 + ICMP_TYPE).is_some_and(|t| is_icmp_error(p, t));
    let (proto, client_port, backend_port) = match error {
        true => match quoted_flow(ctx, p) {
            Some(q) if q.dst == p.src => (q.proto, q.sport, q.dport),
            _ => return None,
        },
        false => {
            let (backend_port, client_port) = flow_ports(ctx, p, false).unwrap_or((0, 0));
            (p.proto, client_port, backend_port)
        }
    };
    let k = RevKey {
        client: p.dst,
        backend: p.src,
        proto,
        _pad: 0,
        client_port,
        backend_port,
        _pad2: 0,
    };
    // SAFETY: a value of the map, copied whole.
    REV_NAT.get_ptr(&k).map(|v| unsafe { *v })
}

/// The reverse-translation key of `p`, from a client to `pod` (or to its
/// LB IP: the ports are the same).
#[inline(always)]
fn rev_key(ctx: &TcContext, p: &Packet, pod: &IpKey) -> RevKey {
    let (client_port, backend_port) = flow_ports(ctx, p, true).unwrap_or((0, 0));
    RevKey {
        client: p.src,
        backend: *pod,
        proto: p.proto,
        _pad: 0,
        client_port,
        backend_port,
        _pad2: 0,
    }
}

/// Was the flow of `p`, from a client to `pod` through `lb`, recorded
/// already? Its client was judged at the flow's first packet; the later
/// ones skip the reverse-path lookup.
#[inline(always)]
fn rev_recorded(ctx: &TcContext, p: &Packet, pod: &IpKey, lb: &IpKey) -> bool {
    // SAFETY: a value of the map, one field read.
    REV_NAT
        .get_ptr(&rev_key(ctx, p, pod))
        .is_some_and(|v| unsafe { (*v).lb } == *lb)
}

/// [`rev_recorded`] for `p` to an LB IP mapped to `pod`, not yet
/// rewritten. Not inlined (nor [`recorded_after_rewrite`]): the verifier
/// walks it once, not once per path that reaches it; apart, as each has
/// at most five arguments once the compiler passes a key by value.
#[inline(never)]
fn recorded_before_rewrite(ctx: &TcContext, p: &Packet, pod: &IpKey) -> bool {
    rev_recorded(ctx, p, pod, &p.dst)
}

/// [`rev_recorded`] for `p` rewritten from `lb` to the pod.
#[inline(never)]
fn recorded_after_rewrite(ctx: &TcContext, p: &Packet, lb: &IpKey) -> bool {
    rev_recorded(ctx, p, &p.dst, lb)
}

/// Records that `p` (from a client to `lb`, now addressed to the pod) was
/// translated on this node; `Err` (the verdict: dropped, counted) for a
/// new flow of a client at its quota of entries ([`rev_room`]).
#[inline(always)]
fn record_rev(
    ctx: &TcContext,
    p: &Packet,
    pod: &IpKey,
    lb: &IpKey,
    before_conntrack: bool,
    ifindex: u32,
) -> Result<(), i32> {
    let k = rev_key(ctx, p, pod);
    let seen_s = RevValue::seconds(filter::now());
    // The flow's entry as it stands: only its time is written (an update
    // of an LRU map allocates a new element; a store in place does not).
    let cur = REV_NAT.get_ptr_mut(&k);
    if let Some(cur) = cur {
        // SAFETY: a value of the map, written in place; a racing update
        // of the same flow writes the same fields.
        let cur = unsafe { &mut *cur };
        if cur.lb == *lb && cur.before_conntrack == before_conntrack as u8 && cur.ifindex == ifindex {
            cur.seen_s = seen_s;
            return Ok(());
        }
    } else if !rev_room(&p.src) {
        return Err(drop(ctx, DropReason::ReverseQuota));
    }
    let v = RevValue {
        lb: *lb,
        before_conntrack: before_conntrack as u8,
        _pad: 0,
        _pad2: 0,
        ifindex,
        seen_s,
    };
    let _ = REV_NAT.insert(&k, &v, 0);
    Ok(())
}

/// Room for one more reverse translation of `client`'s (taken if so):
/// below its quota, so that one client (a tenant's pod opening flows from
/// every port to every LB IP) cannot push the others' out of `rev_nat`.
#[inline(never)]
fn rev_room(client: &IpKey) -> bool {
    let Some(held) = REV_HELD.get_ptr_mut(client) else {
        let _ = REV_HELD.insert(client, &1, 0);
        return true;
    };
    // SAFETY: a value of the map; a racing increment may be lost, which
    // the sweep's recount corrects.
    unsafe {
        let n = core::ptr::read_volatile(held);
        if n >= limits::REV_PER_SOURCE {
            return false;
        }
        core::ptr::write_volatile(held, n + 1);
    }
    true
}

/// Does `p` open a flow: a TCP SYN (without ACK), or any UDP datagram?
#[inline(always)]
fn opens_flow(ctx: &TcContext, p: &Packet) -> bool {
    match p.proto {
        parse::PROTO_TCP => byte(ctx, p.l4 + TCP_FLAGS).is_some_and(|f| f & (TCP_SYN | TCP_ACK) == TCP_SYN),
        parse::PROTO_UDP => !p.later_fragment,
        _ => false,
    }
}

/// Forgets the reverse translation of `p`'s addresses and ports (a client
/// to a pod), as [`record_rev`] keyed it, if it was translated at this
/// very hook: a packet translated at a bridge's hook passes the pod's port
/// next, addressed to the pod, and must not end its own flow there.
#[inline(always)]
fn forget_rev(ctx: &TcContext, p: &Packet, here: u32) {
    let Some((client_port, backend_port)) = flow_ports(ctx, p, true) else {
        return;
    };
    let k = RevKey {
        client: p.src,
        backend: p.dst,
        proto: p.proto,
        _pad: 0,
        client_port,
        backend_port,
        _pad2: 0,
    };
    // SAFETY: a value of the map, one field read.
    if REV_NAT.get_ptr(&k).is_some_and(|v| unsafe { (*v).ifindex } == here) {
        let _ = REV_NAT.remove(&k);
    }
}

/// Counts a drop for `reason`; the verdict that drops.
#[inline(always)]
fn drop(ctx: &TcContext, reason: DropReason) -> i32 {
    stats::dropped(ctx, reason);
    DROP
}

/// [`nat::translate`], a failure dropped (counted) with its verdict.
#[inline(always)]
fn translate(ctx: &mut TcContext, p: &mut Packet, field: Field, new: &IpKey) -> Result<(), i32> {
    if nat::translate(ctx, p, field, new) {
        Ok(())
    } else {
        Err(drop(ctx, DropReason::RewriteFailed))
    }
}

/// What becomes of a guarded source arriving on `iif`, which is not its own
/// entry interface `entry`.
enum Elsewhere {
    /// On its way to where it is judged: left alone here.
    Pass,
    /// Judged here after all: a port of the bridge it enters by, its port
    /// not known yet.
    Here,
    Spoofed,
    /// A neighbour on its bridge: another port of the bridge it arrived
    /// at is the address's own (its neighbour discovery included, which
    /// would move the node's neighbour entry to the neighbour).
    Neighbour,
}

/// The bridge interface `ifindex` is a port of (0: none, or unknown).
#[inline(always)]
fn bridge_of(ifindex: u32) -> u32 {
    // SAFETY: a map value, one field read.
    IFACES.get_ptr(&ifindex).map_or(0, |r| unsafe { (*r).bridge })
}

/// Only off the common path (a guarded source on its own interface never
/// asks): the interface's role (`ifaces`, see cozy-proxy-common `IfRole`).
///
/// At a bridge's port, a guarded source is judged only where its route
/// names that bridge (its entry the bridge, or one of its ports). A bridge
/// the route does not name is a segment the node only carries (Kube-OVN's
/// pods' segment behind its router): frames the segment's router sends
/// back into it carry the pods' addresses in by the router's port, which
/// the node cannot tell from the pod's own, so the source is judged where
/// the route says it enters the node, or by the bridge itself if the
/// bridge hands it up to the node.
#[inline(never)]
fn arriving_elsewhere(ctx: &TcContext, iif: u32, entry: u32) -> Elsewhere {
    // SAFETY: a map value, copied whole.
    let role = IFACES.get_ptr(&iif).map(|r| unsafe { *r }).unwrap_or_default();
    if role.flags & iface::BRIDGE != 0 {
        return if bridge_of(entry) == iif { Elsewhere::Pass } else { Elsewhere::Spoofed };
    }
    if role.flags & iface::DEFER != 0 {
        return Elsewhere::Pass;
    }
    if role.bridge != 0 {
        if entry == role.bridge {
            return if role.flags & iface::PORT_JUDGES != 0 { Elsewhere::Here } else { Elsewhere::Pass };
        }
        // Another port of this bridge is its own.
        if bridge_of(entry) == role.bridge {
            return Elsewhere::Neighbour;
        }
        return Elsewhere::Pass;
    }
    // A frame of a VLAN, tag in the skb's metadata: the VLAN's interface
    // receives (and judges) it next, or, without one, the stack drops it.
    // SAFETY: reading fields of the context the kernel passed us.
    let (tagged, tci) = unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).vlan_tci) };
    if tagged != 0 && tci & 0x0fff != 0 {
        return Elsewhere::Pass;
    }
    Elsewhere::Spoofed
}

#[classifier]
pub fn cozy_ingress(mut ctx: TcContext) -> i32 {
    // SAFETY: reading a field of the context the kernel passed us.
    let iif = unsafe { (*ctx.skb.skb).ifindex };
    let Some(p) = ctx.parsed() else { return arp_claim(&ctx, iif) };
    if p.v6 && p.proto == PROTO_ICMPV6 && advert_claim(&ctx, p, iif) {
        return drop(&ctx, DropReason::Spoofed);
    }
    let Some(ours) = ours_at_ingress(p, iif) else { return PASS };
    if standing_by() {
        learn_while_standing_by(&ctx, p, ours, iif);
        return PASS;
    }
    if let Some(s) = addr_info(&p.src, ours.src) {
        if s.src_ifindex == 0 || s.src_ifindex != iif {
            match arriving_elsewhere(&ctx, iif, s.src_ifindex) {
                Elsewhere::Pass => return PASS,
                Elsewhere::Here => {}
                // Neighbour discovery is not guarded, as ARP is not: a VM
                // whose interface has just moved resolves its gateway
                // before this node's route to it follows. Never translated.
                Elsewhere::Spoofed if is_neighbour_discovery(&ctx, p) => return PASS,
                // A guarded address from anywhere but its own path:
                // nothing is translated, remembered or tracked for it.
                Elsewhere::Spoofed | Elsewhere::Neighbour => return drop(&ctx, DropReason::Spoofed),
            }
        }
        if s.flags & addr::POD == 0 {
            return PASS;
        }
        return match from_pod(&mut ctx, p, &s) {
            Ok(()) => PASS,
            Err(verdict) => verdict,
        };
    }
    let Some(d) = addr_info(&p.dst, ours.dst) else { return PASS };
    if d.flags & addr::LB == 0 {
        return PASS;
    }
    if d.flags & addr::UNMAPPED != 0 {
        return drop(&ctx, DropReason::UnmappedLb);
    }
    let client = in_cluster(&p.src)
        && (recorded_before_rewrite(&ctx, p, &d.peer)
            || match side_of(&ctx, p, iif) {
                Side::Cluster => true,
                Side::Outside => false,
                Side::Master => return PASS,
            });
    // A mapping here: translated at TC egress, after routing via the LB
    // IP's route; from outside straight to the pod, if the fast path is on.
    if d.flags & addr::LOCAL != 0 {
        if client {
            mark_hairpin(&ctx, p, &p.dst, iif);
        } else if fast::enabled() {
            return fast_to_pod(&mut ctx, p, &d);
        }
        return PASS;
    }
    // An in-cluster client of a mapping on another node: translated here,
    // so that it leaves addressed to the pod (no masquerade; the pod sees
    // the client) and conntrack here sees client <-> pod.
    if client {
        if d.flags & addr::RANGED != 0 && !source_allowed(&p.dst, &p.src) {
            return drop(&ctx, DropReason::SourceRange);
        }
        let lb = p.dst;
        if let Err(verdict) = translate(&mut ctx, p, Field::Dst, &d.peer) {
            return verdict;
        }
        if let Err(verdict) = record_rev(&ctx, p, &d.peer, &lb, false, iif) {
            return verdict;
        }
        mark_hairpin(&ctx, p, &p.dst, iif);
    }
    PASS
}

/// Is `claimed`, named by a neighbour's claim arriving by `iif`, a guarded
/// address whose own port is another port of the bridge `iif` is a port
/// of? A claim (ARP's sender address, a neighbour advertisement's target)
/// moves the node's neighbour entry: the node's traffic to the pod would
/// go to the neighbour until the pod spoke again. Only a bridge's ports
/// share one neighbour table; a claim on a routed veth names its own link.
#[inline(always)]
fn a_neighbours_claim(claimed: &IpKey, iif: u32) -> bool {
    if standing_by() {
        return false;
    }
    let maybe = prefilter().is_none_or(|f| set_in(&f.words, slot(claimed)));
    let Some(a) = addr_info(claimed, maybe) else { return false };
    let bridge = bridge_of(iif);
    bridge != 0 && a.src_ifindex != iif && bridge_of(a.src_ifindex) == bridge
}

/// An ARP packet (no IP header: `parse` left it) claiming a guarded
/// address from a neighbour's port: dropped and counted as a spoofed
/// source. Anything else passes.
#[inline(never)]
fn arp_claim(ctx: &TcContext, iif: u32) -> i32 {
    if be16(ctx, ETH_TYPE) != Some(ETH_P_ARP) || load::<[u8; 6]>(ctx, ETH_HLEN) != Some(ARP_ETHERNET_IPV4) {
        return PASS;
    }
    let Some(sender) = load_words::<u32>(ctx, ETH_HLEN + ARP_SENDER_ADDR) else { return PASS };
    if a_neighbours_claim(&IpKey::from_words(FAMILY_V4, [sender, 0, 0, 0]), iif) {
        return drop(ctx, DropReason::Spoofed);
    }
    PASS
}

/// A neighbour advertisement whose target is a guarded address, from a
/// neighbour's port (its own source may be any address).
#[inline(never)]
fn advert_claim(ctx: &TcContext, p: &Packet, iif: u32) -> bool {
    if p.later_fragment || byte(ctx, p.l4) != Some(ND_ADVERT) {
        return false;
    }
    let Some(target) = load_words::<[u32; 4]>(ctx, p.l4 + ND_TARGET) else { return false };
    a_neighbours_claim(&IpKey::from_words(FAMILY_V6, target), iif)
}

/// Where a source of the in-cluster ranges stands, as it arrives by `iif`
/// at TC ingress.
enum Side {
    /// A client in the cluster: it arrived by the interface through which
    /// the node routes it back (strict reverse path, as `rp_filter=1`), or
    /// by a port of the bridge the node routes it through.
    Cluster,
    /// Anywhere else (a pod network's address forged at the uplink): an
    /// outside client, for which nothing is recorded.
    Outside,
    /// A port of a bond, team or Open vSwitch datapath: the master's
    /// interface, where the frame arrives next, decides.
    Master,
}

#[inline(always)]
fn side_of(ctx: &TcContext, p: &Packet, iif: u32) -> Side {
    let back = fast::way_back(ctx, p, &p.dst, &p.src, iif);
    if back == iif {
        return Side::Cluster;
    }
    // SAFETY: a map value, copied whole.
    let role = IFACES.get_ptr(&iif).map(|r| unsafe { *r }).unwrap_or_default();
    if role.flags & iface::DEFER != 0 && role.flags & iface::BRIDGE == 0 {
        Side::Master
    } else if back != 0 && back != fast::LOCAL && role.bridge == back {
        Side::Cluster
    } else {
        Side::Outside
    }
}

/// An in-cluster client's packet to an LB IP that the node routes back out
/// of the interface it came in by (Kube-OVN's `ovn0`: the client and the
/// pod both behind OVN's router): the pod would answer the client
/// directly, past this node, from its own address, which the client's
/// socket drops. Marked for the one masquerade rule beside the programs
/// ([`HAIRPIN_MARK`]), so that the answer comes back here, where it is
/// translated. Not on a bridge or one of its ports (their hooks see the
/// answer), nor on a bond's. Asked only on an interface through which the
/// node reaches a mapped pod via a router (`Config::hairpin_iface`): only
/// there may such a flow leave again, and only there is the route looked
/// up.
#[inline(never)]
fn mark_hairpin(ctx: &TcContext, p: &Packet, dst: &IpKey, iif: u32) {
    // SAFETY: a map value, read whole.
    if !CONFIG.get_ptr(0).is_some_and(|c| hairpins_leave(unsafe { &*c }, iif)) {
        return;
    }
    // SAFETY: a map value, copied whole.
    let role = IFACES.get_ptr(&iif).map(|r| unsafe { *r }).unwrap_or_default();
    if role.bridge != 0 || role.flags & (iface::BRIDGE | iface::DEFER) != 0 {
        return;
    }
    if fast::route_oif(ctx, p, &p.src, dst) == Some(iif) {
        // SAFETY: reading a field of the context the kernel passed us.
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark(mark | HAIRPIN_MARK);
    }
}

/// While the other backend serves (a switch): remember the flows a
/// filtered or ranged pod of this node starts, from its own path, and
/// nothing else. Their replies then pass the filter from the moment the
/// programs act, though the other backend translated the flows' first
/// packets (the flows older than the standby are read from conntrack).
#[inline(never)]
fn learn_while_standing_by(ctx: &TcContext, p: &Packet, ours: Ours, iif: u32) {
    let Some(s) = addr_info(&p.src, ours.src) else { return };
    let local_pod = s.flags & (addr::POD | addr::LOCAL) == addr::POD | addr::LOCAL;
    if !local_pod || s.flags & (addr::FILTERED | addr::RANGED) == 0 {
        return;
    }
    let own_path = s.src_ifindex == iif
        || (s.src_ifindex != 0
            && matches!(arriving_elsewhere(ctx, iif, s.src_ifindex), Elsewhere::Here));
    if own_path {
        filter::remember_outbound(ctx, p, s.slot);
    }
}

/// The fast path toward a local pod (see fast.rs): the same translation,
/// source ranges and filter as at TC egress, then handed to the pod. The
/// stack path, untouched, wherever the FIB cannot say where the pod is.
#[inline(always)]
fn fast_to_pod(ctx: &mut TcContext, p: &mut Packet, d: &AddrInfo) -> i32 {
    let Some(hop) = fast::next_hop(ctx, p, &p.src, &d.peer) else {
        return PASS;
    };
    if !fast::forwardable(ctx, p) {
        return PASS;
    }
    let lb = p.dst;
    let listed = d.flags & addr::RANGED == 0 || source_allowed(&lb, &p.src);
    if let Err(verdict) = translate(ctx, p, Field::Dst, &d.peer) {
        return verdict;
    }
    if !listed
        && !filter::reply_to_own_flow(ctx, p, d.slot)
        && !filter::error_within_ranges(ctx, p, d.slot, |peer| source_allowed(&lb, peer))
    {
        return drop(ctx, DropReason::SourceRange);
    }
    if d.flags & addr::FILTERED != 0 {
        if !ctx.admitted(p, d.flags & addr::ICMP_ALLOWED != 0, d.slot, true) {
            return DROP;
        }
    }
    count(ctx, d, true);
    // Into the pod's namespace only through the interface userspace found
    // to be the pod's veth; otherwise out of whatever the FIB said.
    let peer = d.flags & addr::PATH_PEER != 0 && hop.ifindex == d.path_ifindex;
    fast::forward(ctx, p, &hop, peer).unwrap_or_else(|| drop(ctx, DropReason::RewriteFailed))
}

/// A packet from a pod of this node or another, from its own path.
#[inline(always)]
fn from_pod(ctx: &mut TcContext, p: &mut Packet, s: &AddrInfo) -> Result<(), i32> {
    let local = s.flags & addr::LOCAL != 0;
    if local {
        // Replies to its own flows pass the port filter and the source
        // ranges: remember the flows of pods that have either.
        if s.flags & (addr::FILTERED | addr::RANGED) != 0 {
            filter::remember_outbound(ctx, p, s.slot);
        }
        // The pod keeps its own IP toward the cluster, the node (whose own
        // addresses userspace keeps in the same trie) and link-local or
        // multicast neighbours (neighbour discovery); its LB IP toward
        // everything else.
        let stays = parse::is_link_scope(&p.dst) || in_cluster(&p.dst);
        if !stays {
            // The fast path: out of the interface toward the destination,
            // if the FIB knows it (routed as if from the LB IP).
            let hop = if fast::enabled() && fast::forwardable(ctx, p) {
                fast::next_hop(ctx, p, &s.peer, &p.dst)
            } else {
                None
            };
            translate(ctx, p, Field::Src, &s.peer)?;
            count(ctx, s, false);
            if let Some(hop) = hop {
                // (A verdict other than "continue" travels as `Err`.)
                return Err(fast::forward(ctx, p, &hop, false)
                    .unwrap_or_else(|| drop(ctx, DropReason::RewriteFailed)));
            }
            return Ok(());
        }
    }
    // Toward the cluster or the node: a reply within a flow translated on
    // this node? Translated at TC egress (the node's own socket, a client of
    // a mapping here), conntrack saw the LB IP: back before conntrack.
    // Translated at TC ingress, conntrack saw the pod: TC egress translates
    // the reply, after conntrack.
    if let Some(rev) = rev_of_reply(ctx, p) {
        if rev.before_conntrack != 0 {
            return translate(ctx, p, Field::Src, &rev.lb);
        }
    }
    Ok(())
}

#[classifier]
pub fn cozy_egress(mut ctx: TcContext) -> i32 {
    let Some(p) = ctx.parsed() else { return PASS };
    let Some(ours) = ours_at_egress(p) else { return PASS };
    if standing_by() {
        return PASS;
    }
    // SAFETY: reading a field of the context the kernel passed us.
    let arrived = unsafe { (*ctx.skb.skb).ingress_ifindex };
    let forwarded = arrived != 0;
    // SAFETY: as above. Read once, here: the verifier refuses a read
    // through a context pointer the compiler has offset.
    let here = unsafe { (*ctx.skb.skb).ifindex };
    if let Some(d) = addr_info(&p.dst, ours.dst) {
        if d.flags & addr::LB != 0 {
            if d.flags & addr::UNMAPPED != 0 {
                return drop(&ctx, DropReason::UnmappedLb);
            }
            let local = d.flags & addr::LOCAL != 0;
            // Another node's mapping: forwarded traffic goes there
            // untranslated (that node translates); the node's own flows are
            // translated here, as any in-cluster client's.
            if !local && forwarded {
                return PASS;
            }
            // Only the listed sources reach the pod through its LB IP.
            let listed = d.flags & addr::RANGED == 0 || source_allowed(&p.dst, &p.src);
            let lb = p.dst;
            if let Err(verdict) = translate(&mut ctx, p, Field::Dst, &d.peer) {
                return verdict;
            }
            // Replies to the pod's own flows, and errors about its flows
            // with allowed peers, pass from anywhere.
            if !listed
                && !(local
                    && (filter::reply_to_own_flow(&ctx, p, d.slot)
                        || filter::error_within_ranges(&ctx, p, d.slot, |peer| source_allowed(&lb, peer))))
            {
                return drop(&ctx, DropReason::SourceRange);
            }
            if local {
                count(&ctx, &d, true);
            }
            // The node's own socket, or an in-cluster client of a mapping
            // here (routed to the pod without translation at TC ingress):
            // conntrack saw the LB IP; its reply is translated back before
            // conntrack. A client in the cluster only from where the node
            // routes it (as at TC ingress: the interface, or a port of the
            // bridge it names, which a client the node has redirected to
            // the pod crosses without the node's stack), or masqueraded by
            // the node itself (a hairpin: the stack drops any other packet
            // arriving with the node's own address as source).
            let client = || {
                in_cluster(&p.src)
                    && (recorded_after_rewrite(&ctx, p, &lb)
                        || matches!(fast::way_back(&ctx, p, &lb, &p.src, arrived),
                            w if w == arrived || w == fast::LOCAL || (w != 0 && bridge_of(arrived) == w)))
            };
            if !forwarded || client() {
                if let Err(verdict) = record_rev(&ctx, p, &d.peer, &lb, true, here) {
                    return verdict;
                }
            }
            if !local || !forwarded || d.flags & addr::FILTERED == 0 {
                return PASS;
            }
            return if ctx.admitted(p, d.flags & addr::ICMP_ALLOWED != 0, d.slot, false) {
                PASS
            } else {
                DROP
            };
        }
        // The node's own flow to a mapped pod by the pod's IP ends any flow
        // through the LB IP its socket had with the same ports (the port
        // reused): the pod's replies keep the pod's address. An entry left
        // behind, or planted by a pod sending as the node, would otherwise
        // turn a kubelet probe's reply into one from the LB IP.
        if !forwarded && d.flags & addr::POD != 0 && opens_flow(&ctx, p) {
            forget_rev(&ctx, p, here);
        }
        // To a filtered pod of this node by its own IP: the filter guards
        // forwarded traffic (the node's own probes are not filtered).
        if d.flags & addr::LOCAL != 0 && d.flags & addr::FILTERED != 0 && forwarded {
            if !ctx.admitted(p, d.flags & addr::ICMP_ALLOWED != 0, d.slot, false) {
                return DROP;
            }
        }
        return PASS;
    }
    // A pod's reply to an in-cluster client whose flow was translated at TC
    // ingress: after conntrack (which saw client <-> pod), the LB IP back.
    let Some(s) = addr_info(&p.src, ours.src) else { return PASS };
    if s.flags & addr::POD == 0 {
        return PASS;
    }
    if let Some(rev) = rev_of_reply(&ctx, p) {
        if rev.before_conntrack == 0 {
            if let Err(verdict) = translate(&mut ctx, p, Field::Src, &rev.lb) {
                return verdict;
            }
        }
    }
    PASS
}

/// A program that only returns: never attached; the reference the
/// per-packet benchmark subtracts (the cost of running any TC program).
#[classifier]
pub fn cozy_pass(_ctx: TcContext) -> i32 {
    PASS
}

/// Ends the chain (`TC_ACT_OK`) as another agent's program does (Cilium's
/// never return "next"): never attached by cozy-proxy; the coexistence
/// tests attach it ahead of and behind ours, as another agent would.
#[classifier]
pub fn test_chain_end(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
