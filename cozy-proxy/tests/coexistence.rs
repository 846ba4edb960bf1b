//! Scenario 33: another agent's programs on the hooks cozy-proxy uses, as
//! Cilium attaches them (a program that ends the chain, `TC_ACT_OK`): tcx
//! links at the head and at the tail of every hook, before cozy-proxy
//! starts, after, and re-attached while it runs (an agent restart); tc
//! filters at priority 1 on the legacy path. In each case ours run first,
//! and the outside reaches the pod through its LB IP and the pod's traffic
//! leaves with its LB IP, both families. Needs root.
use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit::{
    agents::tc_program::{OtherAgent, Place},
    controller::manifests::Svc,
    nodes::net::Fam,
    nodes::topology::Shape,
    scenario::WEB,
    sh::ok_in,
    traffic::{eventually, tcp_request, SETTLE},
    Backend, Env,
};
use serde_json::Value;
use std::time::Duration;

/// The hooks the other agent takes: the uplink's and pod1's.
const DEVS: [&str; 2] = ["uplink", "pod1"];

fn setup(fam: Fam, extra: &[&str]) -> Result<Env> {
    let mut env = Env::new(Backend::Ebpf, fam)?;
    if !extra.is_empty() {
        env.ctl.extra_args = extra.iter().map(|a| a.to_string()).collect();
        env.ctl.restart()?;
    }
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    Ok(env)
}

/// The outside reaches pod1 through its LB IP (seeing the client), and
/// pod1's own traffic leaves with its LB IP.
fn both_ways(env: &Env) -> Result<()> {
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.egress_seen_as(1, env.lb(0))
}

/// `cozy-proxy dump`'s chains: every hook of `DEVS`, ours first, with the
/// other agent's program also there.
fn ours_first(env: &Env) -> Result<Value> {
    let dump = env.dump_json()?;
    let chains = dump["details"]["chains"]
        .as_array()
        .context("chains")?
        .clone();
    for dev in DEVS {
        for hook in ["ingress", "egress"] {
            let c = chains
                .iter()
                .find(|c| c["interface"] == dev && c["hook"] == hook)
                .with_context(|| format!("no chain for {dev} {hook}: {chains:?}"))?;
            ensure!(c["ours_at"] == 0, "ours not first on {dev} {hook}: {c}");
            let progs = c["programs"].as_array().context("programs")?;
            ensure!(
                progs.iter().any(|p| p["name"] == "test_chain_end"),
                "the other agent's program is missing from {dev} {hook}: {c}"
            );
        }
    }
    Ok(Value::Array(chains))
}

fn eventually_first(env: &Env) -> Result<Value> {
    eventually(Duration::from_secs(5), || ours_first(env)).with_context(|| env.ctl.log_text())
}

fn reclaimed(env: &Env) -> Result<u64> {
    let (_, body) = env.controller_http("/metrics")?;
    let line = body
        .lines()
        .find(|l| l.starts_with("cozy_proxy_ebpf_hooks_reclaimed_total "))
        .with_context(|| format!("no reclaimed metric:\n{body}"))?;
    Ok(line.rsplit(' ').next().unwrap_or("0").parse()?)
}

/// Stops the controller and removes what it installed (a node before
/// cozy-proxy is deployed).
fn stop_and_clean(env: &mut Env) -> Result<()> {
    env.ctl.stop()?;
    let pins = env.ctl.pin_dir.display().to_string();
    ok_in(
        &env.topo.node(),
        &[
            &cozy_proxy_testkit::bin(),
            "cleanup",
            "--bpf-pin-dir",
            &pins,
        ],
    )
    .map(|_| ())
}

/// tcx: the other agent at `place` on every hook before cozy-proxy starts,
/// then re-attached at the head while it runs (an agent restart).
fn tcx(fam: Fam, place: Place) -> Result<()> {
    let mut env = setup(fam, &[])?;
    let mut agent = OtherAgent::new()?;
    stop_and_clean(&mut env)?;
    agent.attach_all(&env.topo.node(), &DEVS, place)?;
    env.ctl.restart()?;
    env.settle()?;
    both_ways(&env).context("the other agent attached before the start")?;
    eventually_first(&env)?;
    // The agent restarts: its programs go, and come back at the head.
    let before = reclaimed(&env)?;
    agent.detach_all()?;
    agent.attach_all(&env.topo.node(), &DEVS, Place::TcxHead)?;
    // Ours are first again at the next upkeep (100 ms here): until then
    // the agent's program ends the chain. Traffic is checked once they
    // are (a loaded machine may delay the upkeep past a SYN's first
    // retransmission, and a connection attempt then outlasts the wait).
    eventually_first(&env)?;
    both_ways(&env).context("the other agent re-attached at the head while running")?;
    let after = reclaimed(&env)?;
    ensure!(
        after >= before + 4,
        "reclaimed {before} -> {after}: four hooks were taken"
    );
    // Once more, at the tail: it stays behind ours.
    agent.detach_all()?;
    agent.attach_all(&env.topo.node(), &DEVS, Place::TcxTail)?;
    std::thread::sleep(Duration::from_millis(500));
    ours_first(&env)?;
    both_ways(&env)
}

