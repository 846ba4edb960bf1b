//! The Kubernetes source against the API stand-in (no kube-apiserver can be
//! installed here; `cozy_proxy_testkit::standin` serves list/watch the way it
//! does, with faults on demand): outages, cut watches, 410 Gone, Events,
//! metrics and health endpoints, the node's backend label. Needs root.
use cozy_proxy_testkit as harness;

use anyhow::{ensure, Context, Result};
use harness::{
    controller::manifests::{slice, Svc},
    nodes::net::Fam,
    sh::ok_in,
    traffic::{eventually, SETTLE},
    Backend, Env, SourceKind,
};
use std::time::Duration;

fn env(backend: Backend) -> Result<Env> {
    Env::with_source(backend, SourceKind::Kube, Fam::V4)
}

fn put(env: &Env, svc: &Svc, pod: usize) -> Result<()> {
    env.dir.put(&svc.name, &svc.yaml())?;
    let eps = [(env.net.pods[pod - 1].to_string(), None)];
    env.dir.put(
        &format!("{}-eps", svc.name),
        &slice(&svc.name, "IPv4", &eps),
    )
}

fn standin(env: &mut Env) -> &mut harness::StandIn {
    env.standin.as_mut().expect("kube source has a stand-in")
}

fn http(env: &Env, path: &str) -> Result<(u16, String)> {
    env.controller_http(path)
}

#[test]
fn an_api_outage_keeps_the_datapath_and_it_recovers() -> Result<()> {
    let mut env = env(Backend::Nft)?;
    let _web = env.serve_tcp(1, 8080)?;
    put(&env, &Svc::new("vm1", env.net.lbs[0]), 1)?;
    let before = env.settle()?;
    env.tcp_reaches(env.lb(0), 8080, 1)?;
    standin(&mut env).stop();
    // Longer than a resync (2 s): the datapath is re-read, never flushed.
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        env.dump()? == before,
        "the datapath changed during the outage"
    );
    env.tcp_reaches(env.lb(0), 8080, 1)?;
    // A controller restarted during the outage waits, not ready, and
    // leaves the datapath alone.
    env.ctl.restart()?;
    std::thread::sleep(Duration::from_secs(1));
    ensure!(http(&env, "/readyz")?.0 == 503, "ready without any list");
    ensure!(http(&env, "/healthz")?.0 == 200);
    ensure!(
        env.dump()? == before,
        "a controller without the API touched the datapath"
    );
    env.tcp_reaches(env.lb(0), 8080, 1)?;
    // The API comes back; changes flow again.
    standin(&mut env).restart()?;
    eventually(SETTLE, || match http(&env, "/readyz")? {
        (200, _) => Ok(()),
        (code, body) => anyhow::bail!("readyz {code}: {body}"),
    })?;
    let _web3 = env.serve_tcp(3, 8080)?;
    put(&env, &Svc::new("vm3", env.net.lbs[2]), 3)?;
    env.settle()?;
    env.tcp_reaches(env.lb(2), 8080, 3)
}

#[test]
fn cut_watches_and_410_gone_resume_with_the_current_state() -> Result<()> {
    let mut env = env(Backend::Nft)?;
    put(&env, &Svc::new("vm1", env.net.lbs[0]), 1)?;
    env.settle()?;
    standin(&mut env).post("/control/cut")?;
    put(&env, &Svc::new("vm2", env.net.lbs[1]), 2)?;
    env.settle()?;
    // Forget history: the watches' resourceVersions are now too old.
    standin(&mut env).post("/control/compact")?;
    put(&env, &Svc::new("vm3", env.net.lbs[2]), 3)?;
    env.delete_service_files("vm1")?;
    let state = env.settle()?;
    ensure!(state.svc_pod.len() == 2, "{state:?}");
    // The watcher was told 410 Gone (reason Expired) and relisted.
    env.wait_log("Expired")?;
    Ok(())
}

#[test]
fn warnings_become_events_on_the_service() -> Result<()> {
    let mut env = env(Backend::Nft)?;
    let mut svc = Svc::new("vm1", env.net.lbs[0]);
    svc.whole_ip = Some("yes".into());
    put(&env, &svc, 1)?;
    env.settle()?;
    let events = eventually(SETTLE, || {
        let text = standin(&mut env).get("/control/events")?;
        ensure!(text.contains("InvalidAnnotation"), "no Event yet: {text}");
        Ok(text)
    })?;
    let v: serde_json::Value = serde_json::from_str(&events)?;
    let e = v
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|e| e["body"]["reason"] == "InvalidAnnotation")
        })
        .context("event")?;
    ensure!(e["body"]["type"] == "Warning", "{e}");
    ensure!(
        e["body"]["regarding"]["kind"] == "Service" && e["body"]["regarding"]["name"] == "vm1",
        "{e}"
    );
    ensure!(
        e["body"]["note"]
            .as_str()
            .unwrap_or("")
            .contains("wholeIP=\"yes\""),
        "{e}"
    );
    Ok(())
}

