//! Scenarios 1-6: passthrough (wholeIP "true" or absent).
use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit::scenario::WEB;
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    traffic::{
        conntrack, echo_requests_received, eventually, ping, send_raw, tcp_request, RawReceiver,
        Server, SETTLE,
    },
    Backend, Env,
};

fn vm1(env: &mut Env) -> Result<()> {
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle().map(|_| ())
}

/// Scenario 1: ping LB_IP from ext reaches pod1; the reply comes from LB_IP.
pub fn s01_ping(env: &mut Env) -> Result<()> {
    vm1(env)?;
    let before = echo_requests_received(&env.pod_ns(1), env.fam())?;
    env.ping_answered(env.lb(0))?;
    let after = echo_requests_received(&env.pod_ns(1), env.fam())?;
    ensure!(
        after > before,
        "pod1 received no echo request ({before} -> {after})"
    );
    Ok(())
}

/// Scenario 2: TCP to LB_IP on any port reaches pod1; UDP likewise. On the
/// XDP path, the XDP program on the uplink handed them to pod1.
pub fn s02_any_port(env: &mut Env) -> Result<()> {
    vm1(env)?;
    let redirected = env.xdp_verdicts()?.0;
    let mut servers = Vec::new();
    for port in [22, WEB, 65000] {
        servers.push(env.serve_tcp(1, port)?);
    }
    for port in [53, 5353] {
        servers.push(env.serve_udp(1, port)?);
    }
    for port in [22, WEB, 65000] {
        env.tcp_reaches(env.lb(0), port, 1)?;
    }
    for port in [53, 5353] {
        env.udp_reaches(env.lb(0), port, 1)?;
    }
    if env.backend == Backend::EbpfXdp {
        let now = env.xdp_verdicts()?.0;
        ensure!(
            now > redirected,
            "the XDP program redirected nothing ({redirected} -> {now})"
        );
    }
    Ok(())
}

/// Scenario 3: A protocol other than TCP/UDP/ICMP (raw IP protocol 253) reaches pod1.
pub fn s03_other_protocol(env: &mut Env) -> Result<()> {
    vm1(env)?;
    let rx = RawReceiver::start(&env.pod_ns(1), env.fam(), 253, env.scratch("raw"))?;
    let marker = "cozy-raw-marker";
    eventually(SETTLE, || {
        send_raw(&env.topo.ext(), env.lb(0), 253, marker)?;
        std::thread::sleep(std::time::Duration::from_millis(200));
        ensure!(
            rx.received().contains(marker),
            "pod1 did not receive the protocol-253 datagram"
        );
        Ok(())
    })
}

/// Scenario 4: pod1 connects out: the server sees LB_IP and the exchange completes.
pub fn s04_egress_source(env: &mut Env) -> Result<()> {
    vm1(env)?;
    env.egress_seen_as(1, env.lb(0))
}

/// Scenario 5: pod2 (unmanaged) is masqueraded going out and untouched coming in.
pub fn s05_unmanaged_pod(env: &mut Env) -> Result<()> {
    vm1(env)?;
    env.egress_seen_as(2, env.net.node)?;
    let _srv = env.serve_tcp(2, WEB)?;
    env.tcp_reaches(env.pod_ip(2), WEB, 2)
}

/// Scenario 6: The host's conntrack has one entry per connection of 1, 2 and 4, and
/// none mentions the pod's own address (no half-translated duplicate). With the
/// eBPF fast path, the stack sees none of them at all.
pub fn s06_conntrack_one_entry(env: &mut Env) -> Result<()> {
    vm1(env)?;
    let _web = env.serve_tcp(1, WEB)?;
    let ext = env.topo.ext();
    let _out = Server::tcp(&ext, env.fam(), 7000, "ext")?;
    // Warm up (ARP/ND), then start from an empty table and make each flow
    // exactly once: a retried attempt would be a second connection.
    env.ping_answered(env.lb(0))?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    eventually(SETTLE, || tcp_request(&env.pod_ns(1), env.net.ext, 7000))?;
    let node = env.topo.node();
    // One round of exactly one flow each on an empty table; a round in
    // which an exchange fails (a busy machine) is started over, from a
    // flushed table again, so a retry never counts twice.
    eventually(SETTLE, || {
        cozy_proxy_testkit::sh::ok_in(&node, &["conntrack", "-F"])?;
        ping(&ext, env.lb(0))?;
        tcp_request(&ext, env.lb(0), WEB)?;
        tcp_request(&env.pod_ns(1), env.net.ext, 7000)
    })?;
    let fam = env.fam();
    let icmp = if fam == cozy_proxy_testkit::nodes::net::Fam::V4 {
        "icmp"
    } else {
        "icmpv6"
    };
    // The fast path hands these flows on without the stack: conntrack
    // sees none of them. Otherwise each is one whole entry.
    let expected = if env.backend.fast() { 0 } else { 1 };
    for (what, filter) in [
        ("ping", vec!["-p", icmp]),
        ("ingress TCP", vec!["-p", "tcp", "--dport", "8080"]),
        ("egress TCP", vec!["-p", "tcp", "--dport", "7000"]),
    ] {
        let entries = conntrack(&node, fam, &filter)?;
        ensure!(
            entries.len() == expected,
            "{what}: expected {expected} conntrack entries, got {entries:#?}"
        );
    }
    let pod = env.pod_ip(1).to_string();
    for flag in ["--orig-src", "--orig-dst", "--reply-src", "--reply-dst"] {
        let entries = conntrack(&node, fam, &[flag, &pod]).context("conntrack")?;
        ensure!(
            entries.is_empty(),
            "conntrack entries with {flag} {pod}: {entries:#?}"
        );
    }
    Ok(())
}
