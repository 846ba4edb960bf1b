//! Scenarios 29-31, 38, 39 and 42: edge security. Forged sources open
//! nothing, loadBalancerSourceRanges, a port filter that fails closed,
//! neighbour discovery exempt only as neighbour discovery, the node's own
//! ICMP errors naming the LB IP, a node VIP no Service can take, reverse
//! translations no forger plants and no client hoards.
use anyhow::{bail, ensure, Context, Result};
use cozy_proxy_common::limits::REV_PER_SOURCE;
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    nodes::net::Fam,
    nodes::topology::{cmd, Shape},
    packets::frames::{
        arp_request, mac, neighbour_message, parse, send, send_all, send_paged, Spec, ICMPV6, TCP,
        UDP,
    },
    scenario::WEB,
    sh::ok_in,
    traffic::{
        answer, conntrack, eventually, tcp_request, tcp_request_from, udp_request, Capture, Server,
    },
    Backend, Env,
};
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

/// A frame from `ns`'s `dev` to its peer `peer_ns`'s `peer_dev`.
fn on_link(ns: &str, dev: &str, peer_ns: &str, peer_dev: &str, mut spec: Spec) -> Result<Vec<u8>> {
    spec.macs = (mac(peer_ns, peer_dev)?, mac(ns, dev)?);
    Ok(spec.build())
}

/// Drops the datapath counted for forged sources.
pub fn spoof_drops(env: &Env) -> Result<u64> {
    match env.backend {
        Backend::Ebpf | Backend::EbpfFast | Backend::EbpfXdp => Ok(env.dump_json()?["counters"]
            ["drops"]["spoofed_source"]["packets"]
            .as_u64()
            .unwrap_or(0)),
        Backend::Nft => {
            // The IP table's check, and the bridge table's at the ports.
            let family = if env.fam() == Fam::V4 { "ip" } else { "ip6" };
            let mut total = 0;
            for table in [family, "bridge"] {
                let out = ok_in(
                    &env.topo.node(),
                    &["nft", "-j", "list", "table", table, "cozy_proxy"],
                )?;
                let v: serde_json::Value = serde_json::from_str(&out)?;
                total += v["nftables"]
                    .as_array()
                    .context("nft -j")?
                    .iter()
                    .filter(|i| {
                        i["rule"]["comment"]
                            .as_str()
                            .is_some_and(|c| c.starts_with("anti-spoofing"))
                    })
                    .filter_map(|rule| {
                        rule["rule"]["expr"]
                            .as_array()?
                            .iter()
                            .find_map(|e| e["counter"]["packets"].as_u64())
                    })
                    .sum::<u64>();
            }
            Ok(total)
        }
    }
}

/// Scenario 29: packets forged with a mapped pod's IP or a managed LB IP as
/// source, from another pod or from the outside, are not rewritten, create
/// no state, and open nothing: the "replies" the forger then sends to an
/// unlisted port of the filtered pod are still dropped.
pub fn s29_forged_sources_open_nothing(env: &mut Env) -> Result<()> {
    env.put_service(
        &Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22)]),
        &[env.pod_ip(1)],
    )?;
    env.settle()?;
    let _ssh = env.serve_tcp(1, 22)?;
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    let (node, ext, pod2) = (env.topo.node(), env.topo.ext(), env.pod_ns(2));
    let (pod1_ip, lb, ext_ip) = (env.pod_ip(1), env.lb(0), env.net.ext);
    let before = spoof_drops(env)?;
    // From another pod of the node (raw socket): "pod1:8080 -> ext:4444".
    // Not behind Kube-OVN's router: every pod reaches the node through the
    // one gateway port, and the node cannot tell which pod sent a frame
    // (docs/security.md: the CNI's port security is what protects there).
    let from_pods = !env.topo.shape.behind_router();
    if from_pods {
        let (gw_ns, gw_dev) = env.topo.pod_gateway(2);
        let forged = on_link(
            &pod2,
            "eth0",
            &gw_ns,
            &gw_dev,
            Spec::new(pod1_ip, ext_ip, TCP).ports(WEB, 4444),
        )?;
        send(&pod2, "eth0", &forged)?;
    }
    // From the outside: "pod1:8080 -> ext:4445" and "LB:8080 -> ext:4446".
    for (src, port) in [(pod1_ip, 4445), (lb, 4446)] {
        let forged = on_link(
            &ext,
            "uplink",
            &node,
            "uplink",
            Spec::new(src, ext_ip, TCP).ports(WEB, port),
        )?;
        send(&ext, "uplink", &forged)?;
    }
    std::thread::sleep(Duration::from_millis(300));
    let ports: &[u16] = if from_pods {
        &[4444, 4445, 4446]
    } else {
        &[4445, 4446]
    };
    for port in ports.iter().map(u16::to_string) {
        let entries = conntrack(&node, env.fam(), &["-p", "tcp", "--dport", &port])?;
        ensure!(
            entries.is_empty(),
            "a forged packet created state: {entries:#?}"
        );
    }
    // The forger's "replies" to the unlisted port: no connection, no RST.
    for &port in ports {
        if let Ok(got) = tcp_request_from(&ext, ext_ip, port, lb, WEB) {
            bail!("ext:{port} -> LB:{WEB} got through the filter: {got:?}");
        }
    }
    let after = spoof_drops(env)?;
    ensure!(
        after >= before + ports.len() as u64,
        "forged packets not counted: {before} -> {after}"
    );
    // The forged pod's own traffic flows, both ways.
    env.tcp_reaches(lb, 22, 1)?;
    env.egress_seen_as(1, lb)
}

