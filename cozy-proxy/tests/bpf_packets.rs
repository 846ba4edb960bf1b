//! The TC programs on crafted packets, run by the kernel with
//! BPF_PROG_TEST_RUN: every branch of `cozy_ingress` and `cozy_egress`
//! (rewrites both ways for each protocol, filter allow and drop, flows,
//! ICMP errors and their quoted headers, fragments, options, VLAN,
//! anti-spoofing, in-cluster traffic, client-side translation, source
//! ranges, truncated and malformed frames). The maps are filled by the
//! production code (`EbpfKernel::apply`) from a `DatapathState`; checksums
//! of the output are verified independently. The XDP program is held to
//! the TC programs' decisions (xdp.rs). Needs root.
use aya::maps::{HashMap as AyaHashMap, Map, MapData};
use cozy_proxy::{
    datapath::{AllowedPort, DatapathState, Kernel},
    model::{merge_ranges, Cidr},
};
use cozy_proxy_common::{
    limits::REV_PER_SOURCE, maps as names, FlowKey, FlowState, IpKey, RevKey, RevValue,
};
use cozy_proxy_testkit::{
    packets::bpf::{apply_state, Ifaces, World, CLIENTS, DROP, PASS, REDIRECT},
    packets::frames::{arp_request, inspect, neighbour_message, Spec, GRE, ICMP, ICMPV6, TCP, UDP},
};
use std::{net::IpAddr, sync::Mutex};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

/// One family's addresses.
#[derive(Clone)]
struct Net {
    ext: IpAddr,
    /// This node's own address (on the uplink).
    node: IpAddr,
    /// Passthrough mapping, pod on interface `pod`.
    lb: IpAddr,
    pod: IpAddr,
    /// Port filter (TCP 22, UDP 53), pod on interface `fpod`.
    flb: IpAddr,
    fpod: IpAddr,
    unmapped: IpAddr,
    /// A mapping whose pod is on another node, reached through `peer`.
    rlb: IpAddr,
    rpod: IpAddr,
    /// loadBalancerSourceRanges: only `allowed` (a /25) reaches `spod`.
    slb: IpAddr,
    spod: IpAddr,
    allowed: IpAddr,
    /// An unmapped pod on this node (an in-cluster client), on `client`.
    client: IpAddr,
    /// The pod network (in-cluster).
    pods: &'static str,
    sources: &'static str,
}

fn nets() -> [Net; 2] {
    [
        Net {
            ext: ip("198.51.100.200"),
            node: ip("198.51.100.2"),
            lb: ip("203.0.113.10"),
            pod: ip("192.0.2.11"),
            flb: ip("203.0.113.20"),
            fpod: ip("192.0.2.12"),
            unmapped: ip("203.0.113.99"),
            rlb: ip("203.0.113.30"),
            rpod: ip("192.0.2.75"),
            slb: ip("203.0.113.40"),
            spod: ip("192.0.2.14"),
            allowed: ip("198.51.100.100"),
            client: ip(CLIENTS[0]),
            pods: "192.0.2.0/24",
            sources: "198.51.100.0/25",
        },
        Net {
            ext: ip("2001:db8:100::200"),
            node: ip("2001:db8:100::2"),
            lb: ip("2001:db8:203::10"),
            pod: ip("2001:db8:2::11"),
            flb: ip("2001:db8:203::20"),
            fpod: ip("2001:db8:2::12"),
            unmapped: ip("2001:db8:203::99"),
            rlb: ip("2001:db8:203::30"),
            rpod: ip("2001:db8:2::75"),
            slb: ip("2001:db8:203::40"),
            spod: ip("2001:db8:2::14"),
            allowed: ip("2001:db8:100::80"),
            client: ip(CLIENTS[1]),
            pods: "2001:db8:2::/64",
            sources: "2001:db8:100::/120",
        },
    ]
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);

/// The state the programs run with: every kind of address of both nets.
fn state(ifs: Ifaces) -> DatapathState {
    let mut s = DatapathState::default();
    let mut cluster = Vec::new();
    for n in nets() {
        for (lb, pod, dev) in [
            (n.lb, n.pod, ifs.pod),
            (n.flb, n.fpod, ifs.fpod),
            (n.slb, n.spod, ifs.pod),
        ] {
            s.pod_svc.insert(pod, lb);
            s.svc_pod.insert(lb, pod);
            s.guard.insert(pod, dev);
            s.guard.insert(lb, 0);
        }
        s.filtered_pods.insert(n.fpod);
        for (proto, port) in [(TCP, 22), (UDP, 53)] {
            s.allowed_ports.insert(AllowedPort {
                pod: n.fpod,
                proto,
                port,
            });
        }
        s.unmapped_lbs.insert(n.unmapped);
        s.guard.insert(n.unmapped, 0);
        s.remote.insert(n.rlb, n.rpod);
        s.guard.insert(n.rpod, ifs.peer);
        s.guard.insert(n.rlb, ifs.peer);
        s.ranged_lbs.insert(n.slb);
        let range: Cidr = n.sources.parse().expect("cidr");
        for r in merge_ranges([range]) {
            s.source_ranges.insert((n.slb, r));
        }
        cluster.push(n.pods.parse::<Cidr>().expect("cidr"));
    }
    s.cluster = merge_ranges(cluster);
    s
}

fn with_world<T>(f: impl FnOnce(&mut World) -> T) -> T {
    let mut guard = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(World::new(state).expect("the packet-test world"));
    }
    let world = guard.as_mut().expect("world");
    world.enter().expect("setns");
    f(world)
}

fn ifs() -> Ifaces {
    with_world(|w| w.ifs)
}

/// Runs a program on `frame` as seen on interface `dev`; returns (verdict,
/// frame after).
fn run_prog(prog: &str, frame: &[u8], ingress_ifindex: u32, dev: u32) -> (u32, Vec<u8>) {
    with_world(|w| run_in(w, prog, frame, ingress_ifindex, dev))
}

/// [`run_prog`] for a test that holds the world (no other test runs
/// meanwhile).
fn run_in(w: &World, prog: &str, frame: &[u8], ingress_ifindex: u32, dev: u32) -> (u32, Vec<u8>) {
    w.run(prog, frame, ingress_ifindex, dev)
        .expect("BPF_PROG_TEST_RUN")
}

/// Leaving toward a pod of this node (TC egress of its interface), as
/// forwarded traffic.
fn to_pod(frame: &[u8], dev: u32) -> (u32, Vec<u8>) {
    run_prog("cozy_egress", frame, ifs().up, dev)
}

