//! Scenarios 21-28: cluster traffic on two nodes (docs/traffic.md). A is
//! node1's pod1 behind LB 0; B is node2's pod1 behind LB 1; Q1 and Q2 are
//! unmapped pods (in-cluster clients) on node1 and node2.
use anyhow::{bail, ensure, Context, Result};
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    nodes::cluster::{pod, Cluster, ClusterShape, Pod},
    nodes::net::Fam,
    sh::{feed_in, ok_in, run_in, Proc},
    traffic::{conntrack, eventually, ping, tcp_request, udp_flow, udp_request, Server, SETTLE},
    Backend,
};
use std::{net::IpAddr, process::Stdio, time::Duration};

const A: Pod = pod(1, 1);
const B: Pod = pod(2, 1);
const C: Pod = pod(1, 3);
const Q1: Pod = pod(1, 2);
const Q2: Pod = pod(2, 2);
const PORT: u16 = 8080;

/// A Service for `p` on LB `i`: passthrough, or filtered to PORT (TCP and
/// UDP) with ICMP allowed.
fn service(c: &Cluster, name: &str, i: usize, p: Pod, filtered: bool) -> Result<()> {
    let mut svc = Svc::new(name, c.lb(i));
    if filtered {
        svc = svc.filter(&[("TCP", PORT), ("UDP", PORT)]);
        svc.allow_icmp = Some("true".into());
    }
    c.put_service(&svc, p)
}

fn ident(p: Pod) -> String {
    format!("n{}p{}", p.node, p.index)
}

fn serve(c: &Cluster, p: Pod) -> Result<(Server, Server)> {
    c.serve(&c.pod_ns(p), PORT, &ident(p))
}

/// The next hop of `ns`'s route to `dst`.
fn gateway_toward(ns: &str, dst: IpAddr) -> Result<IpAddr> {
    route_field(ns, dst, "gateway")
}

/// The source address `ns`'s route to `dst` picks.
fn source_toward(ns: &str, dst: IpAddr) -> Result<IpAddr> {
    route_field(ns, dst, "prefsrc")
}

fn route_field(ns: &str, dst: IpAddr, field: &str) -> Result<IpAddr> {
    let out = ok_in(ns, &["ip", "-j", "route", "get", &dst.to_string()])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v[0][field]
        .as_str()
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("{field} of the route to {dst} in {ns}: {out}"))
}

/// Scenario 21: the node connects to a mapped pod's own IP (a kubelet
/// probe, TCP and HTTP), in both modes, also to a port the filter does not
/// list: it works, the replies keep the pod IP. No configuration needed.
pub fn s21_node_probes_the_pod(c: &mut Cluster) -> Result<()> {
    let _web = serve(c, A)?;
    let http = Proc::spawn_in(
        &c.pod_ns(A),
        &[
            "socat",
            &match c.fam() {
                Fam::V4 => "TCP4-LISTEN:8081,reuseaddr,fork".to_string(),
                Fam::V6 => "TCP6-LISTEN:8081,reuseaddr,fork".to_string(),
            },
            // The request read first: see `Server::tcp`.
            "SYSTEM:read request; echo HTTP/1.0 200 OK; echo; echo healthy",
        ],
        Stdio::null(),
        Stdio::null(),
    )?;
    for filtered in [false, true] {
        service(c, "a", 0, A, filtered)?;
        c.settle()?;
        let node1 = c.topo.node(1);
        let src = source_toward(&node1, c.pod_ip(A))?;
        c.exchange(&node1, c.pod_ip(A), PORT, &ident(A), src)?;
        let url = match c.pod_ip(A) {
            IpAddr::V4(a) => format!("http://{a}:8081/"),
            IpAddr::V6(a) => format!("http://[{a}]:8081/"),
        };
        let body = eventually(SETTLE, || {
            ok_in(&node1, &["curl", "-sS", "-f", "--max-time", "2", &url])
        })?;
        ensure!(body.trim() == "healthy", "HTTP probe answered {body:?}");
        // A host agent on the other node, to the pod IP: as itself (the
        // address its route to the pod picks: the uplink's, in an overlay
        // the tunnel's, behind a router its join address).
        if !filtered {
            let node2 = c.topo.node(2);
            let src = source_toward(&node2, c.pod_ip(A))?;
            c.exchange(&node2, c.pod_ip(A), PORT, &ident(A), src)?;
        }
    }
    drop(http);
    Ok(())
}