/// The outside client's second address, outside the allowed range.
fn outside_range(env: &Env) -> IpAddr {
    match env.fam() {
        Fam::V4 => "198.51.100.200".parse().expect("v4"),
        Fam::V6 => "2001:db8:100::200".parse().expect("v6"),
    }
}

/// Scenario 30: with loadBalancerSourceRanges, only listed sources reach
/// the pod through the LB IP (in both modes); replies to the pod's own
/// flows are unaffected; an invalid range fails closed.
pub fn s30_source_ranges(env: &mut Env) -> Result<()> {
    let ext = env.topo.ext();
    let other = outside_range(env);
    let (allowed, prefix) = match env.fam() {
        Fam::V4 => ("198.51.100.0/25", "24"),
        Fam::V6 => ("2001:db8:100::/120", "64"),
    };
    // Deprecated (preferred_lft 0) so that it is never picked as the
    // default source of ext's other connections; bound explicitly below.
    ok_in(
        &ext,
        &[
            "ip",
            "addr",
            "add",
            &format!("{other}/{prefix}"),
            "dev",
            "uplink",
            "nodad",
            "preferred_lft",
            "0",
        ],
    )?;
    let _web = env.serve_tcp(1, WEB)?;
    let ext_server = cozy_proxy_testkit::traffic::Server::tcp(&ext, env.fam(), 7000, "ext")?;
    for filtered in [false, true] {
        let mut svc = Svc::new("vm1", env.lb(0));
        if filtered {
            svc = svc.filter(&[("TCP", WEB)]);
        }
        svc.source_ranges = vec![allowed.into()];
        env.put_service(&svc, &[env.pod_ip(1)])?;
        env.settle()?;
        env.tcp_reaches(env.lb(0), WEB, 1)?;
        if let Ok(got) = tcp_request_from(&ext, other, 40000, env.lb(0), WEB) {
            bail!("a source outside {allowed} got through (filtered {filtered}): {got:?}");
        }
        // pod1's own flow to the unlisted address: its replies pass.
        let got =
            cozy_proxy_testkit::traffic::eventually(cozy_proxy_testkit::traffic::SETTLE, || {
                cozy_proxy_testkit::traffic::tcp_request(&env.pod_ns(1), other, 7000)
            })?;
        ensure!(got.starts_with("ext "), "pod1's own flow: {got}");
    }
    // An invalid range: nothing reaches the pod through the LB IP.
    let mut svc = Svc::new("vm1", env.lb(0));
    svc.source_ranges = vec![allowed.into(), "not-a-range".into()];
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    env.wait_log("InvalidSourceRange")?;
    env.tcp_dropped(env.lb(0), WEB)?;
    drop(ext_server);
    Ok(())
}