/// Arriving on interface `dev` (TC ingress).
fn arriving(frame: &[u8], dev: u32) -> (u32, Vec<u8>) {
    run_prog("cozy_ingress", frame, dev, dev)
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

fn icmp_of(n: &Net) -> u8 {
    if n.ext.is_ipv4() {
        ICMP
    } else {
        ICMPV6
    }
}

#[test]
fn toward_the_pod_every_protocol_is_rewritten() {
    let i = ifs();
    for n in nets() {
        for proto in [TCP, UDP, icmp_of(&n), GRE] {
            let (verdict, out) = to_pod(&Spec::new(n.ext, n.lb, proto).build(), i.pod);
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

/// An interface's MAC address, as `ip` shows it in the world's namespace.
fn mac_of(dev: &str) -> [u8; 6] {
    let out = std::process::Command::new("ip")
        .args(["-j", "link", "show", "dev", dev])
        .output()
        .expect("ip link");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let text = v[0]["address"].as_str().expect("address");
    let bytes: Vec<u8> = text
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).expect("hex"))
        .collect();
    bytes.try_into().expect("6 bytes")
}

/// TTL or hop limit of a frame without VLAN tag.
fn hop_limit(f: &[u8]) -> u8 {
    if f[12..14] == [0x08, 0x00] {
        f[14 + 8]
    } else {
        f[14 + 7]
    }
}

#[test]
fn fast_path_hands_packets_on_directly() {
    with_world(|w| {
        let i = w.ifs;
        let (pod_mac, ext_mac) = ([0x02, 0, 0, 0, 0, 0x0b], [0x02, 0, 0, 0, 0, 0xc8]);
        let mac = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        let (up_mac, vpod_mac, vfpod_mac) = (mac_of("uplink"), mac_of("v-pod"), mac_of("v-fpod"));
        w.kernel.set_fast_path(true).expect("fast path on");
        for n in nets() {
            // Routes and neighbours the FIB answers with (as a CNI and
            // neighbour discovery would leave them).
            for (addr, dev, m) in [
                (n.pod, "v-pod", pod_mac),
                (n.fpod, "v-fpod", pod_mac),
                (n.ext, "uplink", ext_mac),
            ] {
                w.reachable(addr, dev, &mac(m))
                    .expect("route and neighbour");
            }
            let run = |prog: &str, f: &[u8], dev: u32| w.run(prog, f, dev, dev).expect("run");

            // Outside -> LB: rewritten, TTL down by one, MACs of the hop
            // toward the pod, handed on (redirect).
            let inbound = Spec::new(n.ext, n.lb, TCP).ports(40000, 80).build();
            let (verdict, out) = run("cozy_ingress", &inbound, i.up);
            assert_eq!(verdict, REDIRECT, "{}: to the pod directly", n.lb);
            assert_rewritten(&out, n.ext, n.pod, "fast path in");
            assert_eq!(hop_limit(&out), hop_limit(&inbound) - 1, "TTL");
            assert_eq!(
                (&out[0..6], &out[6..12]),
                (&pod_mac[..], &vpod_mac[..]),
                "MACs"
            );

            // Pod -> outside: its LB IP, out of the uplink.
            let outbound = Spec::new(n.pod, n.ext, UDP).ports(5000, 53).build();
            let (verdict, out) = run("cozy_ingress", &outbound, i.pod);
            assert_eq!(verdict, REDIRECT, "{}: out directly", n.pod);
            assert_rewritten(&out, n.lb, n.ext, "fast path out");
            assert_eq!(hop_limit(&out), hop_limit(&outbound) - 1, "TTL");
            assert_eq!(
                (&out[0..6], &out[6..12]),
                (&ext_mac[..], &up_mac[..]),
                "MACs"
            );

            // The filter holds on the fast path.
            let listed = Spec::new(n.ext, n.flb, TCP).ports(40000, 22).build();
            let (verdict, out) = run("cozy_ingress", &listed, i.up);
            assert_eq!(verdict, REDIRECT, "listed port");
            assert_eq!(&out[6..12], &vfpod_mac[..]);
            let unlisted = Spec::new(n.ext, n.flb, TCP).ports(40000, 80).build();
            assert_eq!(
                run("cozy_ingress", &unlisted, i.up).0,
                DROP,
                "unlisted port"
            );

            // The stack path, untouched: a TTL that expires here, and a pod
            // whose neighbour is unknown.
            let mut last_hop = Spec::new(n.ext, n.lb, TCP);
            last_hop.hop_limit = 1;
            let f = last_hop.build();
            assert_eq!(run("cozy_ingress", &f, i.up), (PASS, f.clone()), "TTL 1");
            w.sh(&["ip", "neigh", "del", &n.pod.to_string(), "dev", "v-pod"])
                .expect("neigh del");
            assert_eq!(
                run("cozy_ingress", &inbound, i.up),
                (PASS, inbound.clone()),
                "no neighbour"
            );
            // And everything in the cluster, as before.
            let client = Spec::new(n.client, n.lb, TCP).build();
            assert_eq!(
                run("cozy_ingress", &client, i.client).0,
                PASS,
                "in-cluster client"
            );

            for (addr, dev) in [(n.pod, "v-pod"), (n.fpod, "v-fpod")] {
                let _ = w.sh(&["ip", "route", "del", &addr.to_string(), "dev", dev]);
                let _ = w.sh(&["ip", "neigh", "del", &addr.to_string(), "dev", dev]);
            }
            let _ = w.sh(&["ip", "neigh", "del", &n.ext.to_string(), "dev", "uplink"]);
        }
        w.kernel.set_fast_path(false).expect("fast path off");
    })
}

#[test]
fn from_the_pod_leaving_the_cluster_every_protocol_is_rewritten() {
    let i = ifs();
    for n in nets() {
        for proto in [TCP, UDP, icmp_of(&n), GRE] {
            let (verdict, out) = arriving(&Spec::new(n.pod, n.ext, proto).build(), i.pod);
            assert_eq!(verdict, PASS);
            assert_rewritten(&out, n.lb, n.ext, &format!("proto {proto} from {}", n.pod));
        }
    }
}

#[test]
fn toward_the_cluster_and_the_node_the_pod_keeps_its_ip() {
    let i = ifs();
    for n in nets() {
        // A pod of the cluster, this node's own address, multicast and
        // link-local neighbours (neighbour discovery).
        let (mc, ll) = if n.ext.is_ipv4() {
            (ip("224.0.0.251"), ip("169.254.20.10"))
        } else {
            (ip("ff02::1:ff00:1"), ip("fe80::1"))
        };
        for dst in [n.client, n.rpod, n.node, mc, ll] {
            let frame = Spec::new(n.pod, dst, UDP).build();
            let (verdict, out) = arriving(&frame, i.pod);
            assert_eq!(
                (verdict, out),
                (PASS, frame),
                "{} -> {dst} must keep the pod IP",
                n.pod
            );
        }
        // Neighbour discovery with hop limit 255 to a multicast group.
        if !n.ext.is_ipv4() {
            let mut ns = Spec::new(n.pod, mc, ICMPV6);
            ns.icmp_type = Some(135);
            ns.hop_limit = 255;
            let frame = ns.build();
            assert_eq!(
                arriving(&frame, i.pod),
                (PASS, frame),
                "neighbour solicitation"
            );
        }
    }
}

#[test]
fn neighbour_discovery_sent_to_an_lb_ip_is_translated_like_any_packet() {
    let i = ifs();
    let n = &nets()[1];
    for hop_limit in [255, 64] {
        let mut ns = Spec::new(n.ext, n.lb, ICMPV6);
        ns.icmp_type = Some(135);
        ns.hop_limit = hop_limit;
        let (verdict, out) = to_pod(&ns.build(), i.pod);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.ext, n.pod, "neighbour solicitation to an LB IP");
    }
}

#[test]
fn untouched_traffic_passes_unchanged() {
    let i = ifs();
    for n in nets() {
        for (prog, frame, dev) in [
            ("cozy_egress", Spec::new(n.ext, n.ext, TCP).build(), i.up),
            ("cozy_ingress", Spec::new(n.ext, n.lb, TCP).build(), i.up),
            (
                "cozy_ingress",
                Spec::new(n.ext, n.client, UDP).build(),
                i.up,
            ),
            // Outside traffic to another node's mapping: forwarded there
            // untranslated.
            ("cozy_ingress", Spec::new(n.ext, n.rlb, TCP).build(), i.up),
            ("cozy_egress", Spec::new(n.ext, n.rlb, TCP).build(), i.peer),
        ] {
            let (verdict, out) = run_prog(prog, &frame, i.up, dev);
            assert_eq!(verdict, PASS);
            assert_eq!(out, frame, "{prog} changed a packet it does not own");
        }
    }
    let mut arp = vec![0xffu8; 12];
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.extend_from_slice(&[0u8; 28]);
    for prog in ["cozy_ingress", "cozy_egress"] {
        assert_eq!(run_prog(prog, &arp, i.up, i.up), (PASS, arp.clone()));
    }
}

#[test]
fn ipv4_udp_without_checksum_keeps_zero() {
    let n = &nets()[0];
    let mut spec = Spec::new(n.ext, n.lb, UDP);
    spec.udp_no_checksum = true;
    let (verdict, out) = to_pod(&spec.build(), ifs().pod);
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
    let i = ifs();
    for n in nets() {
        assert_eq!(
            arriving(&Spec::new(n.ext, n.unmapped, TCP).build(), i.up).0,
            DROP,
            "{}",
            n.unmapped
        );
    }
}

#[test]
fn forged_sources_are_dropped_and_create_nothing() {
    let i = ifs();
    for n in nets() {
        // A mapped pod's IP from another pod's interface, or from outside.
        for dev in [i.client, i.up, i.fpod] {
            let (verdict, _) = arriving(&Spec::new(n.pod, n.ext, TCP).ports(22, 4444).build(), dev);
            assert_eq!(verdict, DROP, "pod IP from ifindex {dev}");
        }
        // A filtered pod's forged flow opens nothing: the "reply" to the
        // unlisted port stays dropped.
        let forged = Spec::new(n.fpod, n.ext, TCP).ports(8080, 4444).build();
        assert_eq!(arriving(&forged, i.client).0, DROP);
        let reply = Spec::new(n.ext, n.flb, TCP).ports(4444, 8080).build();
        assert_eq!(
            to_pod(&reply, i.fpod).0,
            DROP,
            "a forged flow opened the filter"
        );
        // Managed LB IPs are never a legitimate source here (local or
        // unmapped); another node's LB IP only from that node's path.
        for lb in [n.lb, n.flb, n.unmapped] {
            for dev in [i.up, i.pod] {
                assert_eq!(
                    arriving(&Spec::new(lb, n.ext, UDP).build(), dev).0,
                    DROP,
                    "{lb} from {dev}"
                );
            }
        }
        assert_eq!(arriving(&Spec::new(n.rlb, n.lb, UDP).build(), i.up).0, DROP);
        let frame = Spec::new(n.rlb, n.lb, UDP).build();
        assert_eq!(
            arriving(&frame, i.peer),
            (PASS, frame.clone()),
            "VM to VM from the other node"
        );
        // Another node's pod from its path: in-cluster traffic, untouched.
        let frame = Spec::new(n.rpod, n.client, UDP).build();
        assert_eq!(arriving(&frame, i.peer), (PASS, frame.clone()));
        assert_eq!(arriving(&frame, i.up).0, DROP);
    }
    let drops = with_world(|w| w.kernel.counters().expect("counters").drops);
    assert!(
        drops["spoofed_source"].packets >= 20,
        "spoofed drops counted: {drops:?}"
    );
}

/// A bridge's ports judge a guarded source only where its route names that
/// bridge; the bridge judges what it hands up to the node. Here `client`
/// is made a port of the bridge `peer` (their roles written for this test
/// alone): a mapped pod whose entry is its own veth passes the port (a
/// bridge its route does not name only carries it) and is forged where
/// the bridge hands it up; another node's pod, whose entry is `peer`, is
/// judged at the port and left alone by the bridge.
#[test]
fn a_bridge_the_route_does_not_name_carries_and_judges_only_what_it_hands_up() {
    use cozy_proxy_common::{iface, IfRole};
    fn roles(w: &mut World) -> AyaHashMap<&mut MapData, u32, IfRole> {
        AyaHashMap::try_from(w.ebpf.map_mut(names::IFACES).expect("ifaces")).expect("ifaces")
    }
    with_world(|w| {
        let i = w.ifs;
        let port = IfRole {
            bridge: i.peer,
            flags: iface::PORT_JUDGES,
        };
        let bridge = IfRole {
            bridge: 0,
            flags: iface::DEFER | iface::BRIDGE,
        };
        roles(w).insert(i.client, port, 0).expect("port role");
        roles(w).insert(i.peer, bridge, 0).expect("bridge role");
        let mut verdicts = Vec::new();
        for n in nets() {
            let own = Spec::new(n.pod, n.ext, TCP).ports(22, 4444).build();
            let remote = Spec::new(n.rpod, n.client, UDP).build();
            verdicts.push((
                n.pod,
                run_in(w, "cozy_ingress", &own, i.client, i.client).0,
                run_in(w, "cozy_ingress", &own, i.peer, i.peer).0,
                run_in(w, "cozy_ingress", &remote, i.client, i.client).0,
                run_in(w, "cozy_ingress", &remote, i.peer, i.peer).0,
            ));
        }
        roles(w).remove(&i.client).expect("port role gone");
        roles(w).remove(&i.peer).expect("bridge role gone");
        for v in verdicts {
            assert_eq!(
                v,
                (v.0, PASS, DROP, PASS, PASS),
                "at the port, at the bridge"
            );
        }
    });
}

/// A neighbour's claim to a guarded address: an ARP request naming it as
/// its sender (IPv4), a neighbour advertisement naming it as its target,
/// or a neighbour solicitation sent from it (IPv6), each with the
/// neighbour's own MAC. Linux takes any of them into its neighbour entry
/// of the address.
fn claims(claimed: IpAddr, own_ip: IpAddr) -> Vec<Vec<u8>> {
    let own = [2, 0, 0, 0, 0, 0x99];
    match claimed {
        IpAddr::V4(c) => vec![arp_request(own, c, "192.0.2.1".parse().expect("constant"))],
        IpAddr::V6(c) => vec![
            neighbour_message(own, own_ip, 136, 0x2000, c),
            neighbour_message(own, claimed, 135, 0, c),
        ],
    }
}

/// On a bridge, a neighbour pod's claim to a mapped pod's address would
/// move the node's neighbour entry to the neighbour: at the bridge's
/// ports it is dropped and counted, unless it comes by the address's own
/// port. On routed veths (no bridge) each link has its own neighbour
/// entries, and the claims pass. Here `pod` and `client` are made ports of
/// the bridge `peer` for this test alone.
#[test]
fn a_neighbours_claims_to_a_guarded_address_are_dropped_at_the_bridges_ports() {
    use cozy_proxy_common::{iface, IfRole};
    fn roles(w: &mut World) -> AyaHashMap<&mut MapData, u32, IfRole> {
        AyaHashMap::try_from(w.ebpf.map_mut(names::IFACES).expect("ifaces")).expect("ifaces")
    }
    with_world(|w| {
        let i = w.ifs;
        let spoofed =
            |w: &World| w.kernel.counters().expect("counters").drops["spoofed_source"].packets;
        let mut routed = Vec::new();
        for n in nets() {
            for claim in claims(n.pod, n.client) {
                routed.push(run_in(w, "cozy_ingress", &claim, i.client, i.client).0);
            }
        }
        let port = IfRole {
            bridge: i.peer,
            flags: iface::PORT_JUDGES,
        };
        let had: Vec<(u32, Option<IfRole>)> = [i.client, i.pod]
            .into_iter()
            .map(|dev| (dev, roles(w).get(&dev, 0).ok()))
            .collect();
        roles(w).insert(i.client, port, 0).expect("port role");
        roles(w).insert(i.pod, port, 0).expect("port role");
        let before = spoofed(w);
        let mut bridged = Vec::new();
        for n in nets() {
            for claim in claims(n.pod, n.client) {
                bridged.push((
                    run_in(w, "cozy_ingress", &claim, i.client, i.client).0,
                    run_in(w, "cozy_ingress", &claim, i.pod, i.pod).0,
                ));
            }
            // A claim to an address nobody guards passes.
            for claim in claims(n.client, n.client) {
                bridged.push((
                    run_in(w, "cozy_ingress", &claim, i.client, i.client).0,
                    PASS,
                ));
            }
        }
        let counted = spoofed(w) - before;
        for (dev, role) in had {
            match role {
                Some(r) => roles(w).insert(dev, r, 0).expect("role back"),
                None => roles(w).remove(&dev).expect("port role gone"),
            }
        }
        assert!(routed.iter().all(|v| *v == PASS), "routed: {routed:?}");
        assert_eq!(
            bridged,
            [
                (DROP, PASS),
                (PASS, PASS),
                (DROP, PASS),
                (DROP, PASS),
                (PASS, PASS),
                (PASS, PASS),
            ],
            "from the neighbour's port, from the pod's own"
        );
        assert_eq!(counted, 3, "the dropped claims counted");
    });
}

#[test]
fn port_filter_lets_listed_ports_in_and_drops_the_rest() {
    let i = ifs();
    for n in nets() {
        for (proto, port, want) in [
            (TCP, 22, PASS),
            (UDP, 53, PASS),
            (TCP, 8080, DROP),
            (UDP, 5353, DROP),
            (TCP, 53, DROP),
        ] {
            let (verdict, out) = to_pod(
                &Spec::new(n.ext, n.flb, proto).ports(50000, port).build(),
                i.fpod,
            );
            assert_eq!(verdict, want, "{proto}/{port} to {}", n.flb);
            if want == PASS {
                assert_rewritten(&out, n.ext, n.fpod, "filtered pass");
            }
        }
        for proto in [GRE, icmp_of(&n)] {
            assert_eq!(
                to_pod(&Spec::new(n.ext, n.flb, proto).build(), i.fpod).0,
                DROP,
                "proto {proto}"
            );
        }
        // Straight to the pod IP: filtered too.
        assert_eq!(
            to_pod(
                &Spec::new(n.ext, n.fpod, TCP).ports(1, 8080).build(),
                i.fpod
            )
            .0,
            DROP
        );
        // The node's own traffic (not forwarded) is not filtered.
        let own = Spec::new(n.node, n.fpod, TCP).ports(1, 8080).build();
        assert_eq!(
            run_prog("cozy_egress", &own, 0, i.fpod).0,
            PASS,
            "node-originated traffic"
        );
        // Fails closed: a TCP segment too short to hold its ports.
        let mut short = Spec::new(n.ext, n.flb, TCP).ports(1, 22).build();
        short.truncate(short.len() - Spec::new(n.ext, n.flb, TCP).payload.len() - 18);
        assert_eq!(to_pod(&short, i.fpod).0, DROP, "ports unreadable: dropped");
    }
}

#[test]
fn replies_to_flows_the_filtered_pod_started_pass() {
    let i = ifs();
    for n in nets() {
        let reply = Spec::new(n.ext, n.flb, TCP).ports(443, 41000).build();
        assert_eq!(to_pod(&reply, i.fpod).0, DROP, "unsolicited");
        let (verdict, out) = arriving(
            &Spec::new(n.fpod, n.ext, TCP).ports(41000, 443).build(),
            i.fpod,
        );
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.flb, n.ext, "pod flow out");
        assert_eq!(to_pod(&reply, i.fpod).0, PASS, "reply");
        assert_eq!(
            to_pod(
                &Spec::new(n.ext, n.flb, TCP).ports(444, 41000).build(),
                i.fpod
            )
            .0,
            DROP
        );
        let icmp = icmp_of(&n);
        let mut ping = Spec::new(n.fpod, n.ext, icmp);
        ping.sport = 777;
        assert_eq!(arriving(&ping.build(), i.fpod).0, PASS);
        let mut pong = Spec::new(n.ext, n.flb, icmp);
        pong.icmp_type = Some(if icmp == ICMP { 0 } else { 129 });
        pong.sport = 777;
        assert_eq!(to_pod(&pong.build(), i.fpod).0, PASS, "echo reply");
        pong.sport = 778;
        assert_eq!(
            to_pod(&pong.build(), i.fpod).0,
            DROP,
            "echo reply to another id"
        );
    }
}