#[test]
fn tcx_head_v4() -> Result<()> {
    tcx(Fam::V4, Place::TcxHead)
}

#[test]
fn tcx_head_v6() -> Result<()> {
    tcx(Fam::V6, Place::TcxHead)
}

#[test]
fn tcx_tail_v4() -> Result<()> {
    tcx(Fam::V4, Place::TcxTail)
}

#[test]
fn tcx_tail_v6() -> Result<()> {
    tcx(Fam::V6, Place::TcxTail)
}

/// tc filters (`--tc-attach netlink`): the other agent's filter at
/// priority 1 on every hook before cozy-proxy starts, then added again
/// (ahead of ours) while it runs.
fn tc_filters(fam: Fam) -> Result<()> {
    let mut env = setup(fam, &["--tc-attach", "netlink"])?;
    let mut agent = OtherAgent::new()?;
    stop_and_clean(&mut env)?;
    agent.attach_all(&env.topo.node(), &DEVS, Place::TcFilter)?;
    env.ctl.restart()?;
    env.settle()?;
    both_ways(&env).context("the other agent's filters added before the start")?;
    eventually_first(&env)?;
    agent.detach_all()?;
    agent.attach_all(&env.topo.node(), &DEVS, Place::TcFilter)?;
    both_ways(&env).context("the other agent's filters added again while running")?;
    eventually_first(&env)?;
    ensure!(
        reclaimed(&env)? >= 4,
        "four hooks were taken and given back"
    );
    Ok(())
}

#[test]
fn tc_filters_v4() -> Result<()> {
    tc_filters(Fam::V4)
}

#[test]
fn tc_filters_v6() -> Result<()> {
    tc_filters(Fam::V6)
}

/// The controller, restarted, exits naming `needle` (its start refused).
fn refused_start(env: &mut Env, needle: &str) -> Result<()> {
    env.ctl.restart()?;
    eventually(SETTLE, || {
        ensure!(!env.ctl.alive(), "still running");
        Ok(())
    })
    .with_context(|| env.ctl.log_text())?;
    let log = env.ctl.log_text();
    ensure!(
        log.contains(needle),
        "the refusal does not say {needle:?}:\n{log}"
    );
    Ok(())
}

/// `cozy-proxy run --backend auto` in `env`: nftables serves the node
/// (`why` in the backend metric), and traffic flows both ways.
fn auto_takes_nft(env: &mut Env, extra: &[&str], why: &str) -> Result<()> {
    let mut args = vec!["--backend", "auto"];
    args.extend_from_slice(extra);
    env.ctl.extra_args = args.iter().map(|a| a.to_string()).collect();
    // The refused start's exit status is no news here.
    let _ = env.ctl.stop();
    env.ctl.restart()?;
    env.wait_log("using nftables")?;
    let (_, metrics) = env.controller_http("/metrics")?;
    ensure!(
        metrics.lines().any(|l| l.starts_with("cozy_proxy_backend{")
            && l.contains("backend=\"nft\"")
            && l.contains(why)),
        "the backend metric does not say nft and {why:?}:\n{metrics}"
    );
    // The backend is chosen before the first sync installs its table.
    eventually(SETTLE, || {
        let ruleset = ok_in(&env.topo.node(), &["nft", "list", "tables"])?;
        ensure!(ruleset.contains("cozy_proxy"), "no nft table: {ruleset}");
        Ok(())
    })?;
    both_ways(env)
}

/// A filter ours cannot be put ahead of (priority 1, another protocol):
/// `--backend ebpf` refuses to start and names it; `auto` takes nftables
/// and says why, and traffic flows.
#[test]
fn a_tc_filter_ours_cannot_pass_makes_auto_take_nft() -> Result<()> {
    let mut env = setup(Fam::V4, &["--tc-attach", "netlink"])?;
    stop_and_clean(&mut env)?;
    ok_in(
        &env.topo.node(),
        &[
            "tc", "filter", "add", "dev", "uplink", "ingress", "pref", "1", "protocol", "ip",
            "handle", "800::7", "u32", "match", "u32", "0", "0", "flowid", "1:1",
        ],
    )?;
    refused_start(&mut env, "u32 filter at priority 1")?;
    ensure!(
        env.ctl.log_text().contains("uplink ingress"),
        "no hook named"
    );
    auto_takes_nft(
        &mut env,
        &["--tc-attach", "netlink"],
        "u32 filter at priority 1",
    )
}

