//! A VM's LB IP through its live migration, on two routed nodes in network
//! namespaces, one real `cozy-proxy` per node, both backends, both
//! families, passthrough and port filter (docs/traffic.md, "A VM's live
//! migration"). The windows of a KubeVirt migration, as their objects and
//! the network show them:
//!
//! | window | the EndpointSlice | the VM runs on | the LB IP announced from |
//! |---|---|---|---|
//! | W0 | S ready (node1) | node1 | node1 |
//! | W1 | S ready; T starting (node2) | node1 | node1 |
//! | failed | S ready (T removed) | node1 | node1 |
//! | W2 | S ready; T starting | **node2** | node1 |
//! | W3 | S and T ready | node2 | node2 |
//! | W4 | S ending, then T alone | node2 | node2 |
//!
//! (The failed migration first, then one that succeeds.) The announcer is
//! the outside router's route to the LB IP, moved as MetalLB's L2
//! announcement moves. Through every window: a UDP request/reply stream
//! each way (100 datagrams a second) and a TCP connection held each way;
//! at each window, new connections from outside through the LB IP, the
//! VM's own connections out, in-cluster clients on both nodes by LB IP and
//! by pod IP, and (port filter) an unlisted port closed. Needs root.
use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit::{
    control_plane::k8s::api_service,
    control_plane::metallb::MetalLb,
    controller::manifests::Svc,
    nodes::cluster::{pod, Cluster, ClusterShape, ClusterSource},
    nodes::migration::{launchers_slice, put_launcher_pods, vm_ip, Launcher, Vm},
    nodes::net::Fam,
    nodes::topology::cmd,
    sh::ok,
    traffic::flows::{Datagram, Echo, HeldTcp, UdpStream},
    traffic::{eventually, tcp_request, Server, SETTLE},
    Backend,
};
use std::{
    fmt::Write as _,
    net::IpAddr,
    time::{Duration, Instant},
};

/// Exchanges with socat (new connections at each window).
const PORT: u16 = 8080;
/// The streams and held connections.
const FLOW: u16 = 8081;
/// Not listed by the port filter.
const UNLISTED: u16 = 8082;
/// The VM's own connections out.
const OUT: u16 = 7000;
const EVERY: Duration = Duration::from_millis(10);
/// Datagrams a window may lose: those of the instant the VM's interface
/// moves (W2: until the route notification reaches the nodes and their
/// datapaths follow), and nothing anywhere else. Measured at 100/s: 10-90
/// ms on an idle machine (1-9 datagrams), up to 230 ms with two busy
/// loops on the 2 cores (17-23). A notification missed waits for the next
/// resync (2 s here: up to 200), far above the bound.
const MOVE_LOSS: usize = 30;

/// The Service, in the manifests; with a real API also through it, as a
/// user creates it (`externalTrafficPolicy: Local`, as Cozystack's), and
/// MetalLB allocates its LB IP from its pool.
fn put_service(c: &Cluster, svc: &Svc) -> Result<()> {
    c.dir.put("vm", &svc.yaml())?;
    let Some(api) = &c.api else {
        return Ok(());
    };
    let mut service = api_service(svc, c.net.address_type());
    service["spec"]["externalTrafficPolicy"] = "Local".into();
    api.cp.apply(&service.to_string())?;
    let got = eventually(SETTLE, || MetalLb::allocated(&api.cp, "vm"))
        .with_context(|| api.metallb.log_tails())?;
    ensure!(got == c.lb(0), "MetalLB allocated {got}, not {}", c.lb(0));
    Ok(())
}

/// The launchers' EndpointSlice, in the manifests; with a real API, their
/// pods through it (the EndpointSlice controller writes the slice).
fn put_launchers(c: &Cluster, pods: &[Launcher]) -> Result<()> {
    c.dir
        .put("vm-endpoints", &launchers_slice("vm", c.fam(), pods))?;
    match &c.api {
        Some(api) => put_launcher_pods(&api.cp, "vm", c.fam(), pods),
        None => Ok(()),
    }
}

/// The node MetalLB announces the LB IP from, among `candidates` (the
/// nodes with a ready or serving endpoint, `externalTrafficPolicy:
/// Local`): the first in the order of sha256("<node>#<ip>").
fn metallb_choice(c: &Cluster, candidates: &[usize]) -> Result<usize> {
    let digest = |k: &usize| -> Result<String> {
        let input = format!("node{k}#{}", c.lb(0));
        let out = ok(&["sh", "-c", &format!("printf %s '{input}' | sha256sum")])?;
        Ok(out
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string())
    };
    let mut ranked = Vec::new();
    for k in candidates {
        ranked.push((digest(k)?, *k));
    }
    ranked.sort();
    ranked.first().map(|r| r.1).context("no candidate node")
}