/// Standing by (a backend switch, while nftables still serves), the
/// programs translate, filter and guard nothing, and remember the flows a
/// filtered pod starts: once they act, the replies to those flows pass,
/// though nftables translated the flows' first packets.
#[test]
fn standing_by_the_programs_only_remember_the_flows_filtered_pods_start() {
    with_world(|w| {
        let i = w.ifs;
        w.kernel.stand_by().expect("stand by");
        for n in nets() {
            let reply = |port| Spec::new(n.ext, n.flb, TCP).ports(443, port).build();
            // (what, program, frame, arriving on, run on, verdict once awake)
            let cases = [
                (
                    "the pod's flow out",
                    "cozy_ingress",
                    Spec::new(n.fpod, n.ext, TCP).ports(41100, 443).build(),
                    i.fpod,
                    i.fpod,
                    PASS,
                ),
                ("its reply", "cozy_egress", reply(41100), i.up, i.fpod, PASS),
                (
                    "a reply to no flow",
                    "cozy_egress",
                    reply(41101),
                    i.up,
                    i.fpod,
                    DROP,
                ),
                (
                    "the pod's IP from elsewhere",
                    "cozy_ingress",
                    Spec::new(n.fpod, n.ext, UDP).ports(41102, 53).build(),
                    i.up,
                    i.up,
                    DROP,
                ),
                (
                    "an unmapped LB IP",
                    "cozy_ingress",
                    Spec::new(n.ext, n.unmapped, TCP).ports(443, 80).build(),
                    i.up,
                    i.up,
                    DROP,
                ),
            ];
            for (what, prog, frame, arriving, dev, _) in &cases {
                let got = run_in(w, prog, frame, *arriving, *dev);
                assert_eq!(got, (PASS, frame.clone()), "standing by, {what}: untouched");
            }
            w.kernel.wake().expect("wake");
            for (what, prog, frame, arriving, dev, awake) in &cases[1..] {
                let (verdict, out) = run_in(w, prog, frame, *arriving, *dev);
                assert_eq!(verdict, *awake, "awake, {what}");
                if *awake == PASS {
                    assert_rewritten(&out, n.ext, n.fpod, what);
                }
            }
            w.kernel.stand_by().expect("stand by");
        }
        w.kernel.wake().expect("wake");
    })
}