/// The node's own traffic on a macvlan over the uplink, a shape the eBPF
/// programs cannot serve (ebpf/shape.rs): `--backend ebpf` refuses to
/// start and names it; `auto` takes nftables, says why (log, metric,
/// `dump`), and traffic flows.
#[test]
fn a_macvlan_on_the_uplink_makes_auto_take_nft() -> Result<()> {
    let mut env = setup(Fam::V4, &[])?;
    stop_and_clean(&mut env)?;
    ok_in(
        &env.topo.node(),
        &[
            "ip", "link", "add", "mv0", "link", "uplink", "type", "macvlan", "mode", "bridge",
        ],
    )?;
    refused_start(&mut env, "mv0 is a macvlan on uplink")?;
    auto_takes_nft(&mut env, &[], "mv0 is a macvlan on uplink")?;
    let dump = ok_in(
        &env.topo.node(),
        &[
            &cozy_proxy_testkit::bin(),
            "dump",
            "--backend",
            "nft",
            "-o",
            "json",
        ],
    )?;
    ensure!(
        dump.contains("\"ebpf_unserved\"") && dump.contains("mv0 is a macvlan on uplink"),
        "dump does not say why eBPF does not serve the node: {dump}"
    );
    Ok(())
}

/// Kube-OVN's node (its `ovn0`): `auto` takes eBPF there, and says so
/// with no reason to the contrary; an unmapped pod reaches pod1 through
/// its LB IP (its hairpin marked by the programs and masqueraded by the
/// one rule beside them, table `inet cozy_proxy`), and the outside too.
/// `cleanup` takes the table away with the programs.
#[test]
fn kube_ovns_gateway_port_is_served_by_ebpf_under_auto() -> Result<()> {
    let mut env = Env::with_shape(Backend::Ebpf, Fam::V4, Shape::Gateway)?;
    stop_and_clean(&mut env)?;
    // The pods' network in-cluster: Kube-OVN publishes no podCIDRs.
    env.ctl.extra_args = [
        "--backend",
        "auto",
        "--cluster-cidrs",
        "192.0.2.0/24,2001:db8:2::/64",
    ]
    .map(String::from)
    .to_vec();
    env.ctl.restart()?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.wait_log("eBPF programs live")?;
    let (_, metrics) = env.controller_http("/metrics")?;
    ensure!(
        metrics.lines().any(|l| l.starts_with("cozy_proxy_backend{")
            && l.contains("backend=\"ebpf\"")
            && l.contains("reason=\"\"")),
        "the backend metric does not say ebpf, with no reason against it:\n{metrics}"
    );
    ensure!(
        metrics.contains("cozy_proxy_ebpf_hairpin_masquerade_missing 0"),
        "the hairpin masquerade is not in place:\n{metrics}"
    );
    {
        let _web = env.serve_tcp(1, WEB)?;
        let got = eventually(SETTLE, || tcp_request(&env.topo.pod(2), env.lb(0), WEB))?;
        ensure!(got.starts_with("pod1 "), "pod2 -> LB IP: {got:?}");
    }
    both_ways(&env)?;
    let node = env.topo.node();
    let tables = || ok_in(&node, &["nft", "list", "tables"]);
    ensure!(tables()?.contains("table inet cozy_proxy"), "{}", tables()?);
    stop_and_clean(&mut env)?;
    ensure!(
        !tables()?.contains("cozy_proxy"),
        "left after cleanup: {}",
        tables()?
    );
    Ok(())
}