/// Scenario 31: the port filter fails closed (a packet toward a filtered
/// pod whose port cannot be read is dropped, and so is a later fragment
/// without its first); neighbour discovery is exempt only as neighbour
/// discovery (an NS sent to an LB IP is translated like any packet, not
/// left to loop).
pub fn s31_fail_closed_and_neighbour_discovery(env: &mut Env) -> Result<()> {
    env.put_service(
        &Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22), ("UDP", 53)]),
        &[env.pod_ip(1)],
    )?;
    env.put_service(&Svc::new("vm2", env.lb(1)), &[env.pod_ip(3)])?;
    env.settle()?;
    let _ssh = env.serve_tcp(1, 22)?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    let (node, ext) = (env.topo.node(), env.topo.ext());
    let cap = Capture::start(
        &env.pod_ns(1),
        "eth0",
        &format!("host {}", env.net.ext),
        env.scratch("cap"),
    )?;
    // A TCP "header" of two bytes (the source port only).
    let mut cut = Spec::new(env.net.ext, env.lb(0), TCP);
    cut.raw_l4 = Some(vec![0x00, 0x16]);
    send(
        &ext,
        "uplink",
        &on_link(&ext, "uplink", &node, "uplink", cut)?,
    )?;
    // A later fragment of a UDP datagram whose first fragment never came.
    let mut later = Spec::new(env.net.ext, env.lb(0), UDP).ports(4000, 53);
    later.fragment = Some((77, 64, false));
    send(
        &ext,
        "uplink",
        &on_link(&ext, "uplink", &node, "uplink", later)?,
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let seen = cap.stop();
    ensure!(
        seen.is_empty(),
        "pod1 received what the filter could not read: {seen:#?}"
    );
    if env.fam() == Fam::V6 {
        // A neighbour solicitation (hop limit 64) sent to a passthrough LB
        // IP reaches its pod, translated; it does not come back out.
        let pod3 = env.pod_ns(3);
        let to_pod = Capture::start(
            &pod3,
            "eth0",
            "icmp6 and ip6[40] == 135",
            env.scratch("ns-pod"),
        )?;
        let back = Capture::start(
            &ext,
            "uplink",
            "icmp6 and ip6[40] == 135",
            env.scratch("ns-ext"),
        )?;
        let mut ns = Spec::new(env.net.ext, env.lb(1), ICMPV6);
        ns.icmp_type = Some(135);
        send(
            &ext,
            "uplink",
            &on_link(&ext, "uplink", &node, "uplink", ns)?,
        )?;
        std::thread::sleep(Duration::from_millis(500));
        let (at_pod, at_ext) = (to_pod.stop(), back.stop());
        let pod_ip = env.pod_ip(3).to_string();
        ensure!(
            at_pod.iter().any(|l| l.contains(&pod_ip)),
            "the solicitation to the LB IP did not reach its pod translated: {at_pod:#?}"
        );
        ensure!(
            at_ext.is_empty(),
            "the solicitation came back out: {at_ext:#?}"
        );
        extension_chain_in_paged_data(env)?;
    }
    vlan_tagged_frames(env)
}

/// 802.1Q-tagged frames sent raw onto the uplink (the kernel moves the tag
/// into the skb's metadata before TC ingress): one of VLAN 100, which the
/// node has no interface for, reaches no pod (the fast path does not hand
/// it on, tag and all); a priority-tagged one (VLAN 0) is the node's own
/// and reaches the pod behind the LB IP, untagged.
fn vlan_tagged_frames(env: &Env) -> Result<()> {
    let (node, ext) = (env.topo.node(), env.topo.ext());
    // Untagged first: the node knows pod3's link-layer address (the fast
    // path hands on only what the FIB resolves).
    let _udp = env.serve_udp(3, 7000)?;
    env.udp_reaches(env.lb(1), 7000, 3)?;
    let cap = Capture::start_pcap(&env.pod_ns(3), "eth0", "", env.scratch("vlan"))?;
    for (vid, dport) in [(100, 7100), (0, 7000)] {
        let mut spec = Spec::new(env.net.ext, env.lb(1), UDP).ports(4000, dport);
        spec.vlan = true;
        spec.vlan_id = vid;
        send(
            &ext,
            "uplink",
            &on_link(&ext, "uplink", &node, "uplink", spec)?,
        )?;
    }
    std::thread::sleep(Duration::from_millis(300));
    let frames = cap.stop_frames()?;
    let tagged: Vec<&Vec<u8>> = frames
        .iter()
        .filter(|f| f.get(12..14) == Some(&[0x81, 0x00][..]))
        .collect();
    ensure!(tagged.is_empty(), "pod3 received tagged frames: {tagged:?}");
    let dports: Vec<u16> = frames
        .iter()
        .filter_map(|f| parse(f)?.ports.map(|p| p.1))
        .collect();
    ensure!(
        !dports.contains(&7100),
        "a frame of VLAN 100 reached pod3: {dports:?}"
    );
    ensure!(
        dports.contains(&7000),
        "the priority-tagged frame did not reach pod3: {dports:?}"
    );
    Ok(())
}