/// A pod's answers to traffic from outside take no room in its flow
/// memory: whoever can reach a listed port, from as many spoofed sources
/// as it likes, cannot fill the pod's quota with the pod's answers (its
/// own flows would then lose their replies). Flows the pod starts are
/// remembered as before.
#[test]
fn answers_to_outside_traffic_take_no_room_in_the_flow_memory() {
    with_world(|w| {
        let i = w.ifs;
        let mut flows = flows(w);
        const SYN_ACK: u8 = 0x12;
        const ACK: u8 = 0x10;
        for n in nets() {
            // Whether the pod's packet left a flow; one it left is removed
            // again (the quota test counts the pod's live flows).
            let mut out =
                |w: &World, pod: IpAddr, dev: u32, proto: u8, ports: (u16, u16), flags: u8| {
                    let mut f = Spec::new(pod, n.ext, proto).ports(ports.0, ports.1);
                    f.tcp_flags = flags;
                    assert_eq!(run_in(w, "cozy_ingress", &f.build(), dev, dev).0, PASS);
                    let k = flow_key(pod, n.ext, proto, ports.0, ports.1);
                    let kept = flows.get(&k, 0).is_ok();
                    if kept {
                        flows.remove(&k).expect("forget the test's flow");
                    }
                    kept
                };
            for peer_port in 30000..30040 {
                assert!(
                    !out(w, n.fpod, i.fpod, TCP, (22, peer_port), SYN_ACK),
                    "a SYN-ACK from a listed port remembered"
                );
                assert!(
                    !out(w, n.fpod, i.fpod, UDP, (53, peer_port), 0),
                    "an answer from a listed UDP port remembered"
                );
            }
            assert!(
                !out(w, n.fpod, i.fpod, TCP, (8080, 30100), SYN_ACK),
                "a SYN-ACK from an unlisted port remembered"
            );
            assert!(
                !out(w, n.spod, i.pod, TCP, (80, 30101), SYN_ACK),
                "a source-ranged pod's SYN-ACK remembered"
            );
            // The pod's own flows: a SYN, a datagram, a connection already
            // open (its first segment seen is an ACK).
            assert!(out(w, n.fpod, i.fpod, TCP, (41100, 443), 0x02), "own SYN");
            assert!(
                out(w, n.fpod, i.fpod, UDP, (41101, 5353), 0),
                "own datagram"
            );
            assert!(
                out(w, n.fpod, i.fpod, TCP, (41102, 443), ACK),
                "own open connection"
            );
            assert!(
                out(w, n.spod, i.pod, TCP, (41103, 443), 0x02),
                "ranged pod's SYN"
            );
        }
    });
}

