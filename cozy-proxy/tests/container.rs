//! The image, built and run for real: built from the binary under test
//! with buildah into an OCI archive, unpacked with umoci, run with runc in
//! the test node's network namespace (hostNetwork) under exactly the
//! security settings the chart's DaemonSet renders to (capabilities after
//! dropping ALL, not privileged, no privilege escalation, read-only root,
//! the bpffs mount, the seccomp profile); a scenario subset with real
//! traffic on both backends. And the evidence behind the chart's seccomp
//! choice: the runtime default profile refuses bpf(2) without
//! CAP_SYS_ADMIN, the profile the chart ships allows it. Needs root.
// Only a subset of the scenarios runs in the container.
#[allow(dead_code)]
mod cases;

use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit as harness;
use harness::{controller::image, nodes::net::Fam, Backend, Env};
use std::time::Duration;

fn run(backend: Backend, scenario: fn(&mut Env) -> Result<()>) {
    let mut env = Env::in_container(backend, Fam::V4, None, None).expect("container");
    if let Err(e) = scenario(&mut env) {
        panic!("{e:#}\n--- controller log ---\n{}", env.ctl.log_text());
    }
}

/// The scenarios run in a container, for one backend.
macro_rules! in_a_container {
    ($backend:expr) => {
        use super::run;
        use crate::cases::{changes, filter, passthrough};
        harness::datapath_suite!(@tests run($backend);
            passthrough::s02_any_port, passthrough::s04_egress_source,
            filter::s07_listed_ports_pass, changes::s13_endpoint_moves);
    };
}

mod nft {
    use super::{harness, Backend};
    in_a_container!(Backend::Nft);
}

mod ebpf {
    use super::{harness, Backend};
    in_a_container!(Backend::Ebpf);
}

/// Under the runtime default profile (containers-common's, CRI-O's and
/// podman's default; containerd's before it learnt CAP_BPF) the eBPF
/// backend cannot start: bpf(2) is refused without CAP_SYS_ADMIN.
#[test]
fn the_runtime_default_profile_refuses_bpf() -> Result<()> {
    let mut env = Env::in_container(
        Backend::Ebpf,
        Fam::V4,
        Some(image::SeccompChoice::RuntimeDefault),
        None,
    )?;
    harness::traffic::eventually(Duration::from_secs(10), || {
        ensure!(!env.ctl.alive(), "still running");
        Ok(())
    })
    .with_context(|| env.ctl.log_text())?;
    let log = env.ctl.log_text();
    ensure!(
        log.contains("Operation not permitted") || log.contains("EPERM"),
        "no EPERM in the log:\n{log}"
    );
    Ok(())
}

/// The profile the chart ships for eBPF is the runtime default resolved
/// for the chart's capabilities, plus bpf and perf_event_open. Set
/// COZY_PROXY_WRITE_PROFILE=1 to write it again after containers-common
/// changes its default.
#[test]
fn the_shipped_profile_is_the_runtime_default_plus_bpf() -> Result<()> {
    let security = image::chart_security("ebpf")?;
    let default: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(image::RUNTIME_DEFAULT_PROFILE)?)?;
    let resolved = image::resolve_profile(&default, &security.capabilities)?;
    let want = image::allowing(&resolved, &["bpf", "perf_event_open"])?;
    let choice = image::SeccompChoice::of_chart(&security)?;
    let image::SeccompChoice::Localhost(name) = &choice else {
        anyhow::bail!("the chart's eBPF profile is {choice:?}, not Localhost");
    };
    let path = harness::control_plane::k8s::chart_dir()
        .join("files")
        .join(name);
    if std::env::var_os("COZY_PROXY_WRITE_PROFILE").is_some() {
        std::fs::write(&path, serde_json::to_string_pretty(&want)? + "\n")?;
    }
    let shipped: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    ensure!(
        shipped == want,
        "{} differs from the runtime default + bpf (COZY_PROXY_WRITE_PROFILE=1 rewrites it)",
        path.display()
    );
    Ok(())
}

/// A pin directory whose parent is not a bpffs (the node has none mounted
/// at /sys/fs/bpf): the container cannot mount one without CAP_SYS_ADMIN,
/// and says what to do instead of pinning into a plain directory.
#[test]
fn without_a_bpffs_the_ebpf_backend_says_what_to_do() -> Result<()> {
    let plain = std::env::temp_dir().join(format!("cozy-proxy-plain-{}", std::process::id()));
    std::fs::create_dir_all(&plain)?;
    let mut env = Env::in_container(Backend::Ebpf, Fam::V4, None, Some(plain.clone()))?;
    let outcome = harness::traffic::eventually(Duration::from_secs(10), || {
        ensure!(!env.ctl.alive(), "still running");
        Ok(())
    });
    let log = env.ctl.log_text();
    let _ = std::fs::remove_dir_all(&plain);
    outcome.with_context(|| log.clone())?;
    ensure!(
        log.contains("is not on a bpffs") && log.contains("mount -t bpf"),
        "no advice in the log:\n{log}"
    );
    Ok(())
}