/// The L2 announcement among `candidates`. With manifests, the outside
/// router's route to the LB IP goes toward the node MetalLB would choose;
/// with a real MetalLB, its speakers choose and the router finds the LB
/// IP by ARP or NDP: waits until the ServiceL2Status names that node.
fn announce(c: &Cluster, candidates: &[usize]) -> Result<()> {
    let k = metallb_choice(c, candidates)?;
    let Some(api) = &c.api else {
        let len = if c.fam() == Fam::V4 { 32 } else { 128 };
        return cmd(
            &c.topo.ext(),
            &format!("ip route replace {}/{len} via {}", c.lb(0), c.net.node(k)),
        );
    };
    let want = vec![format!("node{k}")];
    eventually(SETTLE, || {
        let got = MetalLb::announcers(&api.cp, "vm")?;
        ensure!(got == want, "MetalLB announces from {got:?}, not {want:?}");
        Ok(())
    })
    .with_context(|| api.metallb.log_tails())
}

/// What must hold in every window.
fn check(c: &Cluster, vm: &Vm, filtered: bool) -> Result<()> {
    let (ext, lb, vip) = (c.topo.ext(), c.lb(0), vm_ip(c.fam()));
    c.exchange(&ext, lb, PORT, "vm", c.net.ext())
        .context("outside -> LB IP")?;
    c.exchange(&vm.ns, c.net.ext(), OUT, "ext", lb)
        .context("the VM's own connection out")?;
    for client in [pod(1, 1), pod(2, 1)] {
        let (ns, own) = (c.pod_ns(client), c.pod_ip(client));
        c.exchange(&ns, lb, PORT, "vm", own)
            .with_context(|| format!("{ns} -> LB IP"))?;
        // On a bridge, node1's pods have the VM's IP on their own
        // segment: once it left, they look for it there, on the link, and
        // only the network's proxy ARP (not a bridge CNI's) would answer.
        if c.topo.shape == ClusterShape::Bridge && client.node == 1 && vm.on != 1 {
            continue;
        }
        c.exchange(&ns, vip, PORT, "vm", own)
            .with_context(|| format!("{ns} -> the VM's pod IP"))?;
    }
    match filtered {
        true => {
            let unlisted = tcp_request(&ext, lb, UNLISTED);
            ensure!(unlisted.is_err(), "unlisted port open: {unlisted:?}");
        }
        false => {
            eventually(SETTLE, || tcp_request(&ext, lb, UNLISTED)).context("any port passes")?;
        }
    }
    Ok(())
}

/// Each node's word on mapping `lb`, which both nodes' endpoints hold,
/// in the metric `cozy_proxy_mapping_on_several_nodes` and in `cozy-proxy
/// dump`: node `translating` translates it, the other steers it there,
/// saying the route leads there.
fn decided(c: &Cluster, lb: IpAddr, translating: usize) -> Result<()> {
    let via = c.net.node(translating);
    for k in 1..=2 {
        let (_, metrics) = c.ctls[k - 1].http("/metrics")?;
        let line = (metrics.lines())
            .find(|l| l.starts_with("cozy_proxy_mapping_on_several_nodes{"))
            .with_context(|| format!("node{k}: no mapping on several nodes"))?;
        let want = match k == translating {
            true => "translated_here=\"true\"".to_string(),
            false => {
                format!("translated_here=\"false\",why=\"route via {via} (node{translating})\"")
            }
        };
        ensure!(line.contains(&want), "node{k}: {line}, expected {want}");
        let dump = c.dump_json(k)?;
        let placed = (dump["placement"].as_array().into_iter().flatten())
            .find(|p| p["lb_ip"] == lb.to_string())
            .with_context(|| format!("node{k}: dump places no {lb}: {dump}"))?;
        let (here, why) = match k == translating {
            true => (
                "translated".to_string(),
                "endpoint here; no route to the pod leads to another of its nodes".to_string(),
            ),
            false => (
                format!("steered via {via}"),
                format!("route via {via} (node{translating})"),
            ),
        };
        ensure!(
            placed["here"] == here.as_str()
                && placed["why"] == why.as_str()
                && placed["nodes"] == "node1,node2",
            "node{k}: dump says {placed}, expected here {here:?}, why {why:?}"
        );
    }
    Ok(())
}