/// A filtered pod's flows outlive its mapping only while nothing consults
/// them: when its IP is mapped and filtered again they are forgotten
/// before its entry returns (a reply to the old pod's flow is dropped),
/// and otherwise the sweep forgets them. (Forgetting walks the whole flow
/// map, ~0.5 ms: not done on every change that removes a pod.)
#[test]
fn a_removed_pods_flows_are_forgotten_before_its_ip_is_filtered_again_or_at_the_sweep() {
    with_world(|w| {
        let i = w.ifs;
        let flows = flows(w);
        let full = state(i);
        let mut without = full.clone();
        for n in nets() {
            without.pod_svc.remove(&n.fpod);
            without.svc_pod.remove(&n.flb);
            without.filtered_pods.remove(&n.fpod);
            without.allowed_ports.retain(|p| p.pod != n.fpod);
            without.guard.remove(&n.fpod);
            without.guard.remove(&n.flb);
        }
        let keys: Vec<FlowKey> = nets()
            .iter()
            .map(|n| flow_key(n.fpod, n.ext, TCP, 41100, 443))
            .collect();
        let start_flows = |w: &World| {
            for n in nets() {
                let out = Spec::new(n.fpod, n.ext, TCP).ports(41100, 443).build();
                assert_eq!(run_in(w, "cozy_ingress", &out, i.fpod, i.fpod).0, PASS);
            }
            for k in &keys {
                flows.get(k, 0).expect("flow remembered");
            }
        };
        start_flows(w);
        apply_state(&mut w.kernel, &full, &without, None).expect("mapping removed");
        for k in &keys {
            assert!(flows.get(k, 0).is_ok(), "left to the sweep");
        }
        apply_state(&mut w.kernel, &without, &full, None).expect("IP mapped and filtered again");
        for k in &keys {
            assert!(flows.get(k, 0).is_err(), "forgotten before it is filtered");
        }
        for n in nets() {
            let reply = Spec::new(n.ext, n.flb, TCP).ports(443, 41100).build();
            assert_eq!(
                run_in(w, "cozy_egress", &reply, i.up, i.fpod).0,
                DROP,
                "a reply to the old pod's flow"
            );
        }
        start_flows(w);
        apply_state(&mut w.kernel, &full, &without, None).expect("mapping removed");
        w.kernel.expire_flows().expect("sweep");
        for k in &keys {
            assert!(flows.get(k, 0).is_err(), "forgotten by the sweep");
        }
        apply_state(&mut w.kernel, &without, &full, None).expect("restored");
    })
}

/// A mapping removed takes the reverse translations of in-cluster
/// clients' flows through it along, at the next sweep: when its LB IP
/// leads to the pod again, the pod's reply to a client port that a flow
/// through the old mapping used keeps the pod's address.
#[test]
fn reverse_translations_leave_with_their_mapping() {
    with_world(|w| {
        let i = w.ifs;
        let full = state(i);
        let mut without = full.clone();
        for n in nets() {
            without.pod_svc.remove(&n.pod);
            without.svc_pod.remove(&n.lb);
            without.guard.remove(&n.pod);
            without.guard.remove(&n.lb);
        }
        for n in nets() {
            let own = Spec::new(n.node, n.lb, TCP).ports(37000, 80).build();
            assert_eq!(run_in(w, "cozy_egress", &own, 0, i.pod).0, PASS);
        }
        apply_state(&mut w.kernel, &full, &without, None).expect("mapping removed");
        w.kernel.expire_flows().expect("sweep");
        apply_state(&mut w.kernel, &without, &full, None).expect("mapped again");
        for n in nets() {
            let back = Spec::new(n.pod, n.node, TCP).ports(80, 37000).build();
            assert_eq!(
                run_in(w, "cozy_ingress", &back, i.pod, i.pod),
                (PASS, back.clone()),
                "a reply within a flow of the removed mapping keeps the pod's address"
            );
        }
    })
}

/// A reverse translation whose client has been quiet longer than its
/// idle time is forgotten by the sweep; one in use is kept. (UDP: TCP's
/// idle time, 5 days, is longer than the clock has run since boot.)
#[test]
fn quiet_reverse_translations_age_out() {
    const QUIET: u16 = 37001;
    const BUSY: u16 = 37002;
    with_world(|w| {
        let i = w.ifs;
        for n in nets() {
            for port in [QUIET, BUSY] {
                let own = Spec::new(n.node, n.lb, UDP).ports(port, 80).build();
                assert_eq!(run_in(w, "cozy_egress", &own, 0, i.pod).0, PASS);
            }
        }
        let mut rev = rev_nat(w);
        let now_s = RevValue::seconds(monotonic_ns());
        assert!(
            now_s > RevValue::idle_s(UDP) + 1,
            "up for less than the idle time"
        );
        let quiet: Vec<(RevKey, RevValue)> = rev
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| k.client_port == QUIET)
            .collect();
        assert_eq!(quiet.len(), nets().len(), "one entry per family");
        for (k, mut v) in quiet {
            assert!(
                now_s.abs_diff(v.seen_s) <= 1,
                "seen {} now {now_s}",
                v.seen_s
            );
            v.seen_s = now_s - RevValue::idle_s(k.proto) - 1;
            rev.insert(k, v, 0).expect("aged");
        }
        w.kernel.expire_flows().expect("sweep");
        for n in nets() {
            let aged = Spec::new(n.pod, n.node, UDP).ports(80, QUIET).build();
            assert_eq!(
                run_in(w, "cozy_ingress", &aged, i.pod, i.pod),
                (PASS, aged.clone()),
                "the quiet flow's reply keeps the pod's address"
            );
            let busy = Spec::new(n.pod, n.node, UDP).ports(80, BUSY).build();
            let (verdict, out) = run_in(w, "cozy_ingress", &busy, i.pod, i.pod);
            assert_eq!(verdict, PASS);
            assert_ne!(out, busy, "the busy flow's reply is translated");
        }
    })
}