/// IPv6 packets whose second extension header lies beyond the skb's
/// linear data (sent with only Ethernet and IPv6 headers linear; the
/// eBPF programs pull 256 bytes, and the first header is 264 long): the
/// filter still reads the port, a forged source is still dropped, and a
/// listed port is still translated with a right checksum. A packet of
/// the same shape from a source not ours to an unmanaged pod arrives
/// (the control: the path carries such packets).
fn extension_chain_in_paged_data(env: &Env) -> Result<()> {
    let (node, ext) = (env.topo.node(), env.topo.ext());
    // Room for packets larger than a page (the kernel keeps smaller ones
    // linear whatever it is asked).
    let mut devs = vec![
        (ext.clone(), "uplink".to_string()),
        (node.clone(), "uplink".into()),
    ];
    // Ports before the bridges they are on (a bridge's MTU follows its
    // smallest port's).
    devs.extend((1..=3).map(|i| env.topo.pod_port(i)));
    devs.extend((1..=3).map(|i| env.topo.pod_gateway(i)));
    if env.topo.shape == Shape::NodeSegment {
        devs.extend([(node.clone(), "rtr".into()), (node.clone(), "seg".into())]);
    }
    if env.topo.shape.behind_router() {
        devs.extend([
            (node.clone(), "ovn0".into()),
            (env.topo.ovn(), "n1".into()),
            (env.topo.ovn(), "join".into()),
        ]);
    }
    for (ns, dev) in devs {
        cmd(&ns, &format!("ip link set {dev} mtu 9000"))?;
    }
    for i in 1..=3 {
        cmd(&env.pod_ns(i), "ip link set eth0 mtu 9000")?;
    }
    let long = |src: IpAddr, dst: IpAddr, dport: u16| -> Result<Vec<u8>> {
        let mut spec = Spec::new(src, dst, UDP).ports(4000, dport);
        spec.dest_opts = vec![264, 8];
        spec.payload = vec![0x5a; 4800];
        on_link(&ext, "uplink", &node, "uplink", spec)
    };
    let caps = |name: &str| -> Result<[Capture; 2]> {
        Ok([
            // (tcpdump's "udp" does not look past extension headers.)
            Capture::start_pcap(
                &env.pod_ns(1),
                "eth0",
                "ip6",
                env.scratch(&format!("{name}1")),
            )?,
            Capture::start_pcap(
                &env.pod_ns(2),
                "eth0",
                "ip6",
                env.scratch(&format!("{name}2")),
            )?,
        ])
    };
    let [pod1, pod2] = caps("paged")?;
    // 54: Ethernet and the fixed IPv6 header.
    send_paged(&ext, "uplink", &long(env.net.ext, env.pod_ip(1), 9999)?, 54)?;
    send_paged(
        &ext,
        "uplink",
        &long(env.pod_ip(1), env.pod_ip(2), 9998)?,
        54,
    )?;
    send_paged(&ext, "uplink", &long(env.net.ext, env.pod_ip(2), 9997)?, 54)?;
    send_paged(&ext, "uplink", &long(env.net.ext, env.lb(0), 53)?, 54)?;
    std::thread::sleep(Duration::from_millis(500));
    let (at1, at2) = (pod1.stop_frames()?, pod2.stop_frames()?);
    let dports = |frames: &[Vec<u8>]| -> Vec<(IpAddr, u16, Option<bool>)> {
        frames
            .iter()
            .filter_map(|f| parse(f))
            .filter_map(|s| Some((s.src, s.ports?.1, s.l4_checksum_ok)))
            .collect()
    };
    let (at1, at2) = (dports(&at1), dports(&at2));
    ensure!(
        at2.iter().any(|(_, port, _)| *port == 9997),
        "the control did not arrive at pod2 (the path does not carry such packets): {at2:?}"
    );
    ensure!(
        !at1.iter().any(|(_, port, _)| *port == 9999),
        "the filtered pod received an unlisted port behind a long extension chain: {at1:?}"
    );
    ensure!(
        !at2.iter().any(|(_, port, _)| *port == 9998),
        "a forged source behind a long extension chain reached pod2: {at2:?}"
    );
    ensure!(
        at1.contains(&(env.net.ext, 53, Some(true))),
        "the listed port behind a long extension chain did not arrive translated and whole: {at1:?}"
    );
    Ok(())
}