/// Scenario 22: other pods, on the same node and on the other, reach a
/// mapped pod by its pod IP, and it reaches them: each sees the other's
/// pod IP.
pub fn s22_pods_reach_a_mapped_pod_by_its_ip(c: &mut Cluster) -> Result<()> {
    let _a = serve(c, A)?;
    let _q2 = serve(c, Q2)?;
    for filtered in [false, true] {
        service(c, "a", 0, A, filtered)?;
        c.settle()?;
        for q in [Q1, Q2] {
            c.exchange(&c.pod_ns(q), c.pod_ip(A), PORT, &ident(A), c.pod_ip(q))?;
        }
        c.exchange(&c.pod_ns(A), c.pod_ip(Q2), PORT, &ident(Q2), c.pod_ip(A))?;
    }
    Ok(())
}

/// Scenario 23: other pods, same node and other node, reach the mapped
/// pod's LB IP: it works (the reply comes from the LB IP: the client's
/// socket is connected to it), and the pod sees the client's pod IP (behind
/// Kube-OVN's router, the client's node's join address: the hairpin is
/// masqueraded). The nodes' own sockets reach it too, and so does a client
/// the node has redirected to the pod ([`redirected_client`]).
pub fn s23_pods_reach_a_mapped_pod_by_its_lb_ip(c: &mut Cluster) -> Result<()> {
    let _a = serve(c, A)?;
    for filtered in [false, true] {
        service(c, "a", 0, A, filtered)?;
        c.settle()?;
        if !filtered {
            redirected_client(c)?;
        }
        for q in [Q1, Q2] {
            c.exchange(&c.pod_ns(q), c.lb(0), PORT, &ident(A), seen_by_a(c, q)?)?;
        }
        for k in 1..=2 {
            let node = c.topo.node(k);
            let got = eventually(SETTLE, || tcp_request(&node, c.lb(0), PORT))?;
            ensure!(got.starts_with(&ident(A)), "node{k} -> LB: {got}");
            eventually(SETTLE, || udp_request(&node, c.lb(0), PORT))?;
        }
    }
    Ok(())
}

/// The address A sees for in-cluster client `q` of its LB IP: `q`'s pod IP
/// (behind Kube-OVN's router, `q`'s node's join address: the hairpin is
/// masqueraded).
fn seen_by_a(c: &Cluster, q: Pod) -> Result<IpAddr> {
    match c.topo.shape {
        ClusterShape::Gateway => source_toward(&c.topo.node(q.node), c.pod_ip(A)),
        _ => Ok(c.pod_ip(q)),
    }
}

/// Scenario 23, a client the node has redirected to the pod: where the
/// client and the pod are ports of one bridge, the node routes the LB IP
/// back out of the bridge the client came in by and tells the client so
/// with an ICMP redirect. The kernel sends one about a flow past its first
/// packet, backing off between them, and never about a NATed flow (nft's
/// are: its DNAT); the client applies it once it holds the pod's neighbour
/// entry; IPv6 sends none here (the route's gateway is no link-local
/// address). The client's later flows cross the bridge to the pod's port
/// without passing the node's stack, and still come back from the LB IP.
fn redirected_client(c: &Cluster) -> Result<()> {
    let q = c.pod_ns(Q1);
    let seen = seen_by_a(c, Q1)?;
    eventually(SETTLE, || ping(&q, c.pod_ip(A)))?;
    udp_flow(&q, c.lb(0), PORT, 20, Duration::from_millis(50))?;
    let redirects = matches!(c.topo.shape, ClusterShape::Bridge | ClusterShape::Overlay)
        && c.fam() == Fam::V4
        && c.backend != Backend::Nft;
    if redirects {
        let gw = gateway_toward(&q, c.lb(0));
        ensure!(
            gw.as_ref().ok() == Some(&c.pod_ip(A)),
            "{q} not redirected to the pod for the LB IP: its gateway {gw:?}"
        );
    }
    c.exchange(&q, c.lb(0), PORT, &ident(A), seen)
}