/// Each client's reverse translations are counted (`rev_held`): at its
/// quota a new flow is dropped, a recorded one goes on; the sweep recounts
/// what the programs' counts got wrong and forgets clients holding none.
#[test]
fn each_client_holds_its_quota_of_reverse_translations_and_the_sweep_recounts() {
    const RECORDED: u16 = 38001;
    const NEW: u16 = 38002;
    with_world(|w| {
        let i = w.ifs;
        let mut held = rev_held(w);
        for n in nets() {
            let own = Spec::new(n.node, n.lb, UDP).ports(RECORDED, 80).build();
            assert_eq!(run_in(w, "cozy_egress", &own, 0, i.pod).0, PASS);
            let node = IpKey::from(n.node);
            assert!(held.get(&node, 0).expect("counted") >= 1);
            // At its quota: the recorded flow goes on, a new one is dropped.
            held.insert(node, REV_PER_SOURCE, 0).expect("at the quota");
            assert_eq!(run_in(w, "cozy_egress", &own, 0, i.pod).0, PASS);
            let new = Spec::new(n.node, n.lb, UDP).ports(NEW, 80).build();
            assert_eq!(run_in(w, "cozy_egress", &new, 0, i.pod).0, DROP);
        }
        // A client the count lost, and one holding nothing.
        let stranger = IpKey::from(ip("203.0.113.250"));
        held.insert(stranger, 7, 0).expect("a stale count");
        w.kernel.expire_flows().expect("sweep");
        let entries: Vec<RevKey> = rev_nat(w).keys().filter_map(Result::ok).collect();
        for n in nets() {
            let node = IpKey::from(n.node);
            let actual = entries.iter().filter(|k| k.client == node).count() as u64;
            assert_eq!(held.get(&node, 0).expect("recounted"), actual, "{}", n.node);
            assert!(
                !entries
                    .iter()
                    .any(|k| k.client == node && k.client_port == NEW),
                "the flow past the quota was recorded"
            );
        }
        assert!(
            held.get(&stranger, 0).is_err(),
            "a client holding none is forgotten"
        );
    })
}

/// The `rev_held` map, as the programs see it (a handle of its own).
fn rev_held(w: &World) -> AyaHashMap<MapData, IpKey, u64> {
    AyaHashMap::try_from(Map::LruHashMap(own_handle(w, names::REV_HELD))).expect("rev_held map")
}

/// The `rev_nat` map, as the programs see it (a handle of its own).
fn rev_nat(w: &World) -> AyaHashMap<MapData, RevKey, RevValue> {
    AyaHashMap::try_from(Map::LruHashMap(own_handle(w, names::REV_NAT))).expect("rev_nat map")
}

/// A handle of our own on the programs' map `name`.
fn own_handle(w: &World, name: &str) -> MapData {
    let info = match w.ebpf.map(name) {
        Some(Map::HashMap(data) | Map::LruHashMap(data)) => data.info(),
        _ => panic!("{name} is a hash map"),
    };
    MapData::from_id(info.expect("info").id()).expect("the map by id")
}

/// The programs' clock (`bpf_ktime_get_ns`).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `flows` map, as the programs see it (a handle of its own).
fn flows(w: &World) -> AyaHashMap<MapData, FlowKey, FlowState> {
    AyaHashMap::try_from(Map::HashMap(own_handle(w, names::FLOWS))).expect("flow map")
}

fn flow_key(pod: IpAddr, peer: IpAddr, proto: u8, pod_port: u16, peer_port: u16) -> FlowKey {
    FlowKey {
        pod: IpKey::from(pod),
        peer: IpKey::from(peer),
        proto,
        pod_port,
        peer_port,
        ..FlowKey::default()
    }
}

#[path = "bpf_packets/fuzz.rs"]
mod fuzz;
#[path = "bpf_packets/xdp.rs"]
mod xdp;

/// A bounded fuzz run (200 000 frames by default; `cargo xtask fuzz` runs
/// longer): see fuzz.rs for the invariants.
#[test]
fn fuzzed_frames_keep_the_invariants() {
    let report = with_world(fuzz::run);
    assert!(
        report.failures.is_empty(),
        "{} failures:\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
    assert!(report.runs >= 1000, "too few runs: {report:?}");
    assert!(
        report.rewritten > 0 && report.dropped > 0 && report.reached_filtered > 0,
        "the fuzz missed a branch: {report:?}"
    );
}

#[test]
fn flows_expire_and_each_pod_has_its_own_room() {
    // Holds the world throughout: filling a pod's quota must not race the
    // other tests' flows.
    with_world(|w| {
        let i = w.ifs;
        let mut flows = flows(w);
        for n in nets() {
            let out = |w: &World, sport: u16, pod: IpAddr, dev: u32| {
                let f = Spec::new(pod, n.ext, UDP).ports(sport, 5353).build();
                assert_eq!(
                    run_in(w, "cozy_ingress", &f, dev, dev).0,
                    PASS,
                    "pod's datagram out"
                );
            };
            let reply = |w: &World, lb: IpAddr, dport: u16, dev: u32| {
                let f = Spec::new(n.ext, lb, UDP).ports(5353, dport).build();
                run_in(w, "cozy_egress", &f, i.up, dev).0
            };
            // A flow, its reply, then the flow left quiet past its timeout
            // (a replied UDP flow: 120 s): the next reply is dropped and
            // the program forgets the flow.
            out(w, 42000, n.fpod, i.fpod);
            assert_eq!(reply(w, n.flb, 42000, i.fpod), PASS, "reply to a live flow");
            let k = flow_key(n.fpod, n.ext, UDP, 42000, 5353);
            let mut st = flows.get(&k, 0).expect("flow remembered");
            assert_eq!(st.state, cozy_proxy_common::flow::UDP_REPLIED);
            st.last_seen_ns = monotonic_ns() - 121_000_000_000;
            flows.insert(k, st, 0).expect("age the flow");
            assert_eq!(
                reply(w, n.flb, 42000, i.fpod),
                DROP,
                "reply to an expired flow"
            );
            assert!(flows.get(&k, 0).is_err(), "the expired flow is forgotten");

            // One pod reaches its quota (with flows long expired, counted
            // as the controller's sweep counts): its new flows are not
            // remembered, another pod's are.
            let stale = FlowState {
                last_seen_ns: 0,
                state: cozy_proxy_common::flow::UDP,
                _pad: 0,
                _pad2: 0,
                _pad3: 0,
            };
            let quota = cozy_proxy_common::limits::FLOWS_PER_POD;
            for port in 0..quota {
                flows
                    .insert(flow_key(n.fpod, n.unmapped, UDP, 1, port as u16), stale, 0)
                    .expect("fill the quota");
            }
            w.kernel.count_flows().expect("count");
            out(w, 42001, n.fpod, i.fpod);
            assert_eq!(
                reply(w, n.flb, 42001, i.fpod),
                DROP,
                "over its quota: nothing new remembered"
            );
            out(w, 42002, n.spod, i.pod);
            assert_eq!(
                reply(w, n.slb, 42002, i.pod),
                PASS,
                "another pod is unaffected"
            );
            // The controller's sweep frees the room.
            let swept = w.kernel.expire_flows().expect("sweep");
            assert!(swept >= quota, "swept {swept} of {quota}");
            let left = flows
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.pod == IpKey::from(n.fpod))
                .count();
            assert!(left <= 1, "stale flows swept ({left} left)");
            out(w, 42001, n.fpod, i.fpod);
            assert_eq!(
                reply(w, n.flb, 42001, i.fpod),
                PASS,
                "room again after the sweep"
            );
        }
    })
}

