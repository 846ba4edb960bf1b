//! docs/traffic.md's rows, the port filter, the source ranges and the
//! anti-spoofing rules, traced through the rules without root, on both
//! families.
use super::*;
use crate::datapath::AllowedPort;
use crate::model::{Cidr, IpRange};
use crate::nft::schema::{IPV4, IPV6};

const TCP: u8 = 6;
const UDP: u8 = 17;

/// One family's addresses.
struct Net {
    layout: &'static Layout,
    /// Passthrough: LB -> pod.
    lb: &'static str,
    pod: &'static str,
    /// Port filter (tcp/22 and ICMP), source range `allowed`.
    filtered_lb: &'static str,
    filtered_pod: &'static str,
    unmapped_lb: &'static str,
    /// A pod of the cluster, not mapped.
    other_pod: &'static str,
    cluster: &'static str,
    outside: &'static str,
    allowed: &'static str,
    allowed_client: &'static str,
    icmp: u8,
}

const V4: Net = Net {
    layout: &IPV4,
    lb: "203.0.113.10",
    pod: "192.0.2.11",
    filtered_lb: "203.0.113.20",
    filtered_pod: "192.0.2.21",
    unmapped_lb: "203.0.113.30",
    other_pod: "192.0.2.50",
    cluster: "192.0.2.0/24",
    outside: "203.0.113.99",
    allowed: "198.51.100.0/24",
    allowed_client: "198.51.100.7",
    icmp: 1,
};

const V6: Net = Net {
    layout: &IPV6,
    lb: "2001:db8:203::10",
    pod: "2001:db8:2::11",
    filtered_lb: "2001:db8:203::20",
    filtered_pod: "2001:db8:2::21",
    unmapped_lb: "2001:db8:203::30",
    other_pod: "2001:db8:2::50",
    cluster: "2001:db8:2::/64",
    outside: "2001:db8:203::99",
    allowed: "2001:db8:198::/48",
    allowed_client: "2001:db8:198::7",
    icmp: 58,
};

/// The pods' interface (their guards' entry).
const POD_LINK: u32 = 7;
const UPLINK: u32 = 2;

