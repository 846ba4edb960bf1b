//! Scenarios 7-11: port filter (wholeIP "false"); 41: the ICMP errors
//! path MTU discovery needs, through the filter and source ranges.
use anyhow::{bail, ensure, Result};
use cozy_proxy_testkit::scenario::WEB;
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    nodes::net::Fam,
    nodes::topology::{cmd, Shape, FAR_V4, FAR_V6},
    sh::ok_in,
    traffic::{eventually, fetch, tcp_request, udp_request, Capture, LargeAnswer, SETTLE},
    Backend, Env,
};
use std::{net::IpAddr, time::Duration};

fn filtered(env: &Env, allow_icmp: Option<&str>) -> Svc {
    let mut svc = Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22), ("UDP", 53)]);
    svc.allow_icmp = allow_icmp.map(str::to_string);
    svc
}

/// Scenario 7: A listed TCP port and a listed UDP port reach pod1.
pub fn s07_listed_ports_pass(env: &mut Env) -> Result<()> {
    env.put_service(&filtered(env, None), &[env.pod_ip(1)])?;
    env.settle()?;
    let _t = env.serve_tcp(1, 22)?;
    let _u = env.serve_udp(1, 53)?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.udp_reaches(env.lb(0), 53, 1)
}

/// Scenario 8: An unlisted TCP port and an unlisted UDP port are dropped: no reply,
/// no RST, and pod1 never sees the packets.
pub fn s08_unlisted_ports_dropped(env: &mut Env) -> Result<()> {
    env.put_service(&filtered(env, None), &[env.pod_ip(1)])?;
    env.settle()?;
    let _ok = env.serve_tcp(1, 22)?;
    let _t = env.serve_tcp(1, WEB)?;
    let _u = env.serve_udp(1, 5353)?;
    // The datapath is up: a listed port works.
    env.tcp_reaches(env.lb(0), 22, 1)?;
    let cap = Capture::start(
        &env.pod_ns(1),
        "eth0",
        "tcp port 8080 or tcp port 9999 or udp port 5353",
        env.scratch("cap"),
    )?;
    let xdp_dropped = env.xdp_verdicts()?.1;
    env.tcp_dropped(env.lb(0), WEB)?;
    env.tcp_dropped(env.lb(0), 9999)?; // nothing listens: still no RST
    env.udp_dropped(env.lb(0), 5353)?;
    let seen = cap.stop();
    ensure!(seen.is_empty(), "pod1 saw filtered packets: {seen:#?}");
    // On the XDP path they never got an skb: the uplink's XDP program
    // dropped them.
    if env.backend == Backend::EbpfXdp {
        let now = env.xdp_verdicts()?.1;
        ensure!(
            now > xdp_dropped,
            "the XDP program dropped nothing ({xdp_dropped} -> {now})"
        );
    }
    from_a_neighbour_pod(env)
}

