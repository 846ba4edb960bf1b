//! The port filter for pods whose Service has `wholeIP: "false"`, and the
//! memory of the flows such pods start (so their replies pass). It fails
//! closed: a packet whose protocol or port cannot be read is dropped.
use crate::hdr::*;
use crate::maps::{ALLOWED_PORTS, FLOWS, FLOW_COUNTS, FRAGS};
use crate::parse::{
    be16, byte, echo_types, flow_ports, has_ports, is_icmp, is_icmp_error, load, ports, quoted_flow,
    Packet, Quoted, PROTO_TCP,
};
use crate::frame::Frame;
use aya_ebpf::helpers::bpf_ktime_get_ns;
use cozy_proxy_common::{flow, limits, DropReason, FlowKey, FlowState, FragKey, IpKey, PortKey};

const BPF_NOEXIST: u64 = 1;
const BPF_EXIST: u64 = 2;


#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// The flow count of the mapping in `slot` (its pod's quota). Counted
/// without atomics (Rust offers no atomic add on BPF): two CPUs adding at
/// the same instant may lose one, which the controller's recount at every
/// sweep corrects; a quota only has to hold roughly.
#[derive(Clone, Copy)]
struct Count(*mut u64);

impl Count {
    #[inline(always)]
    fn of(slot: u16) -> Option<Count> {
        FLOW_COUNTS.get_ptr_mut(slot as u32).map(Count)
    }

    #[inline(always)]
    fn get(self) -> u64 {
        // SAFETY: a map value that lives as long as the program.
        unsafe { core::ptr::read_volatile(self.0) }
    }

    #[inline(always)]
    fn set(self, v: u64) {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(self.0, v) }
    }
}

#[inline(always)]
fn key(pod: IpKey, peer: IpKey, proto: u8, pod_port: u16, peer_port: u16) -> FlowKey {
    FlowKey {
        pod,
        peer,
        proto,
        _pad: 0,
        pod_port,
        peer_port,
        _pad2: 0,
    }
}

/// How far a flow got, from a packet the pod sends.
#[inline(always)]
fn state_of<C: Frame>(ctx: &C, p: &Packet, previous: Option<u8>) -> u8 {
    match p.proto {
        PROTO_TCP => {
            let flags = byte(ctx, p.l4 + TCP_FLAGS).unwrap_or(0);
            if flags & (TCP_FIN | TCP_RST) != 0 {
                flow::TCP_CLOSING
            } else if flags & TCP_SYN != 0 && previous.is_none() {
                flow::TCP_OPENING
            } else {
                flow::TCP_ESTABLISHED
            }
        }
        _ if has_ports(p.proto) => match previous {
            Some(flow::UDP_REPLIED) => flow::UDP_REPLIED,
            _ => flow::UDP,
        },
        _ => flow::OTHER,
    }
}

/// Remembers a flow a filtered pod sends (before its source is rewritten),
/// within the pod's quota (`slot`: its mapping's): a pod over it simply
/// does not remember more (its replies then pass only to listed ports),
/// and no other pod is affected.
#[inline(always)]
pub fn remember_outbound<C: Frame>(ctx: &C, p: &Packet, slot: u16) {
    if p.later_fragment {
        return;
    }
    let Some((pod_port, peer_port)) = flow_ports(ctx, p, true) else {
        return;
    };
    let k = key(p.src, p.dst, p.proto, pod_port, peer_port);
    let previous = FLOWS.get_ptr(&k).map(|s| {
        // SAFETY: a value of the map, read whole.
        unsafe { (*s).state }
    });
    let state = FlowState {
        last_seen_ns: now(),
        state: state_of(ctx, p, previous),
        _pad: 0,
        _pad2: 0,
        _pad3: 0,
    };
    if previous.is_some() {
        let _ = FLOWS.insert(&k, &state, BPF_EXIST);
        return;
    }
    if answers_outside(ctx, p, pod_port) {
        return;
    }
    let Some(count) = Count::of(slot) else {
        return;
    };
    if count.get() >= limits::FLOWS_PER_POD as u64 {
        return;
    }
    if FLOWS.insert(&k, &state, BPF_NOEXIST).is_ok() {
        count.set(count.get() + 1);
    }
}