/// Scenario 38: the ICMP errors the node itself sends about a packet it
/// forwards toward a mapped pod (time exceeded; too big for the pod's
/// link) quote the LB IP the client sent to, never the pod: the client's
/// path MTU to the LB IP drops, and nothing it receives names the pod.
pub fn s38_node_errors_quote_the_lb_ip(env: &mut Env) -> Result<()> {
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    env.ping_answered(env.lb(0))?;
    let (node, ext) = (env.topo.node(), env.topo.ext());
    let (lb, pod) = (env.lb(0), env.pod_ip(1));
    let family = if env.fam() == Fam::V4 { "-4" } else { "-6" };
    // The node's link toward the pod, narrower than the uplink.
    let route = ok_in(&node, &["ip", family, "route", "get", &pod.to_string()])?;
    let dev = route
        .split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .with_context(|| format!("no device in {route:?}"))?
        .to_string();
    cmd(&node, &format!("ip link set {dev} mtu 1300"))?;
    let filter = match env.fam() {
        Fam::V4 => "icmp",
        Fam::V6 => "icmp6",
    };
    let cap = Capture::start_pcap(&ext, "uplink", filter, env.scratch("errors"))?;
    let lb_s = lb.to_string();
    // Expires at the node: "time exceeded" (a hop of a traceroute).
    let _ = ok_in(&ext, &["ping", "-c", "1", "-W", "1", "-t", "1", &lb_s]);
    // Does not fit the pod's link: "fragmentation needed" / "packet too
    // big", which ext's kernel applies to the address it quotes.
    let size = match env.fam() {
        Fam::V4 => "1372",
        Fam::V6 => "1352",
    };
    let _ = ok_in(
        &ext,
        &["ping", "-c", "1", "-W", "1", "-M", "do", "-s", size, &lb_s],
    );
    std::thread::sleep(Duration::from_millis(300));
    let errors: Vec<_> = cap
        .stop_frames()?
        .iter()
        .filter_map(|f| parse(f))
        .filter_map(|s| s.quoted.map(|q| (s.icmp_type, q.src, q.dst)))
        .collect();
    ensure!(
        errors.len() >= 2,
        "ext received {} ICMP errors, not one for each probe: {errors:?}",
        errors.len()
    );
    ensure!(
        errors.iter().all(|(_, _, quoted)| *quoted == lb),
        "the node's ICMP errors quote another address than the LB IP {lb} (pod {pod}): {errors:?}"
    );
    let cached = ok_in(&ext, &["ip", family, "route", "get", &lb_s])?;
    ensure!(
        cached.contains("mtu 1300"),
        "ext did not learn the path MTU to the LB IP: {cached}"
    );
    Ok(())
}