/// Scenario 24: a mapped pod keeps its pod IP toward the cluster (a pod on
/// the other node; the other node itself, where it is treated exactly as an
/// unmapped pod of its node: seen as the address the CNI gives that pod,
/// its node's where the CNI masquerades pod traffic to node addresses, as
/// Calico's natOutgoing and Flannel's ipMasq do, else its own) and shows
/// its LB IP to the outside and to other LB IPs.
pub fn s24_a_mapped_pods_destinations(c: &mut Cluster) -> Result<()> {
    service(c, "a", 0, A, false)?;
    service(c, "b", 1, B, false)?;
    c.settle()?;
    let _q2 = serve(c, Q2)?;
    let _b = serve(c, B)?;
    let node2 = c.topo.node(2);
    let _node2 = (
        Server::tcp(&node2, c.fam(), 9000, "node2")?,
        Server::udp_at(&node2, c.net.node(2), 9000, "node2")?,
    );
    let _ext = c.serve(&c.topo.ext(), 7000, "ext")?;
    let from = c.pod_ns(A);
    c.exchange(&from, c.pod_ip(Q2), PORT, &ident(Q2), c.pod_ip(A))?;
    let unmapped = eventually(SETTLE, || tcp_request(&c.pod_ns(Q1), c.net.node(2), 9000))?;
    let seen_as = unmapped
        .split_whitespace()
        .nth(1)
        .and_then(|a| a.parse::<IpAddr>().ok())
        .context("node2's answer")?;
    ensure!(seen_as != c.lb(0), "an unmapped pod is seen as the LB IP?");
    let a_seen_as = match seen_as == c.pod_ip(Q1) {
        true => c.pod_ip(A),
        false => seen_as,
    };
    c.exchange(&from, c.net.node(2), 9000, "node2", a_seen_as)?;
    c.exchange(&from, c.net.ext(), 7000, "ext", c.lb(0))?;
    c.exchange(&from, c.lb(1), PORT, &ident(B), c.lb(0))
}

/// Scenario 25: VM to VM, A (node1) and B (node2), and A and C on one node,
/// all filtered (and all passthrough): TCP, UDP and ICMP both ways, each
/// sees the other's LB IP.
pub fn s25_vm_to_vm(c: &mut Cluster) -> Result<()> {
    let servers: Vec<_> = [A, B, C]
        .iter()
        .map(|p| serve(c, *p))
        .collect::<Result<_>>()?;
    for filtered in [true, false] {
        service(c, "a", 0, A, filtered)?;
        service(c, "b", 1, B, filtered)?;
        service(c, "c", 2, C, filtered)?;
        c.settle()?;
        for (x, lx, y, ly) in [(A, 0, B, 1), (B, 1, A, 0), (A, 0, C, 2), (C, 2, A, 0)] {
            c.exchange(&c.pod_ns(x), c.lb(ly), PORT, &ident(y), c.lb(lx))
                .with_context(|| {
                    format!("{} -> LB of {} (filtered {filtered})", ident(x), ident(y))
                })?;
            let from = eventually(SETTLE, || ping(&c.pod_ns(x), c.lb(ly)))?;
            ensure!(
                from == c.lb(ly),
                "ping {} -> {}: reply from {from}",
                ident(x),
                c.lb(ly)
            );
        }
    }
    drop(servers);
    Ok(())
}

/// conntrack entries of node `k` that mention `addr`.
fn entries_with(c: &Cluster, k: usize, addr: IpAddr) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for flag in ["--orig-src", "--orig-dst", "--reply-src", "--reply-dst"] {
        out.extend(conntrack(
            &c.topo.node(k),
            c.fam(),
            &[flag, &addr.to_string()],
        )?);
    }
    Ok(out)
}