#[test]
fn metrics_show_real_values() -> Result<()> {
    let mut env = env(Backend::Ebpf)?;
    let _web = env.serve_tcp(1, 8080)?;
    put(&env, &Svc::new("vm1", env.net.lbs[0]), 1)?;
    let filtered = Svc::new("vm2", env.net.lbs[1]).filter(&[("TCP", 22)]);
    put(&env, &filtered, 2)?;
    let mut bad = Svc::new("vm3", env.net.lbs[2]);
    bad.allow_icmp = Some("maybe".into());
    bad.whole_ip = Some("false".into());
    put(&env, &bad, 3)?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), 8080, 1)?;
    let _ = env.tcp_dropped(env.lb(1), 8080);
    let metrics = eventually(Duration::from_secs(5), || {
        let (code, body) = http(&env, "/metrics")?;
        ensure!(code == 200, "metrics {code}");
        ensure!(
            body.contains(
                "cozy_proxy_service_packets_total{lb_ip=\"203.0.113.10\",direction=\"ingress\"}"
            ),
            "no datapath counters yet:\n{body}"
        );
        Ok(body)
    })?;
    for needle in [
        "cozy_proxy_services{mode=\"passthrough\"} 1",
        "cozy_proxy_services{mode=\"port_filter\"} 2",
        "cozy_proxy_warnings{reason=\"InvalidAnnotation\"} 1",
        "cozy_proxy_drops_total{reason=\"filtered_port\"}",
        // Kernel counts are exported as counters, not gauges.
        "# TYPE cozy_proxy_service_packets counter",
        "# TYPE cozy_proxy_drops counter",
    ] {
        ensure!(metrics.contains(needle), "{needle} missing:\n{metrics}");
    }
    let count = metrics
        .lines()
        .find(|l| l.starts_with("cozy_proxy_sync_duration_seconds_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse::<u64>().ok())
        .context("sync histogram")?;
    ensure!(count >= 1, "sync count {count}");
    let packets = metrics
        .lines()
        .find(|l| {
            l.starts_with(
                "cozy_proxy_service_packets_total{lb_ip=\"203.0.113.10\",direction=\"ingress\"}",
            )
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse::<u64>().ok())
        .context("packets")?;
    ensure!(packets > 0, "no ingress packets counted");
    ensure!(http(&env, "/readyz")?.0 == 200);
    Ok(())
}

#[test]
fn the_node_label_overrides_the_backend() -> Result<()> {
    let mut env = env(Backend::Ebpf)?;
    put(&env, &Svc::new("vm1", env.net.lbs[0]), 1)?;
    env.settle()?;
    // The node asks for nft: the restarted controller switches, and removes
    // the eBPF state once nft has synced.
    env.dir.put(
        "node1",
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node1\n  labels:\n    networking.cozystack.io/cozy-proxy-backend: nft\n",
    )?;
    std::thread::sleep(Duration::from_millis(300));
    env.ctl.restart()?;
    env.wait_log("backend chosen by the node label")?;
    let node = env.topo.node();
    eventually(SETTLE, || {
        let table = ok_in(&node, &["nft", "list", "table", "ip", "cozy_proxy"])?;
        ensure!(table.contains("203.0.113.10"), "{table}");
        ensure!(!env.ctl.pin_dir.exists(), "eBPF pins left");
        Ok(())
    })?;
    let _web = env.serve_tcp(1, 8080)?;
    env.tcp_reaches(env.lb(0), 8080, 1)
}

#[test]
fn the_datapath_goes_only_with_the_daemonset() -> Result<()> {
    let mut env = env(Backend::Nft)?;
    let ds = "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: cozy-proxy\n  namespace: kube-system\n";
    env.dir.put("daemonset", ds)?;
    env.ctl.extra_args = vec!["--daemonset".into(), "kube-system/cozy-proxy".into()];
    env.wait_log("datapath chosen")?; // signal handlers are in place
    env.ctl.restart()?;
    put(&env, &Svc::new("vm1", env.net.lbs[0]), 1)?;
    let before = env.settle()?;
    // A rolling update: the DaemonSet is still there, the datapath stays.
    env.ctl.stop()?;
    ensure!(env.dump()? == before, "a restart removed the datapath");
    env.wait_log("our DaemonSet remains")?;
    // helm uninstall: the DaemonSet is gone when its pods stop.
    env.ctl.restart()?;
    env.settle()?;
    env.wait_log("datapath synced")?;
    env.dir.remove("daemonset")?;
    std::thread::sleep(Duration::from_millis(300));
    env.ctl.stop()?;
    env.wait_log("uninstall; removing the datapath")?;
    let ruleset = ok_in(&env.topo.node(), &["nft", "list", "ruleset"])?;
    ensure!(
        !ruleset.contains("cozy_proxy"),
        "left after uninstall:\n{ruleset}"
    );
    Ok(())
}