/// Per window: datagrams sent, and those lost (no answer, or an answer
/// that does not come from or was not seen as `want`).
fn losses(
    log: &[Datagram],
    windows: &[(&str, Instant)],
    ok: impl Fn(&Datagram) -> bool,
) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (i, (name, from)) in windows.iter().enumerate() {
        let to = windows.get(i + 1).map(|w| w.1);
        let sent: Vec<&Datagram> = (log.iter())
            .filter(|d| d.sent >= *from && to.is_none_or(|t| d.sent < t))
            .collect();
        let lost = sent.iter().filter(|d| !ok(d)).count();
        out.push((name.to_string(), sent.len(), lost));
    }
    out
}

fn migration(backend: Backend, fam: Fam, filtered: bool) -> Result<()> {
    on_shape(ClusterShape::Routed, backend, fam, filtered)
}

fn on_shape(shape: ClusterShape, backend: Backend, fam: Fam, filtered: bool) -> Result<()> {
    from_source(ClusterSource::Manifests, shape, backend, fam, filtered)
}

fn from_source(
    source: ClusterSource,
    shape: ClusterShape,
    backend: Backend,
    fam: Fam,
    filtered: bool,
) -> Result<()> {
    let mut c = Cluster::with_source(backend, fam, shape, source)?;
    let run = |c: &mut Cluster| -> Result<String> { migrate(c, filtered, false) };
    run(&mut c).map_err(|e| anyhow::anyhow!("{e:#}\n{}", c.logs()))?;
    Ok(())
}

/// The original Go cozy-proxy's ruleset (../shared/reference/original-nft.md,
/// IPv4 only), on both nodes in place of ours: every node translates every
/// mapping, statelessly, and filters after conntrack. It has no
/// steering, no anti-spoofing and nothing for in-cluster clients.
fn original_ruleset(vm: IpAddr, lb: IpAddr, filtered: bool) -> String {
    let filter = match filtered {
        true => format!(
            "  set filtered_pods {{ type ipv4_addr; elements = {{ {vm} }} }}\n\
             \x20 set allowed_ports {{ type ipv4_addr . inet_proto . inet_service; elements = {{ \
             {vm} . tcp . {PORT}, {vm} . udp . {PORT}, {vm} . tcp . {FLOW}, {vm} . udp . {FLOW} }} }}\n"
        ),
        false => "  set filtered_pods { type ipv4_addr; }\n  set allowed_ports { type ipv4_addr . inet_proto . inet_service; }\n".into(),
    };
    format!(
        "table ip cozy_proxy {{\n\
         \x20 map pod_svc {{ type ipv4_addr : ipv4_addr; elements = {{ {vm} : {lb} }} }}\n\
         \x20 map svc_pod {{ type ipv4_addr : ipv4_addr; elements = {{ {lb} : {vm} }} }}\n\
         {filter}\
         \x20 chain egress_snat {{ type filter hook prerouting priority raw; ip saddr set ip saddr map @pod_svc; }}\n\
         \x20 chain ingress_dnat {{ type filter hook prerouting priority mangle; ip daddr set ip daddr map @svc_pod; }}\n\
         \x20 chain port_filter {{ type filter hook prerouting priority filter; ct state established,related accept; \
         ip daddr @filtered_pods ip daddr . meta l4proto . th dport != @allowed_ports drop; }}\n}}\n"
    )
}