/// An ICMP error from `from` to `to` quoting the UDP datagram
/// `qsrc:sport -> qdst:dport` (cut to `cut` bytes of its IP packet).
fn icmp_error(
    from: IpAddr,
    to: IpAddr,
    qsrc: IpAddr,
    qdst: IpAddr,
    sport: u16,
    dport: u16,
    cut: Option<usize>,
) -> Vec<u8> {
    let quoted = Spec::new(qsrc, qdst, UDP).ports(sport, dport).build();
    let mut quoted_ip = quoted[14..].to_vec();
    if let Some(c) = cut {
        quoted_ip.truncate(c);
    }
    let v4 = from.is_ipv4();
    let mut err = Spec::new(from, to, if v4 { ICMP } else { ICMPV6 });
    err.icmp_type = Some(if v4 { 3 } else { 1 });
    err.sport = 0;
    err.payload = quoted_ip;
    err.build()
}

#[test]
fn icmp_errors_about_the_pods_flows_quote_the_pod_on_arrival() {
    let i = ifs();
    for n in nets() {
        // Passthrough: outer and quoted LB IP become the pod, every
        // checksum right (outer, quoted IP header, quoted UDP).
        let (verdict, out) = to_pod(
            &icmp_error(n.ext, n.lb, n.lb, n.ext, 42000, 53, None),
            i.pod,
        );
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.ext, n.pod, "ICMP error");
        let q = inspect(&out).quoted.expect("quote");
        assert_eq!((q.src, q.dst), (n.pod, n.ext), "quoted header");
        assert!(q.ip_checksum_ok, "quoted IPv4 header checksum");
        assert_eq!(q.l4_checksum_ok, Some(true), "quoted UDP checksum");
        // A quote cut inside the UDP header: the addresses still change,
        // the outer checksum stays right; a quote cut inside the IP header
        // is left alone.
        let short = if n.ext.is_ipv4() { 24 } else { 44 };
        let (verdict, out) = to_pod(
            &icmp_error(n.ext, n.lb, n.lb, n.ext, 42000, 53, Some(short)),
            i.pod,
        );
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.ext, n.pod, "short quote");
        assert_eq!(inspect(&out).quoted.map(|q| q.src), Some(n.pod));
        // Cut inside the quoted source address.
        let cut = if n.ext.is_ipv4() { 14 } else { 20 };
        let frame = icmp_error(n.ext, n.lb, n.lb, n.ext, 42000, 53, Some(cut));
        let (verdict, out) = to_pod(&frame, i.pod);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.ext, n.pod, "truncated quote");
        assert_eq!(
            out[out.len() - cut..],
            frame[frame.len() - cut..],
            "truncated quote left alone"
        );
        // Filtered pod: only an error about its own flow passes.
        let err = icmp_error(n.ext, n.flb, n.flb, n.ext, 42001, 53, None);
        assert_eq!(to_pod(&err, i.fpod).0, DROP, "error about an unknown flow");
        assert_eq!(
            arriving(
                &Spec::new(n.fpod, n.ext, UDP).ports(42001, 53).build(),
                i.fpod
            )
            .0,
            PASS
        );
        let (verdict, out) = to_pod(&err, i.fpod);
        assert_eq!(verdict, PASS, "error about the pod's flow");
        assert_eq!(inspect(&out).quoted.map(|q| q.src), Some(n.fpod));
    }
}

/// What path MTU discovery needs through the filter and the ranges: an
/// error about the pod's answer from a listed port, and an error from a
/// router outside the ranges about a flow with an allowed peer. The
/// negative controls: the same errors about an unlisted port, and about a
/// peer outside the ranges, stay dropped.
#[test]
fn icmp_errors_about_answers_from_listed_ports_and_to_allowed_peers_pass() {
    let i = ifs();
    for n in nets() {
        let answer_from_listed = icmp_error(n.ext, n.flb, n.flb, n.ext, 53, 42002, None);
        let (verdict, out) = to_pod(&answer_from_listed, i.fpod);
        assert_eq!(verdict, PASS, "error about the answer from listed UDP 53");
        assert_eq!(inspect(&out).quoted.map(|q| q.src), Some(n.fpod));
        let from_unlisted = icmp_error(n.ext, n.flb, n.flb, n.ext, 54, 42003, None);
        assert_eq!(to_pod(&from_unlisted, i.fpod).0, DROP, "unlisted UDP 54");

        // ext is outside the ranges, `allowed` inside.
        let to_allowed = icmp_error(n.ext, n.slb, n.slb, n.allowed, 53, 45001, None);
        let (verdict, out) = to_pod(&to_allowed, i.pod);
        assert_eq!(
            verdict, PASS,
            "error from a router about an allowed peer's flow"
        );
        assert_eq!(
            inspect(&out).quoted.map(|q| (q.src, q.dst)),
            Some((n.spod, n.allowed))
        );
        let to_outside = icmp_error(n.ext, n.slb, n.slb, n.ext, 53, 45002, None);
        assert_eq!(
            to_pod(&to_outside, i.pod).0,
            DROP,
            "peer outside the ranges"
        );
    }
}

#[test]
fn icmp_errors_the_pod_sends_quote_its_lb_ip() {
    let i = ifs();
    for n in nets() {
        // The pod refuses ext's datagram (that came through the LB IP).
        let err = icmp_error(n.pod, n.ext, n.ext, n.pod, 53, 42000, None);
        let (verdict, out) = arriving(&err, i.pod);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.lb, n.ext, "pod's ICMP error");
        let q = inspect(&out).quoted.expect("quote");
        assert_eq!(
            (q.src, q.dst),
            (n.ext, n.lb),
            "quoted header names the LB IP"
        );
        assert!(q.ip_checksum_ok);
        assert_eq!(q.l4_checksum_ok, Some(true));
    }
}

#[test]
fn in_cluster_clients_are_translated_where_they_are() {
    let i = ifs();
    for n in nets() {
        // A pod of this node to another node's LB IP: leaves for the pod.
        let req = Spec::new(n.client, n.rlb, TCP).ports(33000, 80).build();
        let (verdict, out) = arriving(&req, i.client);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.client, n.rpod, "client-side translation");
        // The reply: untouched before conntrack (it saw client <-> pod)...
        let reply = Spec::new(n.rpod, n.client, TCP).ports(80, 33000).build();
        assert_eq!(arriving(&reply, i.peer), (PASS, reply.clone()));
        // ...and from the LB IP after it, leaving toward the client.
        let (verdict, out) = run_prog("cozy_egress", &reply, i.peer, i.client);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.rlb, n.client, "reply from the LB IP");
        // The same source forged at the uplink (the node routes it to
        // `client`): an outside client, passed on to the LB IP's node
        // untranslated, and nothing recorded for its ports.
        let forged = Spec::new(n.client, n.rlb, TCP).ports(33001, 80).build();
        assert_eq!(arriving(&forged, i.up), (PASS, forged.clone()));
        let reply = Spec::new(n.rpod, n.client, TCP).ports(80, 33001).build();
        assert_eq!(
            run_prog("cozy_egress", &reply, i.peer, i.client),
            (PASS, reply.clone())
        );
        // The node's own socket to a local LB IP: translated at TC egress
        // (conntrack saw the LB IP), the reply before conntrack.
        let own = Spec::new(n.node, n.lb, TCP).ports(34000, 80).build();
        let (verdict, out) = run_prog("cozy_egress", &own, 0, i.pod);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.node, n.pod, "node to LB IP");
        let back = Spec::new(n.pod, n.node, TCP).ports(80, 34000).build();
        let (verdict, out) = arriving(&back, i.pod);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.lb, n.node, "reply to the node from the LB IP");
        // The node's own socket to another node's LB IP.
        let own = Spec::new(n.node, n.rlb, UDP).ports(35000, 53).build();
        let (verdict, out) = run_prog("cozy_egress", &own, 0, i.peer);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.node, n.rpod, "node to a remote LB IP");
        let back = Spec::new(n.rpod, n.node, UDP).ports(53, 35000).build();
        let (verdict, out) = arriving(&back, i.peer);
        assert_eq!(verdict, PASS);
        assert_rewritten(&out, n.rlb, n.node, "reply from a remote LB IP");
    }
}

