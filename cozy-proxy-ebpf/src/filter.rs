//! The port filter for pods whose Service has `wholeIP: "false"`, and the
//! memory of the flows such pods start (so their replies pass).
use crate::hdr::*;
use crate::maps::{ALLOWED_PORTS, FLOWS, FRAGS};
use crate::parse::{byte, port, Packet, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP};
use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use cozy_proxy_common::{DropReason, FilterPolicy, FlowKey, FragKey, IpKey, PortKey};

fn has_ports(proto: u8) -> bool {
    matches!(proto, PROTO_TCP | PROTO_UDP | PROTO_SCTP)
}

#[inline(always)]
fn flow(pod: IpKey, peer: IpKey, proto: u8, pod_port: u16, peer_port: u16) -> FlowKey {
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

#[inline(always)]
fn echo_types(p: &Packet) -> (u8, u8) {
    // (request, reply)
    if p.v6 {
        (128, 129)
    } else {
        (8, 0)
    }
}

/// Remembers a flow a filtered pod sends (before its source is rewritten).
#[inline(always)]
pub fn remember_outbound(ctx: &TcContext, p: &Packet) {
    if p.later_fragment {
        return;
    }
    let key = if has_ports(p.proto) {
        match (port(ctx, p.l4 + L4_SPORT), port(ctx, p.l4 + L4_DPORT)) {
            (Some(sport), Some(dport)) => flow(p.src, p.dst, p.proto, sport, dport),
            _ => return,
        }
    } else if p.proto == PROTO_ICMP || p.proto == PROTO_ICMPV6 {
        let (request, _) = echo_types(p);
        if byte(ctx, p.l4 + ICMP_TYPE) != Some(request) {
            return;
        }
        match port(ctx, p.l4 + ICMP_ECHO_ID) {
            Some(id) => flow(p.src, p.dst, p.proto, id, 0),
            None => return,
        }
    } else {
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let _ = FLOWS.insert(key, now, 0);
}

#[inline(always)]
fn known_flow(key: &FlowKey) -> bool {
    FLOWS.get_ptr(key).is_some()
}

/// Is an ICMP error about a flow `pod` started? The quoted header is the
/// packet as it left: source the LB IP, destination the peer.
#[inline(always)]
fn error_about_own_flow(ctx: &TcContext, p: &Packet) -> bool {
    let inner = p.l4 + ICMP_HLEN;
    let (proto, peer, ports_at) = if p.v6 {
        let Ok(peer) = ctx.load::<[u8; 16]>(inner + IP6_DADDR) else {
            return false;
        };
        (byte(ctx, inner + IP6_NEXT), IpKey::v6(peer), inner + IP6_HLEN)
    } else {
        let Some(ver_ihl) = byte(ctx, inner + IP4_VER_IHL) else {
            return false;
        };
        let Ok(peer) = ctx.load::<[u8; 4]>(inner + IP4_DADDR) else {
            return false;
        };
        (byte(ctx, inner + IP4_PROTO), IpKey::v4(peer), inner + ((ver_ihl & 0x0f) as usize) * 4)
    };
    let Some(proto) = proto else { return false };
    if !has_ports(proto) {
        return false;
    }
    match (port(ctx, ports_at + L4_SPORT), port(ctx, ports_at + L4_DPORT)) {
        (Some(sport), Some(dport)) => known_flow(&flow(p.dst, peer, proto, sport, dport)),
        _ => false,
    }
}

#[inline(always)]
fn is_icmp_error(p: &Packet, icmp_type: u8) -> bool {
    if p.v6 {
        (1..=4).contains(&icmp_type)
    } else {
        matches!(icmp_type, 3 | 4 | 11 | 12)
    }
}

#[inline(always)]
fn frag_key(p: &Packet) -> FragKey {
    FragKey {
        src: p.src,
        dst: p.dst,
        id: p.frag_id,
        proto: p.proto,
        _pad: [0; 3],
    }
}

/// Decides a packet toward a filtered pod (`p.dst` is the pod IP).
#[inline(always)]
pub fn admit(ctx: &TcContext, p: &Packet, policy: &FilterPolicy) -> Result<(), DropReason> {
    if p.later_fragment {
        // Only fragments of a datagram whose first fragment was admitted.
        return if FRAGS.get_ptr(&frag_key(p)).is_some() {
            Ok(())
        } else {
            Err(DropReason::FilteredFragment)
        };
    }
    let verdict = admit_first(ctx, p, policy);
    if verdict.is_ok() && p.fragment {
        let _ = FRAGS.insert(frag_key(p), 0, 0);
    }
    verdict
}

#[inline(always)]
fn admit_first(ctx: &TcContext, p: &Packet, policy: &FilterPolicy) -> Result<(), DropReason> {
    if has_ports(p.proto) {
        let (Some(sport), Some(dport)) = (port(ctx, p.l4 + L4_SPORT), port(ctx, p.l4 + L4_DPORT)) else {
            return Err(DropReason::FilteredPort);
        };
        let listed = PortKey {
            pod: p.dst,
            proto: p.proto,
            _pad: 0,
            port: dport,
        };
        if ALLOWED_PORTS.get_ptr(&listed).is_some() || known_flow(&flow(p.dst, p.src, p.proto, dport, sport)) {
            return Ok(());
        }
        return Err(DropReason::FilteredPort);
    }
    if p.proto == PROTO_ICMP || p.proto == PROTO_ICMPV6 {
        if policy.allow_icmp != 0 {
            return Ok(());
        }
        let Some(icmp_type) = byte(ctx, p.l4 + ICMP_TYPE) else {
            return Err(DropReason::FilteredIcmp);
        };
        let (_, reply) = echo_types(p);
        if icmp_type == reply {
            if let Some(id) = port(ctx, p.l4 + ICMP_ECHO_ID) {
                if known_flow(&flow(p.dst, p.src, p.proto, id, 0)) {
                    return Ok(());
                }
            }
        } else if is_icmp_error(p, icmp_type) && error_about_own_flow(ctx, p) {
            return Ok(());
        }
        return Err(DropReason::FilteredIcmp);
    }
    Err(DropReason::FilteredProtocol)
}