/// Another agent's host route to an address that becomes an LB IP (a
/// static /32 of the node setup, another controller's): cozy-proxy keeps
/// it and says so. nft rewrites before routing, so the outside still
/// reaches the pod; eBPF translates a local mapping after routing via the
/// LB IP's route, so on this node the address follows the other agent's
/// route and does not reach the pod. Once theirs is gone, ours goes in and
/// both serve it.
fn foreign_route_kept(backend: Backend) -> Result<()> {
    let env = Env::new(backend, Fam::V4)?;
    let (node, lb) = (env.topo.node(), env.lb(0));
    let theirs = format!("{lb} dev pod2 proto static");
    ok_in(&node, &["sh", "-c", &format!("ip route add {theirs}")])?;
    env.put_service(&Svc::new("vm1", lb), &[env.pod_ip(1)])?;
    env.wait_log("another agent's route to these addresses is kept")?;
    let show = || ok_in(&node, &["ip", "route", "show", &format!("{lb}/32")]);
    ensure!(show()?.contains("proto static"), "{}", show()?);
    if backend.is_ebpf() {
        let _web = env.serve_tcp(1, WEB)?;
        ensure!(
            env.tcp_reaches(lb, WEB, 1).is_err(),
            "the pod reached through another agent's route"
        );
    } else {
        eventually(SETTLE, || both_ways(&env))?;
    }
    ok_in(&node, &["sh", "-c", &format!("ip route del {theirs}")])?;
    eventually(Duration::from_secs(5), || {
        ensure!(show()?.contains("proto 249"), "{}", show()?);
        Ok(())
    })?;
    eventually(SETTLE, || both_ways(&env))
}

#[test]
fn another_agents_route_to_an_lb_ip_is_kept_nft() -> Result<()> {
    foreign_route_kept(Backend::Nft)
}

#[test]
fn another_agents_route_to_an_lb_ip_is_kept_ebpf() -> Result<()> {
    foreign_route_kept(Backend::Ebpf)
}

/// The controller's syscalls as `strace` records them (the real kernel
/// calls, in the order they were made) while an LB IP mapped to a pod on
/// another node goes: its route (steering it to that node) is deleted
/// before any element of the tables or maps changes. The other way round,
/// for a moment the LB IP would be steered with its rewrite gone.
fn route_goes_before_the_tables(backend: Backend) -> Result<()> {
    let mut env = Env::new(backend, Fam::V4)?;
    let trace = env.scratch("strace");
    let file = trace.display().to_string();
    env.ctl.wrapper = [
        "strace",
        "-f",
        "-o",
        &file,
        "-e",
        "trace=bpf,sendto,sendmsg",
        "--",
    ]
    .map(String::from)
    .to_vec();
    env.ctl.restart()?;
    let (node, lb) = (env.topo.node(), env.lb(0));
    env.dir.put(
        "node2",
        &cozy_proxy_testkit::control_plane::k8s::node_yaml("node2", Some("198.51.100.3".parse()?)),
    )?;
    env.dir.put("vm9", &Svc::new("vm9", lb).yaml())?;
    env.dir.put(
        "vm9-eps",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: vm9-e\n  namespace: default\n  labels:\n    kubernetes.io/service-name: vm9\naddressType: IPv4\nendpoints:\n- addresses: [\"192.0.2.50\"]\n  nodeName: node2\n",
    )?;
    let routed = || -> Result<bool> {
        let routes = ok_in(&node, &["ip", "route", "show", "proto", "249"])?;
        Ok(routes.contains(&lb.to_string()))
    };
    eventually(SETTLE, || {
        ensure!(routed()?, "no route to {lb}");
        Ok(())
    })?;
    // Whatever settles after the route went in, then the removal.
    std::thread::sleep(Duration::from_secs(1));
    let before = std::fs::read_to_string(&trace)?.lines().count();
    env.dir.remove("vm9")?;
    env.dir.remove("vm9-eps")?;
    eventually(SETTLE, || {
        ensure!(!routed()?, "{lb} still routed");
        ensure!(!env.dump()?.remote.contains_key(&lb), "{lb} still mapped");
        Ok(())
    })?;
    let text = std::fs::read_to_string(&trace)?;
    let calls: Vec<&str> = text.lines().skip(before).collect();
    let first = |needles: &[&str]| {
        calls
            .iter()
            .position(|l| needles.iter().any(|n| l.contains(n)))
    };
    let route = first(&["RTM_DELROUTE"]).context("no RTM_DELROUTE traced")?;
    let tables = match backend {
        Backend::Nft => first(&["NFT_MSG_DELSETELEM", "NFT_MSG_NEWSETELEM"]),
        _ => first(&["BPF_MAP_DELETE_ELEM", "BPF_MAP_UPDATE_ELEM"]),
    }
    .context("no change of the tables traced")?;
    ensure!(
        route < tables,
        "the tables changed before the route went:\n{}",
        calls[..=tables.max(route)].join("\n")
    );
    Ok(())
}

#[test]
fn a_route_goes_before_the_tables_change_nft() -> Result<()> {
    route_goes_before_the_tables(Backend::Nft)
}

#[test]
fn a_route_goes_before_the_maps_change_ebpf() -> Result<()> {
    route_goes_before_the_tables(Backend::Ebpf)
}
