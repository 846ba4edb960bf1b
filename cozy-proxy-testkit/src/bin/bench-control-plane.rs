//! The control-plane benchmark (`cargo xtask bench control-plane`),
//! separate from the tests: nothing in the test suite depends on timing.
//!
//! Plan computation and datapath apply for 100 .. 50 000
//! managed Services (mixed IPv4/IPv6, mixed modes) on both backends, in a
//! network namespace of its own: full initial sync, one change applied
//! (median, p99), and as peer a rebuild-everything strategy (empty the
//! datapath, fill it again) for the same change; peak RSS of the real
//! controller (`cozy-proxy run` on the same Services as manifests).
use cozy_proxy_testkit as harness;

use anyhow::{bail, Context, Result};
use cozy_proxy::{
    datapath::{Datapath, DatapathState, Synced},
    ebpf::{EbpfConfig, EbpfKernel, Interfaces},
    model::compute_plan,
    nft::NftKernel,
};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{json, Value};
use std::{
    fs,
    net::IpAddr,
    os::fd::AsRawFd,
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    control_plane(&args)
}

/// Milliseconds of a duration.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// (min, median, p99, max) of samples.
fn stats(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (v[0], at(0.5), at(0.99), v[v.len() - 1])
}

/// Service i: IPv4 for the first 250 (the documentation ranges hold no
/// more), IPv6 after; every third one port-filtered with two ports.
fn addresses(i: usize) -> (String, String) {
    if i < 250 {
        (format!("203.0.113.{}", i + 1), format!("192.0.2.{}", i + 1))
    } else {
        (
            format!("2001:db8:203::{:x}", i + 1),
            format!("2001:db8:2::{:x}", i + 1),
        )
    }
}

fn objects(n: usize) -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut yaml = String::new();
    for i in 0..n {
        yaml += &manifest(i, None);
    }
    let loaded =
        cozy_proxy::source::manifests::parse(&[(PathBuf::from("bench.yaml"), yaml.into_bytes())]);
    assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped.first());
    (loaded.snapshot.services, loaded.snapshot.endpoint_slices)
}