/// What reaches pod1 of a neighbour pod's connections to pod1's own IP,
/// on a listed and an unlisted port (the SYNs pod1 sees).
fn neighbour_syns(env: &Env) -> Result<Vec<String>> {
    let cap = Capture::start(
        &env.pod_ns(1),
        "eth0",
        &format!("tcp and src host {}", env.pod_ip(2)),
        env.scratch("neighbour"),
    )?;
    for port in [22, WEB] {
        let _ = tcp_request(&env.pod_ns(2), env.pod_ip(1), port);
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    Ok(cap.stop())
}

fn syn_to(seen: &[String], port: u16) -> bool {
    seen.iter()
        .any(|l| l.contains(&format!(".{port}: Flags [S]")))
}

/// A neighbour pod connecting to pod1's own IP: the listed port reaches
/// it, the unlisted one does not, where the node sees the traffic (its
/// routing; a bridge's ports: br_netfilter's IP hooks for nft, the port's
/// TC egress for eBPF). In Kube-OVN's shape the pods' segment carries it
/// past the node, which filters nothing of it (docs/traffic.md). On a
/// bridge without br_netfilter only the eBPF backend sees it.
fn from_a_neighbour_pod(env: &Env) -> Result<()> {
    let seen = neighbour_syns(env)?;
    ensure!(
        syn_to(&seen, 22),
        "the listed port did not reach pod1: {seen:#?}"
    );
    // Kube-OVN's segment in the router's namespace never crosses the node;
    // in the node's namespace without br_netfilter, only the eBPF
    // backend's hooks on its ports see it.
    let filtered = match env.topo.shape {
        Shape::Gateway => false,
        Shape::NodeSegment => env.backend != Backend::Nft,
        Shape::Routed | Shape::Bridge => true,
    };
    ensure!(
        syn_to(&seen, WEB) != filtered,
        "{:?} shape, {:?}: the neighbour pod's SYN to the unlisted port {}: {seen:#?}",
        env.topo.shape,
        env.backend,
        if filtered {
            "reached pod1"
        } else {
            "did not reach pod1, past the node"
        }
    );
    if env.topo.shape == Shape::Bridge {
        cmd(
            &env.topo.node(),
            "sysctl -qw net.bridge.bridge-nf-call-iptables=0 net.bridge.bridge-nf-call-ip6tables=0",
        )?;
        let seen = neighbour_syns(env)?;
        let filtered = env.backend != Backend::Nft;
        ensure!(
            syn_to(&seen, WEB) != filtered,
            "bridge without br_netfilter, {:?}: the SYN to the unlisted port {}: {seen:#?}",
            env.backend,
            if filtered {
                "reached pod1"
            } else {
                "did not reach pod1"
            }
        );
    }
    Ok(())
}

/// Scenario 9: ICMP echo is dropped without allowICMP and answered with "true".
pub fn s09_icmp_needs_allow(env: &mut Env) -> Result<()> {
    env.put_service(&filtered(env, None), &[env.pod_ip(1)])?;
    env.settle()?;
    let _ok = env.serve_tcp(1, 22)?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.ping_unanswered(env.lb(0))?;
    env.put_service(&filtered(env, Some("true")), &[env.pod_ip(1)])?;
    env.settle()?;
    env.ping_answered(env.lb(0))
}

/// Scenario 10: pod1's own outbound TCP and UDP flows still get their replies.
pub fn s10_replies_to_own_flows(env: &mut Env) -> Result<()> {
    env.put_service(&filtered(env, None), &[env.pod_ip(1)])?;
    env.settle()?;
    env.egress_seen_as(1, env.lb(0))
}

/// Scenario 11: ICMP errors about pod1's own flows (port unreachable from ext)
/// reach pod1, and its socket: the quoted header names pod1 again.
pub fn s11_icmp_errors_reach_pod(env: &mut Env) -> Result<()> {
    env.put_service(&filtered(env, Some("true")), &[env.pod_ip(1)])?;
    env.settle()?;
    env.egress_seen_as(1, env.lb(0))?; // warm up neighbours
    let filter = match env.fam() {
        Fam::V4 => "icmp[icmptype] == icmp-unreach",
        Fam::V6 => "icmp6 and ip6[40] == 1",
    };
    let cap = Capture::start(&env.pod_ns(1), "eth0", filter, env.scratch("cap"))?;
    // Nothing listens on ext:7999: ext answers "port unreachable" to LB_IP,
    // quoting LB_IP. Translated back, it finds pod1's socket: the request
    // fails at once with "Connection refused" instead of timing out.
    let refused = match udp_request(&env.pod_ns(1), env.net.ext, 7999) {
        Ok(answer) => bail!("ext:7999 answered {answer:?}"),
        Err(e) => e.to_string().contains("refused"),
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    let seen = cap.stop();
    ensure!(!seen.is_empty(), "the ICMP error did not reach pod1");
    ensure!(
        refused,
        "the ICMP error reached pod1 but not its socket (quoted header not translated)"
    );
    Ok(())
}

/// Scenario 41: path MTU discovery through a narrower link. A client
/// beyond ext fetches a large answer from a listed port of a filtered pod
/// (pod1, LB 0), and from a pod whose LB IP admits only that client's
/// address (pod2, LB 1: the router ext is outside the ranges). ext, the
/// router before the narrow link, answers the first full-size segment
/// with "fragmentation needed" / "packet too big" to the LB IP: the error
/// reaches the pod, its route to the client learns the smaller MTU, and
/// the whole answer arrives. Dropped, the answer would stall for good.
pub fn s41_path_mtu_errors_reach_pod(env: &mut Env) -> Result<()> {
    let far = env.topo.add_far_client(MTU)?;
    let far_ip: IpAddr = match env.fam() {
        Fam::V4 => FAR_V4.0,
        Fam::V6 => FAR_V6.0,
    }
    .parse()?;
    let filtered = Svc::new("vm1", env.lb(0)).filter(&[("TCP", WEB)]);
    let mut ranged = Svc::new("vm2", env.lb(1));
    let host_bits = if far_ip.is_ipv4() { 32 } else { 128 };
    ranged.source_ranges = vec![format!("{far_ip}/{host_bits}")];
    env.put_service(&filtered, &[env.pod_ip(1)])?;
    env.put_service(&ranged, &[env.pod_ip(2)])?;
    env.settle()?;
    let _answers = [
        LargeAnswer::serve(&env.pod_ns(1), env.fam(), WEB, ANSWER)?,
        LargeAnswer::serve(&env.pod_ns(2), env.fam(), WEB, ANSWER)?,
    ];
    let mut failures = Vec::new();
    for (i, what) in [
        (1, "a listed port of a filtered pod"),
        (2, "an LB IP with source ranges"),
    ] {
        if let Err(e) = large_answer_arrives(env, &far, far_ip, i) {
            failures.push(format!("{what}: {e:#}"));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Scenario 41's narrow link, and the answer each pod sends through it.
const MTU: u32 = 1280;
const ANSWER: usize = 200_000;

/// Pod `i`'s large answer through its LB IP (`i - 1`) reaches `far` whole,
/// and pod `i`'s route to `far` learned the narrow link's [`MTU`].
fn large_answer_arrives(env: &Env, far: &str, far_ip: IpAddr, i: usize) -> Result<()> {
    let lb = env.lb(i - 1);
    let got = eventually(SETTLE, || {
        let got = fetch(far, lb, WEB, Duration::from_secs(5))?;
        ensure!(got > 0, "nothing of the answer arrived");
        Ok(got)
    })?;
    let route = ok_in(&env.pod_ns(i), &["ip", "route", "get", &far_ip.to_string()])?;
    ensure!(
        got == ANSWER,
        "{got} of {ANSWER} bytes through the {MTU}-byte link; pod{i}'s route: {route}"
    );
    ensure!(
        route.contains(&format!("mtu {MTU}")),
        "the answer arrived but pod{i} learned no smaller MTU (no error on the path?): {route}"
    );
    Ok(())
}
