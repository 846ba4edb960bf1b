//! The TC programs on crafted packets, run by the kernel with
//! BPF_PROG_TEST_RUN: every branch of `cozy_ingress` and `cozy_egress`
//! (rewrites both ways for each protocol, filter allow and drop, flows,
//! ICMP errors, fragments, options, VLAN, truncated and malformed frames).
//! Checksums of the output are verified independently. Needs root.
mod packets;

use aya::{
    maps::HashMap,
    programs::{SchedClassifier, TestRun, TestRunOptions},
    Ebpf,
};
use cozy_proxy_common::{maps as names, FilterPolicy, IpKey, PortKey};
use packets::{inspect, Spec, GRE, ICMP, ICMPV6, TCP, UDP};
use std::net::IpAddr;
use std::sync::Mutex;

const PASS: u32 = u32::MAX; // TC_ACT_UNSPEC (-1)
const DROP: u32 = 2; // TC_ACT_SHOT

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

fn key(a: &IpAddr) -> IpKey {
    match a {
        IpAddr::V4(v) => IpKey::v4(v.octets()),
        IpAddr::V6(v) => IpKey::v6(v.octets()),
    }
}

/// One family's addresses: ext, a passthrough pair, a filtered pair, an
/// unmapped LB IP.
struct Net {
    ext: IpAddr,
    lb: IpAddr,
    pod: IpAddr,
    flb: IpAddr,
    fpod: IpAddr,
    unmapped: IpAddr,
}

fn nets() -> [Net; 2] {
    [
        Net {
            ext: ip("198.51.100.1"),
            lb: ip("203.0.113.10"),
            pod: ip("192.0.2.11"),
            flb: ip("203.0.113.20"),
            fpod: ip("192.0.2.12"),
            unmapped: ip("203.0.113.99"),
        },
        Net {
            ext: ip("2001:db8:100::1"),
            lb: ip("2001:db8:203::10"),
            pod: ip("2001:db8:2::11"),
            flb: ip("2001:db8:203::20"),
            fpod: ip("2001:db8:2::12"),
            unmapped: ip("2001:db8:203::99"),
        },
    ]
}

/// The object, loaded once with fresh (unpinned) maps holding both nets.
static EBPF: Mutex<Option<Ebpf>> = Mutex::new(None);

fn with_ebpf<T>(f: impl FnOnce(&mut Ebpf) -> T) -> T {
    let mut guard = EBPF.lock().unwrap_or_else(|e| e.into_inner());
    let ebpf = guard.get_or_insert_with(|| {
        let mut ebpf = Ebpf::load(cozy_proxy::ebpf::OBJECT).expect("load object");
        for name in ["cozy_ingress", "cozy_egress"] {
            let prog: &mut SchedClassifier =
                ebpf.program_mut(name).expect(name).try_into().expect("tc");
            prog.load().expect("verifier accepts");
        }
        fill_maps(&mut ebpf);
        ebpf
    });
    f(ebpf)
}

fn fill_maps(ebpf: &mut Ebpf) {
    for n in nets() {
        let mut svc_pod: HashMap<_, IpKey, IpKey> = ebpf
            .map_mut(names::SVC_POD)
            .expect("map")
            .try_into()
            .expect("hash");
        svc_pod.insert(key(&n.lb), key(&n.pod), 0).expect("insert");
        svc_pod
            .insert(key(&n.flb), key(&n.fpod), 0)
            .expect("insert");
        let mut pod_svc: HashMap<_, IpKey, IpKey> = ebpf
            .map_mut(names::POD_SVC)
            .expect("map")
            .try_into()
            .expect("hash");
        pod_svc.insert(key(&n.pod), key(&n.lb), 0).expect("insert");
        pod_svc
            .insert(key(&n.fpod), key(&n.flb), 0)
            .expect("insert");
        let mut filtered: HashMap<_, IpKey, FilterPolicy> = ebpf
            .map_mut(names::FILTERED_PODS)
            .expect("map")
            .try_into()
            .expect("hash");
        filtered
            .insert(key(&n.fpod), FilterPolicy::default(), 0)
            .expect("insert");
        let mut ports: HashMap<_, PortKey, u8> = ebpf
            .map_mut(names::ALLOWED_PORTS)
            .expect("map")
            .try_into()
            .expect("hash");
        for (proto, port) in [(TCP, 22u16), (UDP, 53)] {
            let k = PortKey {
                pod: key(&n.fpod),
                proto,
                _pad: 0,
                port,
            };
            ports.insert(k, 1, 0).expect("insert");
        }
        let mut unmapped: HashMap<_, IpKey, u8> = ebpf
            .map_mut(names::UNMAPPED_LBS)
            .expect("map")
            .try_into()
            .expect("hash");
        unmapped.insert(key(&n.unmapped), 1, 0).expect("insert");
    }
}