/// Scenario 26: outside traffic to LB_A that enters at node2 (not hosting
/// A) reaches A, replies come from LB_A, no loop, and no conntrack entry
/// anywhere is half-translated (none names A's pod IP).
pub fn s26_entering_at_the_other_node(c: &mut Cluster) -> Result<()> {
    for filtered in [false, true] {
        service(c, "a", 0, A, filtered)?;
        c.settle()?;
        let _a = serve(c, A)?;
        let ext = c.topo.ext();
        let lb = c.lb(0).to_string();
        let via = c.net.node(2).to_string();
        match c.fam() {
            Fam::V4 => ok_in(
                &ext,
                &["ip", "route", "replace", &format!("{lb}/32"), "via", &via],
            )?,
            Fam::V6 => ok_in(
                &ext,
                &[
                    "ip",
                    "-6",
                    "route",
                    "replace",
                    &format!("{lb}/128"),
                    "via",
                    &via,
                ],
            )?,
        };
        for k in 1..=2 {
            ok_in(&c.topo.node(k), &["conntrack", "-F"])?;
        }
        c.exchange(&ext, c.lb(0), PORT, &ident(A), c.net.ext())?;
        let from = eventually(SETTLE, || ping(&ext, c.lb(0)))?;
        ensure!(from == c.lb(0), "ping reply from {from}");
        for k in 1..=2 {
            let half = entries_with(c, k, c.pod_ip(A))?;
            ensure!(
                half.is_empty(),
                "node{k} holds half-translated entries: {half:#?}"
            );
        }
        match c.fam() {
            Fam::V4 => ok_in(&ext, &["ip", "route", "del", &format!("{lb}/32")])?,
            Fam::V6 => ok_in(&ext, &["ip", "-6", "route", "del", &format!("{lb}/128")])?,
        };
    }
    Ok(())
}

/// `ip route get` in the pod toward `dst`: the path MTU it learned.
fn learned_mtu(c: &Cluster, p: Pod, dst: IpAddr) -> Result<Option<u32>> {
    let out = ok_in(&c.pod_ns(p), &["ip", "route", "get", &dst.to_string()])?;
    let mut words = out.split_whitespace();
    while let Some(w) = words.next() {
        if w == "mtu" {
            return Ok(words.next().and_then(|m| m.parse().ok()));
        }
    }
    Ok(None)
}