/// Scenario 39: a node VIP (an address kube-vip or keepalived holds on
/// the node, which no Node object names) listed in `--reserved-cidrs`:
/// a Service on it is refused with a ForbiddenAddress warning, and the
/// VIP stays the node's, for the outside and for the node's own sockets;
/// another Service works as before.
pub fn s39_reserved_addresses_stay_the_nodes(env: &mut Env) -> Result<()> {
    let (node, ext) = (env.topo.node(), env.topo.ext());
    let vip = env.lb(0);
    let (plen, flags) = match env.fam() {
        Fam::V4 => ("32", ""),
        Fam::V6 => ("128", " nodad"),
    };
    cmd(
        &node,
        &format!("ip addr add {vip}/{plen} dev uplink{flags}"),
    )?;
    env.ctl
        .extra_args
        .extend(["--reserved-cidrs".into(), format!("{vip}/{plen}")]);
    env.ctl.restart()?;
    env.put_service(&Svc::new("vm1", vip), &[env.pod_ip(1)])?;
    env.put_service(&Svc::new("vm2", env.lb(1)), &[env.pod_ip(3)])?;
    // (The harness's expectation knows no reserved ranges: read the
    // kernel's state instead of settling on it.)
    eventually(Duration::from_secs(4), || {
        let held = env.dump()?;
        ensure!(
            held.svc_pod.contains_key(&env.lb(1)) && !held.svc_pod.contains_key(&vip),
            "{held:?}"
        );
        Ok(())
    })?;
    env.wait_log("reserved (--reserved-cidrs")?;
    let _pod = env.serve_tcp(1, WEB)?;
    let _pod3 = env.serve_tcp(3, WEB)?;
    let _node = Server::tcp(&node, env.fam(), WEB, "node")?;
    env.tcp_reaches(env.lb(1), WEB, 3)?;
    for (from, peer) in [(&ext, env.net.ext), (&node, vip)] {
        let got = eventually(Duration::from_secs(4), || tcp_request(from, vip, WEB))?;
        ensure!(
            got == answer("node", peer),
            "the VIP from {from} answered {got:?}, not the node"
        );
    }
    Ok(())
}

/// The reverse translations `dump` says each client address holds (eBPF;
/// none on nft, whose translations are conntrack's).
fn reverse_held(env: &Env) -> Result<BTreeMap<IpAddr, u64>> {
    if env.backend == Backend::Nft {
        return Ok(BTreeMap::new());
    }
    let dump = env.dump_json()?;
    let held = dump["details"]["reverse_translations_held"]
        .as_object()
        .with_context(|| format!("no reverse_translations_held in the dump: {dump}"))?;
    held.iter()
        .map(|(ip, n)| Ok((ip.parse()?, n.as_u64().context("a count")?)))
        .collect()
}

/// Addresses of the pod network no pod has: sources a forger outside
/// takes to pass for a client in the cluster.
fn unused_pod_addresses(fam: Fam, n: usize) -> Vec<IpAddr> {
    (0..n)
        .map(|j| match fam {
            Fam::V4 => IpAddr::from([192, 0, 2, 100 + j as u8]),
            Fam::V6 => format!("2001:db8:2::1:{j:x}").parse().expect("v6"),
        })
        .collect()
}

