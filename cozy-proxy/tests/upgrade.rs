//! Scenario 37: upgrading from the previous release while traffic flows.
//!
//! The previous release's `cozy-proxy`, built from its git tag by the
//! test (`harness::release`), runs the node. A mapped pod keeps a UDP
//! request/reply stream each way at 100/s and a held TCP connection each
//! way; the controller stops, the node runs 2 s without one (a rolling
//! update's gap), and the build under test takes over. Nothing may be
//! lost, and afterwards the kernel holds what this build plans. Both
//! backends, whole IP and port filter. Needs root, git history and the
//! eBPF toolchain (`cargo xtask setup`).
use anyhow::Result;
use cozy_proxy_testkit as harness;
use harness::{across::Streams, manifests::Svc, net::Fam, Backend, Env};
use std::time::Duration;

/// The port both ends of the streams answer on.
const FLOW: u16 = 8081;
/// Without a controller for this long between the two builds.
const GAP: Duration = Duration::from_secs(2);
const SYNCED: &str = "datapath synced";

fn upgrade(backend: Backend, filter: bool) -> Result<()> {
    let (release, previous) = harness::release::previous_binary()?;
    let mut env = Env::with_binary(backend, Fam::V4, previous.display().to_string())?;
    let lb = env.lb(0);
    let mut svc = Svc::new("vm1", lb);
    if filter {
        svc = svc.filter(&[("TCP", FLOW), ("UDP", FLOW)]);
    }
    env.put_service(&svc, &[env.pod_ip(1)])?;
    // The streams' TCP connections open only through the mapping.
    env.wait_log(SYNCED)?;
    let streams = Streams::start(&env, lb, FLOW)?;
    let synced = env.ctl.log_text().matches(SYNCED).count();
    env.ctl.replace_with(None, GAP)?;
    env.wait_log_times(SYNCED, synced + 1)?;
    std::thread::sleep(Duration::from_secs(2));
    let crossing = streams.finish();
    let mode = if filter { "port filter" } else { "whole IP" };
    println!(
        "{} -> {} ({backend:?}, {mode}): {}",
        release.version,
        env!("CARGO_PKG_VERSION"),
        crossing.report()
    );
    crossing.print_losses();
    crossing.check(0)?;
    env.settle()?;
    Ok(())
}

#[test]
fn from_the_previous_release_nft_whole_ip() -> Result<()> {
    upgrade(Backend::Nft, false)
}

#[test]
fn from_the_previous_release_nft_port_filter() -> Result<()> {
    upgrade(Backend::Nft, true)
}

#[test]
fn from_the_previous_release_ebpf_whole_ip() -> Result<()> {
    upgrade(Backend::Ebpf, false)
}

#[test]
fn from_the_previous_release_ebpf_port_filter() -> Result<()> {
    upgrade(Backend::Ebpf, true)
}