/// `__sk_buff` up to `ifindex`, with `ingress_ifindex` (offset 36) set:
/// non-zero means the packet was received (forwarded), zero locally sent.
fn skb_ctx(ingress_ifindex: u32) -> Vec<u8> {
    let mut ctx = vec![0u8; 44];
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx
}

/// Runs a program on `frame`; returns (verdict, frame after).
fn run_prog(prog: &str, frame: &[u8], ingress_ifindex: u32) -> (u32, Vec<u8>) {
    with_ebpf(|ebpf| {
        let p: &SchedClassifier = ebpf.program(prog).expect(prog).try_into().expect("tc");
        let mut out = vec![0u8; frame.len() + 256];
        let ctx = skb_ctx(ingress_ifindex);
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.ctx_in = Some(&ctx);
        let r = p.test_run(opts).expect("BPF_PROG_TEST_RUN");
        out.truncate(r.data_size_out as usize);
        (r.return_value, out)
    })
}

/// Toward pods (TC egress), as forwarded traffic.
fn egress(frame: &[u8]) -> (u32, Vec<u8>) {
    run_prog("cozy_egress", frame, 1)
}

/// From pods or the outside (TC ingress).
fn ingress(frame: &[u8]) -> (u32, Vec<u8>) {
    run_prog("cozy_ingress", frame, 1)
}

fn assert_rewritten(out: &[u8], src: IpAddr, dst: IpAddr, what: &str) {
    let seen = inspect(out);
    assert_eq!((seen.src, seen.dst), (src, dst), "{what}: addresses");
    assert!(seen.ip_checksum_ok, "{what}: IPv4 header checksum");
    assert_ne!(
        seen.l4_checksum_ok,
        Some(false),
        "{what}: L4 checksum {:?}",
        seen.l4_checksum
    );
}

#[test]
fn ingress_rewrite_toward_the_pod_for_every_protocol() {
    for n in nets() {
        let icmp = if n.ext.is_ipv4() { ICMP } else { ICMPV6 };
        for proto in [TCP, UDP, icmp, GRE] {
            let frame = Spec::new(n.ext, n.lb, proto).build();
            let (verdict, out) = egress(&frame);
            assert_eq!(verdict, PASS, "proto {proto} {}", n.lb);
            assert_rewritten(&out, n.ext, n.pod, &format!("proto {proto} to {}", n.lb));
            if proto != GRE {
                assert!(
                    inspect(&out).l4_checksum_ok.is_some(),
                    "proto {proto}: checksum checked"
                );
            }
        }
    }
}

#[test]
fn egress_rewrite_from_the_pod_for_every_protocol() {
    for n in nets() {
        let icmp = if n.ext.is_ipv4() { ICMP } else { ICMPV6 };
        for proto in [TCP, UDP, icmp, GRE] {
            let frame = Spec::new(n.pod, n.ext, proto).build();
            let (verdict, out) = ingress(&frame);
            assert_eq!(verdict, PASS);
            assert_rewritten(&out, n.lb, n.ext, &format!("proto {proto} from {}", n.pod));
        }
    }
}

#[test]
fn untouched_traffic_passes_unchanged() {
    for n in nets() {
        for (prog, frame) in [
            ("cozy_egress", Spec::new(n.ext, n.ext, TCP).build()),
            ("cozy_ingress", Spec::new(n.ext, n.lb, TCP).build()),
            ("cozy_ingress", Spec::new(n.ext, n.pod, UDP).build()),
        ] {
            let (verdict, out) = run_prog(prog, &frame, 1);
            assert_eq!(verdict, PASS);
            assert_eq!(out, frame, "{prog} changed a packet it does not own");
        }
    }
    // Not IP (ARP).
    let mut arp = vec![0xffu8; 12];
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.extend_from_slice(&[0u8; 28]);
    for prog in ["cozy_ingress", "cozy_egress"] {
        let (verdict, out) = run_prog(prog, &arp, 1);
        assert_eq!((verdict, out), (PASS, arp.clone()));
    }
}