/// YAML of Service i and its EndpointSlice; `pod` overrides the endpoint.
fn manifest(i: usize, pod: Option<&str>) -> String {
    let (lb, default_pod) = addresses(i);
    let pod = pod.unwrap_or(&default_pod);
    let family = if lb.contains(':') { "IPv6" } else { "IPv4" };
    let filter = if i.is_multiple_of(3) {
        "  annotations: {networking.cozystack.io/wholeIP: \"false\"}\n"
    } else {
        ""
    };
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: s{i}\n  namespace: bench\n  labels: {{service.kubernetes.io/service-proxy-name: cozy-proxy}}\n{filter}\
         spec:\n  ports: [{{port: 22}}, {{port: 53, protocol: UDP}}]\nstatus:\n  loadBalancer:\n    ingress: [{{ip: \"{lb}\"}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s{i}-e\n  namespace: bench\n  labels: {{kubernetes.io/service-name: s{i}}}\n\
         addressType: {family}\nendpoints: [{{addresses: [\"{pod}\"]}}]\n"
    )
}

/// A network namespace the bench enters for one backend run.
struct Netns {
    name: String,
    home: fs::File,
}

impl Netns {
    fn enter(name: &str) -> Result<Netns> {
        let home = fs::File::open("/proc/self/ns/net")?;
        harness::sh::ok(&["ip", "netns", "add", name])?;
        for cmd in [
            "ip link set lo up",
            "ip link add pods type veth peer name pods-peer",
            "ip link set pods-peer up",
            "ip link set pods up",
            "ip route add 192.0.2.0/24 dev pods",
            "ip -6 route add 2001:db8:2::/64 dev pods",
        ] {
            let words: Vec<&str> = cmd.split_whitespace().collect();
            harness::sh::ok_in(name, &words)?;
        }
        let ns = fs::File::open(format!("/var/run/netns/{name}"))?;
        // SAFETY: setns on a namespace file we opened; single-threaded here.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        Ok(Netns {
            name: name.into(),
            home,
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // SAFETY: back to the namespace we came from.
        unsafe {
            libc::setns(self.home.as_raw_fd(), libc::CLONE_NEWNET);
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A state with mapping `i` moved to another pod (one Service's endpoint
/// changes: a delete and an add in each map, routes re-pointed).
fn moved(state: &DatapathState, i: usize, round: usize) -> DatapathState {
    let mut s = state.clone();
    let (lb, pod) = addresses(i);
    let (lb, pod): (IpAddr, IpAddr) = (lb.parse().expect("lb"), pod.parse().expect("pod"));
    let new_pod: IpAddr = if pod.is_ipv4() {
        // Stay inside 192.0.2.0/24: swap with an address no mapping uses.
        format!("192.0.2.{}", 251 + round % 4).parse().expect("v4")
    } else {
        format!("2001:db8:2::f:{:x}", round).parse().expect("v6")
    };
    s.pod_svc.remove(&pod);
    s.pod_svc.insert(new_pod, lb);
    s.svc_pod.insert(lb, new_pod);
    if s.filtered_pods.remove(&pod) {
        s.filtered_pods.insert(new_pod);
        let ports: Vec<_> = s
            .allowed_ports
            .iter()
            .filter(|p| p.pod == pod)
            .copied()
            .collect();
        for mut p in ports {
            s.allowed_ports.remove(&p);
            p.pod = new_pod;
            s.allowed_ports.insert(p);
        }
    }
    s
}

fn bench_backend<D: Datapath>(
    mut d: D,
    plan_state: &DatapathState,
    n: usize,
    changes: usize,
    rebuilds: usize,
) -> Result<Value> {
    let started = Instant::now();
    d.sync(plan_state).map_err(|e| anyhow::anyhow!("{e}"))?;
    let initial = started.elapsed();
    let mut current = plan_state.clone();
    let mut one = Vec::new();
    for round in 0..changes {
        let next = moved(plan_state, (round * 7919) % n, round);
        let t = Instant::now();
        d.sync(&next).map_err(|e| anyhow::anyhow!("{e}"))?;
        one.push(ms(t.elapsed()));
        current = next;
    }
    let empty = DatapathState::default();
    let mut rebuild = Vec::new();
    for round in 0..rebuilds {
        let next = moved(plan_state, (round * 104_729) % n, round + changes);
        let t = Instant::now();
        d.sync(&empty).map_err(|e| anyhow::anyhow!("{e}"))?;
        d.sync(&next).map_err(|e| anyhow::anyhow!("{e}"))?;
        rebuild.push(ms(t.elapsed()));
        current = next;
    }
    std::thread::sleep(Duration::from_secs(2));
    let live = d.dump().map_err(|e| anyhow::anyhow!("{e}"))?;
    // What the plan decides; the guards and routes come from the pods'
    // paths in this namespace, not from the plan: compared without them.
    let mut live_state = live.state;
    for s in [&mut live_state, &mut current] {
        s.guard.clear();
        s.routes.clear();
    }
    if live_state != current {
        let d = live_state.diff(&current);
        bail!(
            "the datapath does not hold the last state after the run: {} elements differ (pod_svc -{} +{}, svc_pod -{} +{}, ports -{} +{})",
            d.size(),
            d.pod_svc.remove.len(),
            d.pod_svc.add.len(),
            d.svc_pod.remove.len(),
            d.svc_pod.add.len(),
            d.allowed_ports.remove.len(),
            d.allowed_ports.add.len()
        );
    }
    d.cleanup().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (_, one_med, one_p99, _) = stats(one);
    let (_, rb_med, rb_p99, _) = stats(rebuild);
    Ok(json!({
        "initial_sync_ms": ms(initial),
        "one_change_median_ms": one_med,
        "one_change_p99_ms": one_p99,
        "rebuild_median_ms": rb_med,
        "rebuild_p99_ms": rb_p99,
        "rebuild_over_incremental": rb_med / one_med,
        "elements": plan_state.len(),
    }))
}

/// Peak RSS (VmHWM, MiB) of `cozy-proxy run` on the same Services.
fn controller_rss(n: usize, backend: &str) -> Result<f64> {
    let name = format!("cpbench-rss-{}", std::process::id());
    let ns = Netns::enter(&name)?;
    let dir = std::env::temp_dir().join(format!("{name}-manifests"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let mut yaml = String::new();
    for i in 0..n {
        yaml += &manifest(i, None);
    }
    fs::write(dir.join("services.yaml"), yaml)?;
    let pins = harness::test_bpffs()?.join(&name);
    let log = dir.join("log");
    let mut child = Command::new(harness::bin())
        .args([
            "run",
            "--backend",
            backend,
            "--metrics-addr",
            "",
            "--manifests",
        ])
        .arg(&dir)
        .arg("--bpf-pin-dir")
        .arg(&pins)
        .stderr(fs::File::create(&log)?)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("datapath synced")
    {
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            bail!(
                "controller did not sync: {}",
                fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let status = fs::read_to_string(format!("/proc/{}/status", child.id()))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("VmHWM")?;
    // SAFETY: signal to our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    child.wait()?;
    let _ = Command::new(harness::bin())
        .args(["cleanup", "--bpf-pin-dir"])
        .arg(&pins)
        .status();
    drop(ns);
    let _ = fs::remove_dir_all(&dir);
    Ok(kib / 1024.0)
}

fn control_plane(args: &[String]) -> Result<()> {
    let sizes: Vec<usize> = args
        .first()
        .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![100, 1000, 10_000, 50_000]);
    let bpffs = harness::test_bpffs()?;
    let mut results = Vec::new();
    for &n in &sizes {
        let (services, slices) = objects(n);
        let mut plan_ms = Vec::new();
        let mut outcome = None;
        for _ in 0..5 {
            let t = Instant::now();
            outcome = Some(compute_plan(&services, &slices, &[]));
            plan_ms.push(ms(t.elapsed()));
        }
        let outcome = outcome.context("plan")?;
        if outcome.plan.mappings.len() != n {
            bail!(
                "expected {n} mappings, got {} ({:?})",
                outcome.plan.mappings.len(),
                outcome.warnings.first()
            );
        }
        let state = DatapathState::for_node(
            &outcome.plan,
            &Default::default(),
            cozy_proxy::datapath::NodeView { name: None },
        );
        let (_, plan_med, _, _) = stats(plan_ms);
        let changes = if n >= 10_000 { 100 } else { 200 };
        let rebuilds = if n >= 10_000 { 5 } else { 20 };
        let mut row = json!({"services": n, "plan_median_ms": plan_med});
        for backend in ["nft", "ebpf"] {
            let name = format!("cpbench-{}-{backend}-{n}", std::process::id());
            let ns = Netns::enter(&name)?;
            let r = match backend {
                "nft" => {
                    bench_backend(Synced::new(NftKernel::new()?), &state, n, changes, rebuilds)?
                }
                _ => {
                    let cfg = EbpfConfig {
                        pin_dir: bpffs.join(&name),
                        interfaces: Interfaces::Named(vec![]),
                        fast_path: false,
                        tc_attach: Default::default(),
                    };
                    bench_backend(
                        Synced::new(EbpfKernel::start(cfg)?),
                        &state,
                        n,
                        changes,
                        rebuilds,
                    )?
                }
            };
            drop(ns);
            let rss = controller_rss(n, backend)?;
            row[backend] = json!({ "apply": r, "controller_peak_rss_mib": rss });
            eprintln!("control-plane n={n} {backend}: {}", row[backend]);
        }
        results.push(row);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({"control_plane": results}))?
    );
    Ok(())
}