/// Scenario 42: reverse translations (an in-cluster client's flow to an
/// LB IP, translated on the node) are recorded only for clients that
/// really are in the cluster, and one client cannot hold more than its
/// quota. Sources of the pod network forged behind the uplink (the node
/// routes that network elsewhere: the IPAM block's blackhole route, as
/// Calico keeps one) are outside clients: passed through as such, nothing
/// recorded for them. A pod opening flows from more ports than its quota
/// gets the excess dropped and counted, and the node's own client still
/// gets its flow. nft keeps no table of its own: conntrack records what
/// the node translated, as for every outside client.
pub fn s42_forged_cluster_clients_plant_nothing(env: &mut Env) -> Result<()> {
    const PORT: u16 = 5353;
    let (node, ext, pod2) = (env.topo.node(), env.topo.ext(), env.pod_ns(2));
    let (lb, pod2_ip) = (env.lb(0), env.pod_ip(2));
    // The pod network in the cluster (as a Node's podCIDRs would say),
    // its block routed nowhere but to its pods.
    let block = match env.fam() {
        Fam::V4 => "192.0.2.0/24",
        Fam::V6 => "2001:db8:2::/64",
    };
    cmd(&node, &format!("ip route add blackhole {block}"))?;
    env.ctl
        .extra_args
        .extend(["--cluster-cidrs".to_string(), block.to_string()]);
    env.ctl.restart()?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let _udp = env.serve_udp(1, PORT)?;
    // (Not `settle`: its expected state knows no `--cluster-cidrs`.)
    env.udp_reaches(lb, PORT, 1)?;
    // A client in the cluster: pod2's flow is translated, and recorded.
    let got = eventually(Duration::from_secs(5), || udp_request(&pod2, lb, PORT))?;
    ensure!(got == answer("pod1", pod2_ip), "pod2 -> LB: {got}");
    let is_ebpf = env.backend != Backend::Nft;
    if is_ebpf {
        let held = reverse_held(env)?;
        ensure!(
            held.get(&pod2_ip).is_some_and(|&n| n >= 1),
            "pod2's flow not recorded: {held:?}"
        );
    }
    // Forged from behind the uplink: 40 addresses x 100 ports.
    let forgers = unused_pod_addresses(env.fam(), 40);
    let macs = (mac(&node, "uplink")?, mac(&ext, "uplink")?);
    let frames: Vec<_> = (forgers.iter())
        .flat_map(|src| (0..100u16).map(move |port| (*src, port)))
        .map(|(src, port)| {
            let mut spec = Spec::new(src, lb, UDP).ports(20_000 + port, PORT + 2);
            spec.macs = macs;
            spec.build()
        })
        .collect();
    send_all(&ext, "uplink", &frames)?;
    // One client's quota and more, from pod2's own path.
    const OVER: u64 = 500;
    let (gw_ns, gw_dev) = env.topo.pod_gateway(2);
    let macs = (mac(&gw_ns, &gw_dev)?, mac(&pod2, "eth0")?);
    let frames: Vec<_> = (0..REV_PER_SOURCE + OVER)
        .map(|j| {
            let mut spec = Spec::new(pod2_ip, lb, UDP).ports(10_000 + j as u16, PORT + 1);
            spec.macs = macs;
            spec.build()
        })
        .collect();
    send_all(&pod2, "eth0", &frames)?;
    // Another client (the node itself) still gets its flow.
    let got = eventually(Duration::from_secs(5), || udp_request(&node, lb, PORT))?;
    ensure!(
        got.starts_with("pod1 "),
        "node -> LB after the floods: {got}"
    );
    if is_ebpf {
        let held = reverse_held(env)?;
        let planted: Vec<_> = forgers.iter().filter(|a| held.contains_key(a)).collect();
        ensure!(
            planted.is_empty(),
            "forged sources hold reverse translations: {planted:?} of {held:?}"
        );
        let pod2_held = held.get(&pod2_ip).copied().unwrap_or(0);
        ensure!(
            pod2_held <= REV_PER_SOURCE,
            "pod2 holds {pod2_held}, over its quota of {REV_PER_SOURCE}"
        );
        let refused = env.dump_json()?["counters"]["drops"]["reverse_quota"]["packets"]
            .as_u64()
            .unwrap_or(0);
        ensure!(
            refused >= OVER,
            "{refused} of pod2's flows over its quota dropped, expected {OVER} or more"
        );
    }
    Ok(())
}

/// A forged neighbour claim from pod2's port: an ARP request (IPv4) or an
/// unsolicited neighbour advertisement with the override flag (IPv6)
/// naming pod1's address with pod2's MAC.
fn forged_claim(env: &Env, pod1: IpAddr, gateway: IpAddr) -> Result<Vec<u8>> {
    let own = mac(&env.pod_ns(2), "eth0")?;
    Ok(match (pod1, gateway) {
        (IpAddr::V4(p), IpAddr::V4(g)) => arp_request(own, p, g),
        (IpAddr::V6(p), IpAddr::V6(_)) => neighbour_message(own, pod1, 136, 0x2000, p),
        _ => bail!("mixed families"),
    })
}