/// Does the pod answer traffic from outside, which needs no memory? A
/// SYN-ACK answers a SYN; anything from one of its listed ports answers
/// traffic that passes the filter anyway. Remembered, such answers would
/// let whoever can send to a listed port (from as many spoofed sources as
/// it likes) fill the pod's quota, and the pod's own flows would then lose
/// their replies. Asked of a flow's first packet only.
#[inline(always)]
fn answers_outside<C: Frame>(ctx: &C, p: &Packet, pod_port: u16) -> bool {
    if p.proto == PROTO_TCP {
        let flags = byte(ctx, p.l4 + TCP_FLAGS).unwrap_or(0);
        if flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
            return true;
        }
    }
    let listed = PortKey {
        pod: p.src,
        proto: p.proto,
        _pad: 0,
        port: pod_port,
    };
    has_ports(p.proto) && ALLOWED_PORTS.get_ptr(&listed).is_some()
}

/// Is this a reply within a flow its pod started, still alive? (`slot`:
/// the pod's mapping, whose count an expired flow leaves.)
#[inline(always)]
fn known_flow(k: &FlowKey, slot: u16) -> bool {
    let Some(s) = FLOWS.get_ptr_mut(k) else {
        return false;
    };
    let t = now();
    // SAFETY: a value of the map; only its fields are written.
    unsafe {
        if t.wrapping_sub((*s).last_seen_ns) > flow::timeout_ns((*s).state) {
            // Expired: forgotten now, so that its room serves a new flow
            // (the controller's sweep frees the ones nobody asks about).
            if FLOWS.remove(k).is_ok() {
                if let Some(count) = Count::of(slot) {
                    let n = count.get();
                    if n > 0 {
                        count.set(n - 1);
                    }
                }
            }
            return false;
        }
        (*s).last_seen_ns = t;
        if (*s).state == flow::UDP {
            (*s).state = flow::UDP_REPLIED;
        }
    }
    true
}

/// Is the quoted flow one the pod started, still alive?
#[inline(always)]
fn quoted_own_flow(p: &Packet, q: &Quoted, slot: u16) -> bool {
    known_flow(&key(p.dst, q.dst, q.proto, q.sport, q.dport), slot)
}

/// Is an ICMP error (toward a filtered pod) about a flow the pod has: one
/// it started, or one a peer opened to a listed port (the pod answers
/// from that port). A "fragmentation needed" or "packet too big" about a
/// large answer from a listed port is what path MTU discovery needs, and
/// nftables admits it as related to its connection. An error quoting a
/// listed port admits no more than the port itself does, and the pod's
/// own stack acts on it only if a socket holds the quoted flow. A
/// function of its own: its keys on the callers' stack frame would take
/// those past the verifier's 512 bytes.
#[inline(never)]
fn error_about_pods_flow<C: Frame>(ctx: &C, p: &Packet, slot: u16) -> bool {
    let Some(q) = quoted_flow(ctx, p) else {
        return false;
    };
    let listed = PortKey {
        pod: p.dst,
        proto: q.proto,
        _pad: 0,
        port: q.sport,
    };
    ALLOWED_PORTS.get_ptr(&listed).is_some() || quoted_own_flow(p, &q, slot)
}

/// Is `p` (toward the pod `p.dst`, translated, from a source outside its
/// LB IP's source ranges) an ICMP error about a flow the pod may have:
/// with a peer inside the ranges (`in_ranges`: a router on the path to an
/// allowed client, which is rarely inside the ranges itself), or one the
/// pod started. A function of its own, as [`error_about_pods_flow`] is.
#[inline(never)]
pub fn error_within_ranges<C: Frame>(ctx: &C, p: &Packet, slot: u16, in_ranges: impl Fn(&IpKey) -> bool) -> bool {
    if !is_icmp(p) {
        return false;
    }
    if !byte(ctx, p.l4 + ICMP_TYPE).is_some_and(|t| is_icmp_error(p, t)) {
        return false;
    }
    let Some(q) = quoted_flow(ctx, p) else {
        return false;
    };
    in_ranges(&q.dst) || quoted_own_flow(p, &q, slot)
}

/// Is `p` (toward the pod `p.dst`) a reply within a flow the pod started?
#[inline(never)]
pub fn reply_to_own_flow<C: Frame>(ctx: &C, p: &Packet, slot: u16) -> bool {
    match flow_ports(ctx, p, false) {
        Some((peer_port, pod_port)) => known_flow(&key(p.dst, p.src, p.proto, pod_port, peer_port), slot),
        None => false,
    }
}