/// A 10 MB TCP upload from pod `p` to far (across the MTU-1400 hop).
fn upload(c: &Cluster, p: Pod) -> Result<()> {
    let target = match c.net.far() {
        IpAddr::V4(a) => format!("TCP4:{a}:9000,connect-timeout=2"),
        IpAddr::V6(a) => format!("TCP6:[{a}]:9000,connect-timeout=2"),
    };
    let zeros = vec![0u8; 10 << 20];
    let out = feed_in(&c.pod_ns(p), &["socat", "-u", "STDIN", &target], &zeros, 30)?;
    ensure!(
        out.status.success(),
        "the upload did not complete ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn offloads(c: &Cluster, p: Pod, on: &str) -> Result<()> {
    let port = c.topo.pod_port(p);
    for (ns, dev) in [
        (c.pod_ns(p), "eth0"),
        (port.0, port.1.as_str()),
        (c.topo.node(p.node), "uplink"),
    ] {
        ok_in(&ns, &["ethtool", "-K", dev, "tx", on])?;
    }
    Ok(())
}

/// Scenario 27: ICMP errors quote translated headers. A router's "too big"
/// about the pod's upload reaches the pod's socket (its path MTU drops and
/// a 10 MB upload across the MTU-1400 hop completes, with transmit checksum
/// offload off and on); an error the pod sends about an inbound flow
/// quotes the LB IP, for an outside client and for in-cluster clients on
/// either node.
pub fn s27_icmp_errors_and_path_mtu(c: &mut Cluster) -> Result<()> {
    service(c, "a", 0, A, false)?;
    c.settle()?;
    let listen = match c.fam() {
        Fam::V4 => "TCP4-LISTEN:9000,reuseaddr,fork",
        Fam::V6 => "TCP6-LISTEN:9000,reuseaddr,fork",
    };
    let _sink = Proc::spawn_in(
        &c.topo.far(),
        &["socat", "-u", listen, "OPEN:/dev/null"],
        Stdio::null(),
        Stdio::null(),
    )?;
    std::thread::sleep(Duration::from_millis(300));
    for offload in ["off", "on"] {
        offloads(c, A, offload)?;
        let flush: &[&str] = match c.fam() {
            Fam::V4 => &["ip", "route", "flush", "cache"],
            Fam::V6 => &["ip", "-6", "route", "flush", "cache"],
        };
        ok_in(&c.pod_ns(A), flush)?;
        upload(c, A).with_context(|| format!("tx checksum offload {offload}"))?;
        let mtu = learned_mtu(c, A, c.net.far())?;
        ensure!(
            mtu == Some(1400),
            "the pod learned path MTU {mtu:?} (offload {offload})"
        );
    }
    offloads(c, A, "off")?;
    // The pod refuses ext's datagram: ext's socket sees the refusal, so the
    // error quoted the LB IP ext sent to.
    match udp_request(&c.topo.ext(), c.lb(0), 7999) {
        Ok(a) => bail!("7999 answered {a:?}"),
        Err(e) => ensure!(
            e.to_string().contains("refused"),
            "the pod's ICMP error did not reach ext's socket: {e}"
        ),
    }
    // So do in-cluster clients' sockets, on the pod's node and the other.
    for q in [Q1, Q2] {
        match udp_request(&c.pod_ns(q), c.lb(0), 7999) {
            Ok(a) => bail!("7999 answered {a:?}"),
            Err(e) => ensure!(
                e.to_string().contains("refused"),
                "the pod's ICMP error did not reach {}'s socket: {e}",
                ident(q)
            ),
        }
    }
    Ok(())
}

/// Scenario 28: the endpoint moves from a pod on node1 to a pod on node2:
/// both directions move on both nodes; the old pod is masqueraded again.
pub fn s28_endpoint_moves_across_nodes(c: &mut Cluster) -> Result<()> {
    let d = pod(2, 3);
    let _a = serve(c, A)?;
    let _d = serve(c, d)?;
    let _ext = c.serve(&c.topo.ext(), 7000, "ext")?;
    service(c, "a", 0, A, false)?;
    c.settle()?;
    let ext = c.topo.ext();
    c.exchange(&ext, c.lb(0), PORT, &ident(A), c.net.ext())?;
    c.exchange(&c.pod_ns(A), c.net.ext(), 7000, "ext", c.lb(0))?;
    service(c, "a", 0, d, false)?;
    c.settle()?;
    // ext still routes the LB IP to node1: it steers it to node2 now.
    c.exchange(&ext, c.lb(0), PORT, &ident(d), c.net.ext())?;
    c.exchange(&c.pod_ns(d), c.net.ext(), 7000, "ext", c.lb(0))?;
    c.exchange(&c.pod_ns(A), c.net.ext(), 7000, "ext", c.net.node(1))?;
    let family = if c.fam() == Fam::V4 { "-4" } else { "-6" };
    let out = run_in(
        &c.topo.node(1),
        &["ip", family, "route", "show", "proto", "249"],
    )?;
    let routes = String::from_utf8_lossy(&out.stdout);
    // Along the path to the pod where it leads to node2 (native routing
    // via node2, the tunnel's far end); behind a router (Kube-OVN), to
    // node2 itself.
    let toward = match c.topo.shape {
        ClusterShape::Gateway => c.net.node(2),
        _ => gateway_toward(&c.topo.node(1), c.pod_ip(d))?,
    };
    ensure!(
        routes.contains(&toward.to_string()),
        "node1 does not steer the LB IP toward node2 ({toward}): {routes}"
    );
    Ok(())
}