/// The windows with the original ruleset in place of ours: what it loses
/// (measured, not asserted; docs/traffic.md has the table).
fn original(filtered: bool) -> Result<()> {
    let mut c = Cluster::with_shape(Backend::Nft, Fam::V4, ClusterShape::Routed)?;
    for k in 1..=2 {
        c.ctl(k).stop()?;
        let ns = c.topo.node(k);
        cozy_proxy_testkit::sh::ok_in(&ns, &[&cozy_proxy_testkit::bin(), "cleanup"])?;
        let rules = original_ruleset(vm_ip(Fam::V4), c.lb(0), filtered);
        let out = cozy_proxy_testkit::sh::feed_in(&ns, &["nft", "-f", "-"], rules.as_bytes(), 5)?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    migrate(&mut c, filtered, true).map(|_| ())
}

/// The migration's windows on cluster `c`. `original`: the original
/// ruleset runs the nodes; nothing is checked, the losses are reported.
fn migrate(c: &mut Cluster, filtered: bool, original: bool) -> Result<String> {
    let fam = c.fam();
    let v6 = fam == Fam::V6;
    let (ext, lb, ext_ip) = (c.topo.ext(), c.lb(0), c.net.ext());
    let mut vm = Vm::start(c)?;
    let _servers = (
        c.serve(&vm.ns, PORT, "vm")?,
        Server::tcp(&vm.ns, fam, UNLISTED, "vm")?,
        c.serve(&ext, OUT, "ext")?,
    );
    let _echo = (
        Echo::start(&vm.ns, v6, FLOW, "vm")?,
        Echo::start(&ext, v6, FLOW, "ext")?,
    );
    let mut svc = Svc::new("vm", lb);
    if filtered {
        svc = svc.filter(&[("TCP", PORT), ("UDP", PORT), ("TCP", FLOW), ("UDP", FLOW)]);
    }
    put_service(c, &svc)?;
    put_launchers(c, &[Launcher::ready(1)])?;
    announce(c, &[1])?;
    if !original {
        c.settle()?;
        check(c, &vm, filtered).context("W0, before the streams")?;
    }

    let inbound = UdpStream::start(&ext, lb, FLOW, EVERY)?;
    let outbound = UdpStream::start(&vm.ns, ext_ip, FLOW, EVERY)?;
    let held_in = HeldTcp::start(&ext, lb, FLOW, Duration::from_millis(50))?;
    let held_out = HeldTcp::start(&vm.ns, ext_ip, FLOW, Duration::from_millis(50))?;
    let mut windows: Vec<(&str, Instant)> = vec![("W0", Instant::now())];
    let window = |c: &mut Cluster, name: &'static str, vm: &Vm| -> Result<()> {
        if original {
            // As long as a window takes with the checks.
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        c.settle().with_context(|| format!("{name}: datapaths"))?;
        if name.starts_with("W1") || name == "W2" || name == "W3" {
            eventually(SETTLE, || decided(c, lb, vm.on)).with_context(|| name.to_string())?;
        }
        check(c, vm, filtered).with_context(|| name.to_string())?;
        // Traffic in the window beyond the checks.
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    };
    window(c, "W0", &vm)?;

    windows.push(("W1", Instant::now()));
    put_launchers(c, &[Launcher::ready(1), Launcher::starting(2)])?;
    vm.target(2)?;
    window(c, "W1", &vm)?;

    windows.push(("failed", Instant::now()));
    vm.target_gone(2)?;
    put_launchers(c, &[Launcher::ready(1)])?;
    window(c, "failed", &vm)?;

    windows.push(("W1 again", Instant::now()));
    put_launchers(c, &[Launcher::ready(1), Launcher::starting(2)])?;
    vm.target(2)?;
    window(c, "W1 again", &vm)?;

    windows.push(("W2", Instant::now()));
    vm.move_to(c, 2)?;
    window(c, "W2", &vm)?;

    windows.push(("W3", Instant::now()));
    put_launchers(c, &[Launcher::ready(1), Launcher::ready(2)])?;
    announce(c, &[1, 2])?;
    window(c, "W3", &vm)?;

    windows.push(("W4", Instant::now()));
    put_launchers(c, &[Launcher::ending(1), Launcher::ready(2)])?;
    announce(c, &[2])?;
    window(c, "W4", &vm)?;
    put_launchers(c, &[Launcher::ready(2)])?;
    window(c, "W4", &vm)?;

    let linger = Duration::from_millis(500);
    // Both stop sending together, then every datagram has `linger` for
    // its answer.
    inbound.stop_sending();
    outbound.stop_sending();
    let (inbound, outbound) = (inbound.finish(linger), outbound.finish(Duration::ZERO));
    let (held_in, held_out) = (held_in.finish(), held_out.finish());
    let from_lb = |d: &Datagram| d.answer.as_ref().is_some_and(|(_, from)| *from == lb);
    let seen_as_lb = |d: &Datagram| {
        (d.answer.as_ref()).is_some_and(|(text, _)| text.ends_with(&format!(" {lb}")))
    };
    let rows_in = losses(&inbound, &windows, from_lb);
    let rows_out = losses(&outbound, &windows, seen_as_lb);
    let mut table = String::from("| window | in: sent | in: lost | out: sent | out: lost |\n");
    for (i, o) in rows_in.iter().zip(&rows_out) {
        let _ = writeln!(table, "| {} | {} | {} | {} | {} |", i.0, i.1, i.2, o.1, o.2);
    }
    for (what, held) in [("in", &held_in), ("out", &held_out)] {
        let during = held
            .stall_ended
            .and_then(|t| windows.iter().rev().find(|w| w.1 <= t));
        let _ = writeln!(
            table,
            "held {what}: {} answers, longest stall {:?} (ending in {}), far end saw {:?}, broken: {:?}",
            held.answered,
            held.longest_stall,
            during.map_or("-", |w| w.0),
            held.seen,
            held.broken
        );
    }
    let runs = if original {
        "original".into()
    } else {
        format!("{:?}", c.backend)
    };
    println!("{runs} {fam:?} filtered={filtered}\n{table}");
    if original {
        return Ok(table);
    }
    for (name, sent, lost) in rows_in.iter().chain(&rows_out) {
        let allowed = if name == "W2" { MOVE_LOSS } else { 0 };
        ensure!(
            *lost <= allowed && *sent > 0,
            "window {name}: {lost} of {sent} datagrams lost (at most {allowed})\n{table}"
        );
    }
    for (what, held, seen) in [("inbound", &held_in, ext_ip), ("outbound", &held_out, lb)] {
        ensure!(
            held.broken.is_none() && held.answered > 0,
            "the {what} TCP connection broke\n{table}"
        );
        ensure!(
            held.seen.as_deref() == Some(&*seen.to_string()),
            "the {what} connection's far end saw {:?}, not {seen}\n{table}",
            held.seen
        );
        ensure!(
            held.longest_stall < Duration::from_secs(1),
            "the {what} connection stalled {:?}\n{table}",
            held.longest_stall
        );
    }
    Ok(table)
}

cozy_proxy_testkit::cases! { migration;
    nft_v4_passthrough: Backend::Nft, Fam::V4, false;
    nft_v4_port_filter: Backend::Nft, Fam::V4, true;
    nft_v6_passthrough: Backend::Nft, Fam::V6, false;
    nft_v6_port_filter: Backend::Nft, Fam::V6, true;
    ebpf_v4_passthrough: Backend::Ebpf, Fam::V4, false;
    ebpf_v4_port_filter: Backend::Ebpf, Fam::V4, true;
    ebpf_v6_passthrough: Backend::Ebpf, Fam::V6, false;
    ebpf_v6_port_filter: Backend::Ebpf, Fam::V6, true;
    ebpf_fast_v4_passthrough: Backend::EbpfFast, Fam::V4, false;
    ebpf_fast_v4_port_filter: Backend::EbpfFast, Fam::V4, true;
    ebpf_fast_v6_passthrough: Backend::EbpfFast, Fam::V6, false;
    ebpf_fast_v6_port_filter: Backend::EbpfFast, Fam::V6, true;
}

/// Nodes with a pod bridge (Flannel, kindnet): the VM a port of each
/// node's bridge, its frames judged at the port it enters by.
mod bridge {
    use super::*;

    fn bridged(backend: Backend, fam: Fam) -> Result<()> {
        on_shape(ClusterShape::Bridge, backend, fam, true)
    }

    cozy_proxy_testkit::cases! { bridged;
        nft_v4_port_filter: Backend::Nft, Fam::V4;
        nft_v6_port_filter: Backend::Nft, Fam::V6;
        ebpf_v4_port_filter: Backend::Ebpf, Fam::V4;
        ebpf_v6_port_filter: Backend::Ebpf, Fam::V6;
    }
}

/// With the real API server, EndpointSlice controller and MetalLB: the
/// launcher pods written through the API, MetalLB allocating the LB IP
/// and announcing it (the outside router finds it by ARP or NDP), each
/// backend and family once, each mode twice.
mod real_api {
    use super::*;

    fn through_the_api(backend: Backend, fam: Fam, filtered: bool) -> Result<()> {
        from_source(
            ClusterSource::RealApi,
            ClusterShape::Routed,
            backend,
            fam,
            filtered,
        )
    }

    cozy_proxy_testkit::cases! { through_the_api;
        nft_v4_passthrough: Backend::Nft, Fam::V4, false;
        nft_v6_port_filter: Backend::Nft, Fam::V6, true;
        ebpf_v4_port_filter: Backend::Ebpf, Fam::V4, true;
        ebpf_v6_passthrough: Backend::Ebpf, Fam::V6, false;
    }
}

/// The same windows with the original ruleset: a measurement for
/// docs/traffic.md (`cargo test --test migration -- --ignored original`).
#[test]
#[ignore = "a measurement of the original ruleset, not a check of ours"]
fn original_v4_passthrough() {
    if let Err(e) = original(false) {
        panic!("{e:#}");
    }
}

#[test]
#[ignore = "a measurement of the original ruleset, not a check of ours"]
fn original_v4_port_filter() {
    if let Err(e) = original(true) {
        panic!("{e:#}");
    }
}