/// The node's socket reuses a port for the pod's own IP (a kubelet probe
/// after a flow through the LB IP, or after an entry planted by a pod of
/// another node sending as this node): the pod's replies to it keep the
/// pod's address, while the flow through the LB IP had them from the LB IP.
#[test]
fn a_port_reused_toward_the_pod_ip_is_not_answered_from_the_lb_ip() {
    let i = ifs();
    for n in nets() {
        for (proto, port) in [(TCP, 36000), (UDP, 36001)] {
            // Translated at one hook (a bridge's), then through another
            // addressed to the pod (its bridge port): still its flow.
            let own = Spec::new(n.node, n.lb, proto).ports(port, 80).build();
            let (verdict, translated) = run_prog("cozy_egress", &own, 0, i.client);
            assert_eq!(verdict, PASS);
            assert_eq!(run_prog("cozy_egress", &translated, 0, i.pod).0, PASS);
            let back = Spec::new(n.pod, n.node, proto).ports(80, port).build();
            let (_, out) = arriving(&back, i.pod);
            assert_rewritten(&out, n.lb, n.node, "the flow through the LB IP");
            // The same port, now to the pod's IP (a probe), through the hook
            // the flow was translated at.
            let probe = Spec::new(n.node, n.pod, proto).ports(port, 80).build();
            assert_eq!(
                run_prog("cozy_egress", &probe, 0, i.client),
                (PASS, probe.clone())
            );
            assert_eq!(
                arriving(&back, i.pod),
                (PASS, back.clone()),
                "{proto}: the probe's reply keeps the pod's address"
            );
        }
        // A segment that does not open a flow leaves the entry alone: the
        // flow through the LB IP goes on being answered from it.
        let own = Spec::new(n.node, n.lb, TCP).ports(36002, 80).build();
        assert_eq!(run_prog("cozy_egress", &own, 0, i.pod).0, PASS);
        let mut ack = Spec::new(n.node, n.pod, TCP).ports(36002, 80);
        ack.tcp_flags = 0x10;
        assert_eq!(run_prog("cozy_egress", &ack.build(), 0, i.pod).0, PASS);
        let back = Spec::new(n.pod, n.node, TCP).ports(80, 36002).build();
        let (_, out) = arriving(&back, i.pod);
        assert_rewritten(&out, n.lb, n.node, "an ACK opens nothing");
    }
}

#[test]
fn source_ranges_let_only_listed_sources_through_the_lb_ip() {
    let i = ifs();
    for n in nets() {
        let (verdict, out) = to_pod(&Spec::new(n.allowed, n.slb, TCP).build(), i.pod);
        assert_eq!(verdict, PASS, "listed source");
        assert_rewritten(&out, n.allowed, n.spod, "listed source");
        assert_eq!(
            to_pod(&Spec::new(n.ext, n.slb, TCP).build(), i.pod).0,
            DROP,
            "unlisted source"
        );
        // Replies to the pod's own flows are not restricted.
        assert_eq!(
            arriving(
                &Spec::new(n.spod, n.ext, TCP).ports(45000, 443).build(),
                i.pod
            )
            .0,
            PASS
        );
        assert_eq!(
            to_pod(
                &Spec::new(n.ext, n.slb, TCP).ports(443, 45000).build(),
                i.pod
            )
            .0,
            PASS,
            "reply"
        );
        // In-cluster clients through the LB IP: checked too (where they
        // are translated), but reaching the pod IP is not restricted.
        let frame = Spec::new(n.client, n.spod, TCP).build();
        assert_eq!(to_pod(&frame, i.pod), (PASS, frame.clone()));
    }
}

#[test]
fn fragments_follow_their_first_fragment() {
    // The world held throughout: another test between a first fragment and
    // its followers (the fuzzer, thousands of fragments to the filtered
    // pods) may push the first one's entry out of the LRU map, as traffic
    // would.
    with_world(|w| {
        let i = w.ifs;
        let to_pod = |frame: &[u8], dev: u32| run_in(w, "cozy_egress", frame, i.up, dev);
        for n in nets() {
            let frag = |dport: u16, id: u32, offset: u16, more: bool| {
                let mut s = Spec::new(n.ext, n.flb, UDP).ports(50000, dport);
                s.fragment = Some((id, offset, more));
                s.build()
            };
            assert_eq!(to_pod(&frag(53, 7, 0, true), i.fpod).0, PASS);
            let (verdict, out) = to_pod(&frag(53, 7, 32, false), i.fpod);
            assert_eq!(verdict, PASS, "later fragment of an admitted datagram");
            assert_eq!(inspect(&out).dst, n.fpod);
            assert!(inspect(&out).ip_checksum_ok);
            assert_eq!(to_pod(&frag(8080, 8, 0, true), i.fpod).0, DROP);
            assert_eq!(
                to_pod(&frag(8080, 8, 32, false), i.fpod).0,
                DROP,
                "later fragment of a dropped datagram"
            );
            assert_eq!(
                to_pod(&frag(53, 9, 64, false), i.fpod).0,
                DROP,
                "later fragment without a first"
            );
            let mut s = Spec::new(n.ext, n.lb, UDP);
            s.fragment = Some((10, 64, false));
            let frame = s.build();
            let (verdict, out) = to_pod(&frame, i.pod);
            assert_eq!(verdict, PASS);
            assert_rewritten(&out, n.ext, n.pod, "later fragment");
            assert_eq!(
                out[out.len() - s.payload.len()..],
                frame[frame.len() - s.payload.len()..]
            );
        }
    });
}

#[test]
fn ip_options_extension_headers_and_vlan_tags() {
    let i = ifs();
    for n in nets() {
        for (options, vlan) in [(true, false), (false, true), (true, true)] {
            let mut s = Spec::new(n.ext, n.lb, TCP);
            s.options = options;
            s.vlan = vlan;
            let (verdict, out) = to_pod(&s.build(), i.pod);
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
fn truncated_and_malformed_frames_never_break_the_programs() {
    let i = ifs();
    for n in nets() {
        // BPF_PROG_TEST_RUN itself refuses frames whose fixed IP header is
        // cut (EINVAL), so the cuts start right after it.
        let ip_end = if n.ext.is_ipv4() { 34 } else { 54 };
        for options in [false, true] {
            let mut spec = Spec::new(n.ext, n.lb, TCP);
            spec.options = options;
            let full = spec.build();
            for cut in ip_end..full.len() {
                let frame = &full[..cut];
                for (prog, dev) in [("cozy_ingress", i.up), ("cozy_egress", i.pod)] {
                    let (verdict, out) = run_prog(prog, frame, i.up, dev);
                    assert_eq!(verdict, PASS, "{prog} on {cut} bytes");
                    assert_eq!(out.len(), frame.len(), "{prog} changed the length");
                }
            }
        }
        let mut bad = Spec::new(n.ext, n.lb, TCP).build();
        bad[14] = if n.ext.is_ipv4() { 0x44 } else { 0x40 };
        assert_eq!(
            to_pod(&bad, i.pod),
            (PASS, bad.clone()),
            "malformed header left alone"
        );
    }
}