#[test]
fn ipv4_udp_without_checksum_keeps_zero() {
    let n = &nets()[0];
    let mut spec = Spec::new(n.ext, n.lb, UDP);
    spec.udp_no_checksum = true;
    let (verdict, out) = egress(&spec.build());
    assert_eq!(verdict, PASS);
    let seen = inspect(&out);
    assert_eq!(seen.dst, n.pod);
    assert_eq!(
        seen.l4_checksum,
        Some(0),
        "a zero UDP checksum must stay zero"
    );
    assert!(seen.ip_checksum_ok);
}

#[test]
fn unmapped_lb_ip_is_dropped() {
    for n in nets() {
        let (verdict, _) = ingress(&Spec::new(n.ext, n.unmapped, TCP).build());
        assert_eq!(verdict, DROP, "{}", n.unmapped);
    }
}

#[test]
fn port_filter_lets_listed_ports_in_and_drops_the_rest() {
    for n in nets() {
        for (proto, port, want) in [
            (TCP, 22, PASS),
            (UDP, 53, PASS),
            (TCP, 8080, DROP),
            (UDP, 5353, DROP),
            (TCP, 53, DROP),
        ] {
            let frame = Spec::new(n.ext, n.flb, proto).ports(50000, port).build();
            let (verdict, out) = egress(&frame);
            assert_eq!(verdict, want, "{proto}/{port} to {}", n.flb);
            if want == PASS {
                assert_rewritten(&out, n.ext, n.fpod, "filtered pass");
            }
        }
        // Other protocols and ICMP (no allowICMP) are dropped.
        let icmp = if n.ext.is_ipv4() { ICMP } else { ICMPV6 };
        for proto in [GRE, icmp] {
            let (verdict, _) = egress(&Spec::new(n.ext, n.flb, proto).build());
            assert_eq!(verdict, DROP, "proto {proto}");
        }
        // Straight to the pod IP: filtered too.
        let (verdict, _) = egress(&Spec::new(n.ext, n.fpod, TCP).ports(1, 8080).build());
        assert_eq!(verdict, DROP);
        // The node's own traffic (not forwarded) is not filtered.
        let (verdict, _) = run_prog(
            "cozy_egress",
            &Spec::new(n.ext, n.fpod, TCP).ports(1, 8080).build(),
            0,
        );
        assert_eq!(verdict, PASS, "node-originated traffic");
    }
}

#[test]
fn replies_to_flows_the_filtered_pod_started_pass() {
    for n in nets() {
        let icmp = if n.ext.is_ipv4() { ICMP } else { ICMPV6 };
        // Reply before the pod sent anything: dropped.
        let reply = Spec::new(n.ext, n.flb, TCP).ports(443, 41000).build();
        assert_eq!(egress(&reply).0, DROP, "unsolicited");
        // The pod opens the flow (recorded as it leaves)...
        let (verdict, out) = ingress(&Spec::new(n.fpod, n.ext, TCP).ports(41000, 443).build());
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.flb, n.ext, "pod flow out");
        // ...then the reply passes, and another peer port does not.
        assert_eq!(egress(&reply).0, PASS, "reply");
        assert_eq!(
            egress(&Spec::new(n.ext, n.flb, TCP).ports(444, 41000).build()).0,
            DROP
        );
        // ICMP echo: the reply to the pod's own ping passes.
        let mut ping = Spec::new(n.fpod, n.ext, icmp);
        ping.sport = 777;
        assert_eq!(ingress(&ping.build()).0, PASS);
        let mut pong = Spec::new(n.ext, n.flb, icmp);
        pong.icmp_type = Some(if icmp == ICMP { 0 } else { 129 });
        pong.sport = 777;
        assert_eq!(egress(&pong.build()).0, PASS, "echo reply");
        pong.sport = 778;
        assert_eq!(egress(&pong.build()).0, DROP, "echo reply to another id");
    }
}

/// An ICMP error from `n.ext` quoting the datagram LB:sport -> ext:dport.
fn icmp_error(n: &Net, sport: u16, dport: u16) -> Vec<u8> {
    let quoted = Spec::new(n.flb, n.ext, UDP).ports(sport, dport).build();
    let quoted_ip = quoted[14..].to_vec();
    let v4 = n.ext.is_ipv4();
    let mut err = Spec::new(n.ext, n.flb, if v4 { ICMP } else { ICMPV6 });
    err.icmp_type = Some(if v4 { 3 } else { 1 }); // unreachable
    err.sport = 0;
    err.payload = quoted_ip;
    err.build()
}