#[inline(always)]
fn frag_key(p: &Packet) -> FragKey {
    FragKey {
        src: p.src,
        dst: p.dst,
        id: p.frag_id,
        proto: p.proto,
        _pad: 0,
        _pad2: 0,
    }
}

/// What [`admit`] decided of a packet it does not drop.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admitted,
    /// An ICMP error toward a pod that does not take all ICMP: admitted
    /// only if [`admit_error`] finds it is about a flow of the pod's. Asked
    /// apart, by the caller: the two checks' frames are then never on the
    /// stack together (the BPF stack holds 512 bytes for a whole call chain).
    IfAboutPodsFlow,
}

/// Decides a packet toward a filtered pod (`p.dst` is the pod IP).
/// `routed`: the program itself forwards it (the fast path), before its
/// hop limit is decremented; else its hop limit is as the pod gets it.
#[inline(always)]
pub fn admit<C: Frame>(
    ctx: &C,
    p: &Packet,
    allow_icmp: bool,
    slot: u16,
    routed: bool,
) -> Result<Admission, DropReason> {
    if p.later_fragment {
        // Only fragments of a datagram whose first fragment was admitted.
        return if FRAGS.get_ptr(&frag_key(p)).is_some() {
            Ok(Admission::Admitted)
        } else {
            Err(DropReason::FilteredFragment)
        };
    }
    let verdict = admit_first(ctx, p, allow_icmp, slot, routed);
    if verdict == Ok(Admission::Admitted) {
        admitted_first(p);
    }
    verdict
}

/// The second half of [`admit`] for an ICMP error it left open
/// ([`Admission::IfAboutPodsFlow`]).
#[inline(always)]
pub fn admit_error<C: Frame>(ctx: &C, p: &Packet, slot: u16) -> Result<(), DropReason> {
    if !error_about_pods_flow(ctx, p, slot) {
        return Err(DropReason::FilteredIcmp);
    }
    admitted_first(p);
    Ok(())
}

/// A first fragment admitted: its later fragments will be too.
#[inline(always)]
fn admitted_first(p: &Packet) {
    if p.fragment {
        let _ = FRAGS.insert(&frag_key(p), &0, 0);
    }
}

#[inline(always)]
fn admit_first<C: Frame>(
    ctx: &C,
    p: &Packet,
    allow_icmp: bool,
    slot: u16,
    routed: bool,
) -> Result<Admission, DropReason> {
    if has_ports(p.proto) {
        let Some((sport, dport)) = ports(ctx, p) else {
            return Err(DropReason::FilteredProtocol);
        };
        let listed = PortKey {
            pod: p.dst,
            proto: p.proto,
            _pad: 0,
            port: dport,
        };
        if ALLOWED_PORTS.get_ptr(&listed).is_some()
            || known_flow(&key(p.dst, p.src, p.proto, dport, sport), slot)
        {
            return Ok(Admission::Admitted);
        }
        return Err(DropReason::FilteredPort);
    }
    if is_icmp(p) {
        if allow_icmp {
            return Ok(Admission::Admitted);
        }
        let Some(icmp_type) = byte(ctx, p.l4 + ICMP_TYPE) else {
            return Err(DropReason::FilteredIcmp);
        };
        // Neighbour discovery on the pod's own link passes, as ARP does: a
        // router on the pod's segment (not the node) resolves and probes
        // the pod's address with it, and answers the pod's own questions
        // with it, unicast. Hop limit 255: never routed (RFC 4861 has the
        // pod discard any other), so it opens nothing beyond the link.
        if p.v6
            && !routed
            && (ND_FIRST..=ND_LAST).contains(&icmp_type)
            && byte(ctx, p.l3 + IP6_HOP_LIMIT) == Some(255)
        {
            return Ok(Admission::Admitted);
        }
        let (_, reply) = echo_types(p);
        if icmp_type == reply {
            if let Some(id) = be16(ctx, p.l4 + ICMP_ECHO_ID) {
                if known_flow(&key(p.dst, p.src, p.proto, id, 0), slot) {
                    return Ok(Admission::Admitted);
                }
            }
        } else if is_icmp_error(p, icmp_type) {
            return Ok(Admission::IfAboutPodsFlow);
        }
        return Err(DropReason::FilteredIcmp);
    }
    Err(DropReason::FilteredProtocol)
}