fn a(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn state(n: &Net) -> DatapathState {
    let mut s = DatapathState::default();
    for (lb, pod) in [(n.lb, n.pod), (n.filtered_lb, n.filtered_pod)] {
        s.svc_pod.insert(a(lb), a(pod));
        s.pod_svc.insert(a(pod), a(lb));
        s.guard.insert(a(pod), POD_LINK);
        s.guard.insert(a(lb), 0);
    }
    let fp = a(n.filtered_pod);
    s.filtered_pods.insert(fp);
    s.icmp_allowed_pods.insert(fp);
    s.allowed_ports.insert(AllowedPort {
        pod: fp,
        proto: TCP,
        port: 22,
    });
    s.ranged_lbs.insert(a(n.filtered_lb));
    let allowed: Cidr = n.allowed.parse().expect("range");
    s.source_ranges
        .insert((a(n.filtered_lb), IpRange::of(&allowed)));
    s.unmapped_lbs.insert(a(n.unmapped_lb));
    s.guard.insert(a(n.unmapped_lb), 0);
    let cluster: Cidr = n.cluster.parse().expect("range");
    s.cluster.insert(IpRange::of(&cluster));
    s
}

/// A row: a packet at prerouting, what becomes of it.
struct Row {
    what: &'static str,
    packet: Packet,
    /// `None`: dropped; else the addresses it leaves the hook with.
    after: Option<(String, String)>,
}

fn rows(n: &Net) -> Vec<Row> {
    let pass = |src: &str, dst: &str| Some((src.to_string(), dst.to_string()));
    let established = |mut p: Packet| {
        p.ct_state = 2;
        p
    };
    vec![
        Row {
            what: "outside -> LB: rewritten to the pod, any port",
            packet: packet(n.outside, n.lb, UDP, 4000, 5353, UPLINK),
            after: pass(n.outside, n.pod),
        },
        Row {
            what: "pod -> outside: leaves with its LB IP",
            packet: packet(n.pod, n.outside, TCP, 4000, 443, POD_LINK),
            after: pass(n.lb, n.outside),
        },
        Row {
            what: "pod -> another pod: keeps its own address",
            packet: packet(n.pod, n.other_pod, TCP, 4000, 80, POD_LINK),
            after: pass(n.pod, n.other_pod),
        },
        Row {
            what: "a forged pod source from another link: dropped",
            packet: packet(n.pod, n.outside, TCP, 4000, 443, UPLINK),
            after: None,
        },
        Row {
            what: "a forged LB source: dropped (an LB IP arrives on no link)",
            packet: packet(n.lb, n.other_pod, TCP, 4000, 80, UPLINK),
            after: None,
        },
        Row {
            what: "in-cluster client -> LB: not rewritten at prerouting's filter, dnat to the pod",
            packet: packet(n.other_pod, n.lb, TCP, 4000, 80, POD_LINK),
            after: pass(n.other_pod, n.pod),
        },
        Row {
            what: "outside -> unmapped LB IP: dropped",
            packet: packet(n.outside, n.unmapped_lb, TCP, 4000, 80, UPLINK),
            after: None,
        },
        Row {
            what: "allowed source -> filtered LB, listed port: passes",
            packet: packet(n.allowed_client, n.filtered_lb, TCP, 4000, 22, UPLINK),
            after: pass(n.allowed_client, n.filtered_pod),
        },
        Row {
            what: "allowed source -> filtered LB, other port: dropped",
            packet: packet(n.allowed_client, n.filtered_lb, TCP, 4000, 80, UPLINK),
            after: None,
        },
        Row {
            what: "allowed source -> filtered LB, same port number over UDP: dropped",
            packet: packet(n.allowed_client, n.filtered_lb, UDP, 4000, 22, UPLINK),
            after: None,
        },
        Row {
            what: "allowed source -> filtered LB, ICMP (allowed): passes",
            packet: packet(n.allowed_client, n.filtered_lb, n.icmp, 0x8000, 0, UPLINK),
            after: pass(n.allowed_client, n.filtered_pod),
        },
        Row {
            what: "source outside the ranges -> filtered LB, listed port: dropped",
            packet: packet(n.outside, n.filtered_lb, TCP, 4000, 22, UPLINK),
            after: None,
        },
        Row {
            what: "reply to the filtered pod's own flow, unlisted port: passes",
            packet: established(packet(n.outside, n.filtered_lb, TCP, 443, 4000, UPLINK)),
            after: pass(n.outside, n.filtered_pod),
        },
    ]
}

fn trace_rows(n: &Net) {
    let sets = Sets::of(&state(n), n.layout);
    let mut failed = Vec::new();
    for mut row in rows(n) {
        let verdict = hook(n.layout, NF_INET_PRE_ROUTING, &sets, &mut row.packet);
        let got = match verdict {
            Verdict::Accept => Some((
                row.packet.saddr().to_string(),
                row.packet.daddr().to_string(),
            )),
            Verdict::Drop(_) => None,
        };
        if got != row.after {
            failed.push(format!(
                "{}: got {got:?} ({verdict:?}), want {:?}",
                row.what, row.after
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{}:\n{}",
        n.layout.name,
        failed.join("\n")
    );
}

#[test]
fn traffic_rows_traced_through_the_ipv4_rules() {
    trace_rows(&V4);
}

#[test]
fn traffic_rows_traced_through_the_ipv6_rules() {
    trace_rows(&V6);
}

/// An ICMP error from `router` to `to`, quoting a packet from `quoted_src`
/// to `quoted_dst` (type 3 or 1: destination unreachable).
fn icmp_error(n: &Net, router: &str, to: &str, quoted_src: &str, quoted_dst: &str) -> Packet {
    let mut p = packet(router, to, n.icmp, 0, 0, UPLINK);
    p.th[0] = if n.icmp == 1 { 3 } else { 1 };
    let quoted = packet(quoted_src, quoted_dst, UDP, 4000, 53, POD_LINK);
    p.th.extend(quoted.nh);
    p.th.extend(quoted.th);
    p.ct_state = 4;
    p
}

fn quoted_source(n: &Net, p: &Packet) -> IpAddr {
    let at = 8 + n.layout.saddr_offset as usize;
    let len = n.layout.addr_len as usize;
    n.layout
        .addr_from_bytes(&p.th[at..at + len])
        .expect("quoted address")
}

#[test]
fn an_icmp_error_about_a_pods_flow_reaches_the_pod_quoting_it() {
    for n in [&V4, &V6] {
        let sets = Sets::of(&state(n), n.layout);
        let mut p = icmp_error(n, n.outside, n.lb, n.lb, n.allowed_client);
        let verdict = hook(n.layout, NF_INET_PRE_ROUTING, &sets, &mut p);
        assert_eq!(verdict, Verdict::Accept, "{}", n.layout.name);
        assert_eq!(p.daddr(), a(n.pod), "{}: outer destination", n.layout.name);
        assert_eq!(
            quoted_source(n, &p),
            a(n.pod),
            "{}: quoted source",
            n.layout.name
        );
    }
}
