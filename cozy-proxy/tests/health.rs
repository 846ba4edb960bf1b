//! The metrics and health server as it sits on a node's network: a cap on
//! connections and a deadline per connection, so idle or slow clients
//! cannot hold it; `/healthz` and `/readyz` answer again once they are cut.
//! Needs root (the controller runs in a test node namespace).
use anyhow::{ensure, Result};
use cozy_proxy_testkit as harness;
use harness::{net::Fam, sh::Proc, traffic::eventually, Backend, Env};
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