/// The chart's init container, run as the chart renders it (its arguments,
/// no capability at all, RuntimeDefault, read-only root) with a directory
/// in place of the kubelet's seccomp directory: it writes the profile the
/// main container then runs under.
#[test]
fn the_init_container_installs_the_profile() -> Result<()> {
    let security = image::chart_container_security("ebpf", "install-seccomp-profile")?;
    ensure!(security.capabilities.is_empty(), "{security:?}");
    let scratch = std::env::temp_dir().join(format!("cozy-proxy-init-{}", std::process::id()));
    let host_dir = scratch.join("kubelet-seccomp");
    std::fs::create_dir_all(&host_dir)?;
    let bundle = scratch.join("bundle");
    image::test_bundle(&bundle)?;
    let container = image::Container {
        bundle: bundle.clone(),
        id: format!("cozy-proxy-init-{}", std::process::id()),
        seccomp: image::SeccompChoice::of_chart(&security)?.profile(&security.capabilities)?,
        host_pins: None,
        binds: vec![image::Bind {
            source: host_dir.clone(),
            destination: "/host-seccomp".into(),
            read_only: false,
        }],
        security: security.clone(),
    };
    let mut args = vec!["/cozy-proxy"];
    args.extend(security.args.iter().map(String::as_str));
    let command = container.command(None, &args)?;
    let out = std::process::Command::new(&command[0])
        .args(&command[1..])
        .output()?;
    container.discard();
    let installed = std::fs::read_to_string(host_dir.join("cozy-proxy/cozy-proxy-ebpf.json")).ok();
    let _ = std::fs::remove_dir_all(&scratch);
    ensure!(
        out.status.success(),
        "init container failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shipped = std::fs::read_to_string(
        harness::control_plane::k8s::chart_dir().join("files/cozy-proxy-ebpf.json"),
    )?;
    ensure!(
        installed.as_deref() == Some(shipped.as_str()),
        "installed {installed:?}"
    );
    Ok(())
}

/// The port both ends of the switch's streams answer on.
const FLOW: u16 = 8081;

/// Datagrams a switch may lose each way: none. The new backend stands by
/// through its first sync and wakes right before the old one is removed;
/// while both act, a packet one translated passes the other untouched (a
/// local LB IP's guard is its pod's path, docs/security.md).
const SWITCH_LOSS: usize = 0;

/// A node's backend switched as the chart runs each pod: the old pod
/// stops and leaves its datapath (a rolling update), the new one, under the
/// other backend's chart settings (the nft pod: no BPF capability, bpf(2)
/// refused by RuntimeDefault, only the pin directory mounted), takes the
/// node over and removes the old backend's state. A port-filtered pod
/// keeps a UDP stream each way at 100/s and a held TCP connection each
/// way across the switch.
fn switch(from: Backend, to: Backend) -> Result<()> {
    use aya::programs::TcAttachType;
    use harness::agents::tc_program::OtherAgent;
    let mut env = Env::in_container(from, Fam::V4, None, None)?;
    let lb = env.lb(0);
    let svc =
        harness::controller::manifests::Svc::new("vm1", lb).filter(&[("TCP", FLOW), ("UDP", FLOW)]);
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    let streams = harness::traffic::across::Streams::start(&env, lb, FLOW)?;
    env.switch_container_to(to)?;
    env.wait_log("datapath synced")?;
    let pins = env.ctl.pin_dir.clone();
    harness::traffic::eventually(Duration::from_secs(5), || {
        let left: Vec<_> = match std::fs::read_dir(&pins) {
            Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            Err(_) => Vec::new(),
        };
        match to {
            Backend::Nft => ensure!(left.is_empty(), "eBPF pins left: {left:?}"),
            _ => ensure!(!left.is_empty(), "no eBPF pins"),
        }
        for dev in ["uplink", "pod1"] {
            let node = env.topo.node();
            let chain = OtherAgent::tcx_chain(&node, dev, TcAttachType::Ingress)?;
            ensure!(
                chain.is_empty() != to.is_ebpf(),
                "programs on {dev}'s tcx ingress after the switch to {to:?}: {chain:?}"
            );
        }
        // The nft backend's tables, and the eBPF backend's one (its
        // hairpin masquerade).
        let nft = harness::sh::ok_in(&env.topo.node(), &["nft", "list", "tables"])?;
        ensure!(
            nft.contains("table ip cozy_proxy") == (to == Backend::Nft)
                && nft.contains("table inet cozy_proxy") == to.is_ebpf(),
            "nft tables after the switch to {to:?}: {nft}"
        );
        Ok(())
    })
    .with_context(|| env.ctl.log_text())?;
    std::thread::sleep(Duration::from_secs(2));
    let crossing = streams.finish();
    println!("{from:?} -> {to:?}: {}", crossing.report());
    crossing.print_losses();
    crossing.check(SWITCH_LOSS)
}

#[test]
fn switch_from_ebpf_to_nft_as_the_chart_runs_them() -> Result<()> {
    switch(Backend::Ebpf, Backend::Nft)
}

#[test]
fn switch_from_nft_to_ebpf_as_the_chart_runs_them() -> Result<()> {
    switch(Backend::Nft, Backend::Ebpf)
}