/// Scenario 43 (bridge): the mapped pod's entry is its own port from the
/// start (read from its namespace, which a neighbour cannot write), and a
/// neighbour pod claiming its address by ARP or neighbour advertisement
/// moves nothing: the claim is dropped at the neighbour's port and
/// counted, the node's neighbour entry keeps the pod's MAC (the pod keeps
/// its inbound traffic), the pod's entry stays its port, the neighbour's
/// packets with that address are dropped and counted, and the mapped
/// pod's own still leave translated.
pub fn s43_forged_neighbour_claims_move_no_guard(env: &mut Env) -> Result<()> {
    let (pod1_ip, lb) = (env.pod_ip(1), env.lb(0));
    let node = env.topo.node();
    let (_, port) = env.topo.pod_port(1);
    let own_port = ok_in(&node, &["cat", &format!("/sys/class/net/{port}/ifindex")])?
        .trim()
        .parse::<u64>()?;
    let guard = |env: &Env| -> Result<Option<u64>> {
        Ok(env.dump_json()?["state"]["guard"][pod1_ip.to_string()].as_u64())
    };
    // Before pod1 has sent anything through the node: its own port at
    // once, not "any port of the bridge" until the bridge learns it.
    env.put_service(&Svc::new("vm1", lb), &[pod1_ip])?;
    eventually(Duration::from_secs(4), || {
        let g = guard(env)?;
        ensure!(
            g == Some(own_port),
            "pod1's entry {g:?}, its port {own_port}"
        );
        Ok(())
    })?;
    let gateway: IpAddr = match env.fam() {
        Fam::V4 => "192.0.2.1".parse()?,
        Fam::V6 => "2001:db8:2::1".parse()?,
    };
    let pod1_mac = mac(&env.pod_ns(1), "eth0")?;
    let pod2_mac = mac(&env.pod_ns(2), "eth0")?;
    let claimed = forged_claim(env, pod1_ip, gateway)?;
    let shown = |m: [u8; 6]| format!("lladdr {}", m.map(|b| format!("{b:02x}")).join(":"));
    // Were the claim heard, the node's neighbour entry would name pod2's
    // MAC (the node's traffic to pod1 would go to pod2), and the
    // controller would resolve pod1's path again.
    let claim_is_dropped = |env: &Env, when: &str| -> Result<String> {
        let before = spoof_drops(env)?;
        send(&env.pod_ns(2), "eth0", &claimed)?;
        std::thread::sleep(Duration::from_secs(1));
        ensure!(
            spoof_drops(env)? > before,
            "{when}: pod2's claim to pod1's address was not dropped"
        );
        let neighbour = ok_in(&node, &["ip", "neigh", "show", &pod1_ip.to_string()])?;
        ensure!(
            !neighbour.contains(&shown(pod2_mac)),
            "{when}: the node's neighbour entry of pod1 names pod2: {neighbour}"
        );
        Ok(neighbour)
    };
    claim_is_dropped(env, "before pod1 has spoken")?;
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(lb, WEB, 1)?;
    let neighbour = claim_is_dropped(env, "after pod1 has spoken")?;
    ensure!(
        neighbour.contains(&shown(pod1_mac)),
        "the node's neighbour entry of pod1: {neighbour}"
    );
    env.tcp_reaches(lb, WEB, 1)?;
    ensure!(
        guard(env)? == Some(own_port),
        "pod1's entry moved off its own port {own_port}: {:?}",
        guard(env)?
    );
    let before = spoof_drops(env)?;
    let (gw_ns, gw_dev) = env.topo.pod_gateway(2);
    let forged = on_link(
        &env.pod_ns(2),
        "eth0",
        &gw_ns,
        &gw_dev,
        Spec::new(pod1_ip, env.net.ext, UDP).ports(WEB, 4447),
    )?;
    send(&env.pod_ns(2), "eth0", &forged)?;
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        spoof_drops(env)? > before,
        "pod2 sending as pod1 was not dropped"
    );
    // pod1's own packets leave translated.
    let ext = env.topo.ext();
    let capture = Capture::start(
        &ext,
        "uplink",
        "udp and dst port 4448",
        env.scratch("s43.txt"),
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let from_pod1 = on_link(
        &env.pod_ns(1),
        "eth0",
        &gw_ns,
        &gw_dev,
        Spec::new(pod1_ip, env.net.ext, UDP).ports(WEB, 4448),
    )?;
    send(&env.pod_ns(1), "eth0", &from_pod1)?;
    std::thread::sleep(Duration::from_millis(500));
    let seen = capture.stop();
    ensure!(
        seen.iter().any(|l| l.contains(&lb.to_string())),
        "pod1's packet did not leave as its LB IP: {seen:?} (node {node})"
    );
    Ok(())
}
