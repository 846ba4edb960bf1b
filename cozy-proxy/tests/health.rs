//! The metrics and health server as it sits on a node's network: a cap on
//! connections and a deadline per connection, so idle or slow clients
//! cannot hold it; `/healthz` and `/readyz` answer again once they are cut.
//! Needs root (the controller runs in a test node namespace).
use anyhow::{ensure, Result};
use cozy_proxy_testkit as harness;
use harness::{nodes::net::Fam, sh::Proc, traffic::eventually, Backend, Env};
use std::{process::Stdio, time::Duration, time::Instant};

#[test]
fn idle_clients_are_capped_and_cut_at_the_deadline() -> Result<()> {
    let env = Env::new(Backend::Nft, Fam::V4)?;
    eventually(Duration::from_secs(10), || {
        let (code, _) = env.controller_http("/healthz")?;
        ensure!(code == 200, "healthz {code}");
        Ok(())
    })?;
    // More idle connections than the cap, sending nothing.
    let node = env.topo.node();
    let idle: Vec<Proc> = (0..40)
        .map(|_| {
            Proc::spawn_in(
                &node,
                &["sh", "-c", "sleep 30 | socat -T60 - TCP:127.0.0.1:9402"],
                Stdio::null(),
                Stdio::null(),
            )
        })
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(1500));
    let started = Instant::now();
    // Served again once the deadline (5 s) has cut the idle ones; before,
    // a request beyond the cap is closed at once.
    eventually(Duration::from_secs(15), || {
        let (code, _) = env.controller_http("/healthz")?;
        ensure!(code == 200, "healthz {code}");
        Ok(())
    })?;
    let waited = started.elapsed();
    ensure!(
        waited >= Duration::from_millis(1500),
        "served at once with 40 idle connections open: no cap ({waited:?})"
    );
    ensure!(
        waited < Duration::from_secs(8),
        "idle connections not cut ({waited:?})"
    );
    drop(idle);
    Ok(())
}

/// Clients on the network holding every connection of the metrics server,
/// again and again: the kubelet's probes go to the loopback server, which
/// answers at once all the while.
#[test]
fn the_probes_server_answers_while_the_metrics_server_is_held() -> Result<()> {
    let env = Env::new(Backend::Nft, Fam::V4)?;
    let node = env.topo.node();
    let probe = || -> Result<()> {
        let out = harness::traffic::http_status(&node, "http://127.0.0.1:9403/healthz")?;
        ensure!(out.trim() == "200", "healthz on the probes' server: {out}");
        Ok(())
    };
    eventually(Duration::from_secs(10), probe)?;
    // More than the cap, each idle until cut and then back at once.
    let held: Vec<Proc> = (0..40)
        .map(|_| {
            Proc::spawn_in(
                &node,
                &[
                    "sh",
                    "-c",
                    "while :; do sleep 30 | socat -T60 - TCP:127.0.0.1:9402; done",
                ],
                Stdio::null(),
                Stdio::null(),
            )
        })
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(1500));
    for _ in 0..10 {
        probe()?;
        std::thread::sleep(Duration::from_millis(700));
    }
    drop(held);
    Ok(())
}