#[test]
fn icmp_errors_about_the_pods_own_flows_pass() {
    for n in nets() {
        assert_eq!(
            egress(&icmp_error(&n, 42000, 53)).0,
            DROP,
            "error about an unknown flow"
        );
        assert_eq!(
            ingress(&Spec::new(n.fpod, n.ext, UDP).ports(42000, 53).build()).0,
            PASS
        );
        let (verdict, out) = egress(&icmp_error(&n, 42000, 53));
        assert_eq!(verdict, PASS, "error about the pod's flow");
        assert_rewritten(&out, n.ext, n.fpod, "ICMP error");
    }
}

#[test]
fn fragments_follow_their_first_fragment() {
    for n in nets() {
        let frag = |dport: u16, id: u32, offset: u16, more: bool| {
            let mut s = Spec::new(n.ext, n.flb, UDP).ports(50000, dport);
            s.fragment = Some((id, offset, more));
            s.build()
        };
        // Allowed port: first and later fragments pass.
        assert_eq!(egress(&frag(53, 7, 0, true)).0, PASS);
        let (verdict, out) = egress(&frag(53, 7, 32, false));
        assert_eq!(verdict, PASS, "later fragment of an admitted datagram");
        assert_eq!(inspect(&out).dst, n.fpod);
        assert!(inspect(&out).ip_checksum_ok);
        // Unlisted port: the first is dropped and a later one cannot sneak by.
        assert_eq!(egress(&frag(8080, 8, 0, true)).0, DROP);
        assert_eq!(
            egress(&frag(8080, 8, 32, false)).0,
            DROP,
            "later fragment of a dropped datagram"
        );
        assert_eq!(
            egress(&frag(53, 9, 64, false)).0,
            DROP,
            "later fragment without a first"
        );
        // Passthrough: a later fragment is rewritten, its payload untouched.
        let mut s = Spec::new(n.ext, n.lb, UDP);
        s.fragment = Some((10, 64, false));
        let frame = s.build();
        let (verdict, out) = egress(&frame);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.ext, n.pod, "later fragment");
        assert_eq!(
            out[out.len() - s.payload.len()..],
            frame[frame.len() - s.payload.len()..]
        );
    }
}

#[test]
fn ip_options_extension_headers_and_vlan_tags() {
    for n in nets() {
        for (options, vlan) in [(true, false), (false, true), (true, true)] {
            let mut s = Spec::new(n.ext, n.lb, TCP);
            s.options = options;
            s.vlan = vlan;
            let (verdict, out) = egress(&s.build());
            assert_eq!(verdict, PASS);
            assert_rewritten(
                &out,
                n.ext,
                n.pod,
                &format!("options {options} vlan {vlan}"),
            );
            assert_eq!(inspect(&out).l4_checksum_ok, Some(true));
        }
    }
}

#[test]
fn neighbour_discovery_is_not_translated() {
    let n = &nets()[1];
    for t in [133u8, 135, 136] {
        let mut s = Spec::new(n.pod, n.ext, ICMPV6);
        s.icmp_type = Some(t);
        let frame = s.build();
        let (verdict, out) = ingress(&frame);
        assert_eq!((verdict, out), (PASS, frame), "ND type {t}");
    }
}

#[test]
fn truncated_and_malformed_frames_never_break_the_programs() {
    for n in nets() {
        // BPF_PROG_TEST_RUN itself refuses frames whose fixed IP header is
        // cut (EINVAL), so the cuts start right after it: inside IPv6
        // extension headers, inside the L4 header, before the checksum.
        let ip_end = if n.ext.is_ipv4() { 34 } else { 54 };
        for options in [false, true] {
            let mut spec = Spec::new(n.ext, n.lb, TCP);
            spec.options = options;
            let full = spec.build();
            for cut in ip_end..full.len() {
                let frame = &full[..cut];
                for prog in ["cozy_ingress", "cozy_egress"] {
                    let (verdict, out) = run_prog(prog, frame, 1);
                    assert_eq!(verdict, PASS, "{prog} on {cut} bytes");
                    assert_eq!(out.len(), frame.len(), "{prog} changed the length");
                }
            }
        }
        // IPv4 with a header length below 20, and a wrong version.
        let mut bad = Spec::new(n.ext, n.lb, TCP).build();
        bad[14] = if n.ext.is_ipv4() { 0x44 } else { 0x40 };
        assert_eq!(
            egress(&bad),
            (PASS, bad.clone()),
            "malformed header left alone"
        );
    }
}
