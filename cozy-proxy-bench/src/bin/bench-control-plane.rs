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
use cozy_proxy::fixtures::{Slice, Svc};
use cozy_proxy::{
    datapath::{Datapath, DatapathState, NodeView, Synced},
    ebpf::{EbpfConfig, EbpfKernel, Interfaces},
    model::{
        cluster::{cluster_ranges, ClusterConfig},
        compute_plan, read_service, ReadSlice, ServiceObjects, ServiceRef,
    },
    netlink::{route, NlSocket},
    nft::NftKernel,
    reconcile::Reconciler,
    source::{Snapshot, Update},
};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{json, Value};
use std::{
    fs,
    io::{Read, Write},
    net::IpAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

/// `--namespace-share` of the runs: 100 (no bound) unless
/// CPBENCH_NAMESPACE_SHARE says (a profiling aid: every Service of the
/// bench is in one namespace, so a share under 100 measures the bound's
/// cost, and below the Services' part of the tables, cuts them).
fn namespace_share() -> u8 {
    std::env::var("CPBENCH_NAMESPACE_SHARE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

fn main() -> Result<()> {
    // RUST_LOG=cozy_proxy=debug shows where a round's time goes.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    control_plane(&args)
}

/// Milliseconds of a duration.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// (min, median, p99, max) of samples.
fn stats(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    }
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

fn objects(n: usize) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
    let mut yaml = String::new();
    for i in 0..n {
        yaml += &manifest(i, None);
    }
    let loaded =
        cozy_proxy::source::manifests::parse(&[(PathBuf::from("bench.yaml"), yaml.into_bytes())]);
    assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped.first());
    (loaded.snapshot.services, loaded.snapshot.endpoint_slices)
}

/// The pod Service i moves to in change `round`: a new address each round
/// (IPv4 from 198.51.100.0/24 for the first 250 Services, IPv6 after).
fn moved_pod(i: usize, round: usize) -> String {
    if i < 250 {
        format!("198.51.100.{}", round % 254 + 1)
    } else {
        format!("2001:db8:2::f:{round:x}")
    }
}

/// Service i's EndpointSlice with its endpoint on `pod`.
fn slice_on(i: usize, pod: &str) -> Result<Arc<EndpointSlice>> {
    let loaded = cozy_proxy::source::manifests::parse(&[(
        PathBuf::from("one.yaml"),
        manifest(i, Some(pod)).into_bytes(),
    )]);
    loaded
        .snapshot
        .endpoint_slices
        .into_iter()
        .next()
        .context("the moved slice")
}

/// Which Service a change moves: spread over all of them, and never one of
/// the first 250 twice within 254 rounds (their new pods would collide).
fn victim(round: usize, n: usize) -> usize {
    (round * 7919) % n
}

/// YAML of Service i and its EndpointSlice; `pod` overrides the endpoint.
fn manifest(i: usize, pod: Option<&str>) -> String {
    let (lb, default_pod) = addresses(i);
    let pod = pod.unwrap_or(&default_pod);
    let family = if lb.contains(':') { "IPv6" } else { "IPv4" };
    let name = format!("s{i}");
    let svc = Svc::new(&name, &lb)
        .in_namespace("bench")
        .selecting()
        .ports(&[("TCP", 22), ("UDP", 53)]);
    let svc = match i.is_multiple_of(3) {
        true => svc.whole_ip("false"),
        false => svc,
    };
    // The EndpointSlice controller's, as a controller reading the API
    // trusts by default; manifests' slices count whoever wrote them.
    let slice = Slice::new(&name, family, &[(pod, None)])
        .in_namespace("bench")
        .by_the_controller(&harness::standin::service_uid("bench", &name));
    format!("---\n{}---\n{}", svc.yaml(), slice.yaml())
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
            "ip route add 198.51.100.0/24 dev pods",
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

/// The controller's own part on one backend, in this process: the reconcile
/// rounds the loop runs (plan, datapath state, kernel), from an update
/// naming the Services that changed, as the kube source gives it. Initial
/// sync (empty kernel, full round), one change (one Service's endpoint
/// moved: an incremental round), a resync round (the kernel read again, the
/// plan computed from every object), and the rebuild-everything peer
/// (empty the datapath, then a full round).
fn bench_backend<D: Datapath>(
    d: D,
    services: &[Arc<Service>],
    slices: &[Arc<EndpointSlice>],
    changes: usize,
    rebuilds: usize,
) -> Result<Value> {
    let n = services.len();
    let fail = |e: D::Error| anyhow::anyhow!("{e}");
    let node = cozy_proxy::reconcile::NodeConfig {
        namespace_share: Some(namespace_share()),
        ..Default::default()
    };
    let mut r = Reconciler::new(d, node);
    // Service i and its slice as the kube source hands them over.
    let read_of = |i: usize, slice: &EndpointSlice| ServiceObjects {
        service: ServiceRef::new("bench", format!("s{i}")),
        read: Some(Arc::new(read_service(&services[i]))),
        slices: ReadSlice::of_alone(slice)
            .map(Arc::new)
            .into_iter()
            .collect(),
    };
    let mut snapshot = Snapshot {
        read: (0..n).map(|i| read_of(i, &slices[i])).collect(),
        ..Default::default()
    };
    let mut current_slices = slices.to_vec();
    let started = Instant::now();
    r.reconcile(Update::Full(snapshot.clone())).map_err(fail)?;
    let initial = started.elapsed();
    let mut one = Vec::new();
    for round in 0..changes {
        let i = victim(round, n);
        let slice = slice_on(i, &moved_pod(i, round))?;
        let update = Update::Services(vec![read_of(i, &slice)]);
        let t = Instant::now();
        let report = r.reconcile(update).map_err(fail)?;
        one.push(ms(t.elapsed()));
        if report.sync.changed_elements == 0 {
            bail!("change {round} (Service {i}) changed nothing");
        }
        snapshot.read[i] = read_of(i, &slice);
        current_slices[i] = slice;
    }
    let full = Update::Full(snapshot.clone());
    let mut resync = Vec::new();
    // CPBENCH_FULL_SYNC_ONLY: no resyncs, only full syncs onto an emptied
    // datapath (a profile of these alone).
    let resyncs = match std::env::var_os("CPBENCH_FULL_SYNC_ONLY") {
        Some(_) => 0,
        None => rebuilds,
    };
    for _ in 0..resyncs {
        r.datapath_mut().forget();
        let update = full.clone();
        let t = Instant::now();
        r.reconcile(update).map_err(fail)?;
        resync.push(ms(t.elapsed()));
    }
    let mut rebuild = Vec::new();
    // A full sync onto an empty datapath: the initial one, and each
    // rebuild's after the emptying (one sample spread 30% on this shared
    // machine).
    let mut full_sync = vec![ms(initial)];
    for _ in 0..rebuilds {
        let update = full.clone();
        let t = Instant::now();
        r.datapath_mut()
            .sync(DatapathState::default())
            .map_err(fail)?;
        let emptied = Instant::now();
        r.reconcile(update).map_err(fail)?;
        rebuild.push(ms(t.elapsed()));
        full_sync.push(ms(emptied.elapsed()));
    }
    std::thread::sleep(Duration::from_secs(2));
    let live = r.datapath().dump().map_err(fail)?;
    // What the plan decides, computed from scratch; the guards and routes
    // come from the pods' paths in this namespace: compared without them.
    let outcome = compute_plan(services, &current_slices, &[]);
    let ranges = cluster_ranges(&ClusterConfig::default(), &[], &[], &[]).ranges;
    let mut expected = DatapathState::for_node(&outcome.plan, &ranges, NodeView::named(None));
    let mut live_state = live.state;
    for s in [&mut live_state, &mut expected] {
        s.guard.clear();
        s.routes.clear();
    }
    if live_state != expected {
        let d = live_state.diff(&expected);
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
    r.datapath_mut().cleanup().map_err(fail)?;
    let (_, one_med, one_p99, _) = stats(one);
    let (_, rs_med, _, _) = stats(resync);
    let (_, rb_med, rb_p99, _) = stats(rebuild);
    let (fs_min, fs_med, _, fs_max) = stats(full_sync);
    Ok(json!({
        "initial_sync_ms": ms(initial),
        "full_sync_ms": {"min": fs_min, "median": fs_med, "max": fs_max},
        "one_change_median_ms": one_med,
        "one_change_p99_ms": one_p99,
        "resync_median_ms": rs_med,
        "rebuild_median_ms": rb_med,
        "rebuild_p99_ms": rb_p99,
        "rebuild_over_incremental": rb_med / one_med,
        "elements": live_state.len(),
    }))
}

/// Writes the manifests of Services `0..n` into `dir`, 1 000 per file
/// (the manifest source skips files over 4 MiB).
fn write_manifests(dir: &Path, n: usize, unmanaged: usize) -> Result<()> {
    write_chunked(dir, "services", n, |i| manifest(i, None))?;
    write_chunked(dir, "unmanaged", unmanaged, unmanaged_manifest)
}

/// `render(i)` for `i` in `0..count`, 1 000 to a file `PREFIX-START.yaml`.
fn write_chunked(
    dir: &Path,
    prefix: &str,
    count: usize,
    render: impl Fn(usize) -> String,
) -> Result<()> {
    for start in (0..count).step_by(1000) {
        let yaml: String = (start..(start + 1000).min(count)).map(&render).collect();
        fs::write(dir.join(format!("{prefix}-{start:06}.yaml")), yaml)?;
    }
    Ok(())
}

/// An ordinary Service (not ours) with its EndpointSlice, as a cluster
/// has many: every node's watch receives them.
fn unmanaged_manifest(i: usize) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: u{i}\n  namespace: other\n  labels: {{app: u{i}}}\n  annotations: {{owner: team-{t}}}\n\
         spec:\n  type: ClusterIP\n  clusterIP: 10.96.{a}.{b}\n  selector: {{app: u{i}}}\n  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}, {{name: https, port: 443, targetPort: 8443, protocol: TCP}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: u{i}-abcde\n  namespace: other\n  labels: {{kubernetes.io/service-name: u{i}, endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io}}\n\
         addressType: IPv4\nendpoints: [{{addresses: [\"10.244.{a}.{b}\"], conditions: {{ready: true, serving: true, terminating: false}}, nodeName: node-{t}}}]\nports: [{{name: http, port: 8080, protocol: TCP}}, {{name: https, port: 8443, protocol: TCP}}]\n",
        t = i % 100,
        a = (i / 250) % 250,
        b = i % 250 + 1
    )
}

/// Where a measured controller reads its objects.
#[derive(Clone, Copy)]
enum Objects {
    /// `--manifests`: the files themselves.
    Manifests,
    /// `--kubeconfig`: the real kube-rs client against the API stand-in,
    /// with this `--debounce`; changes are written through its API.
    Api { debounce_ms: u64 },
}

/// `VmHWM` or `VmRSS` of a process, MiB.
fn memory_mib(pid: u32, field: &str) -> Result<f64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context(field.to_string())?;
    Ok(kib / 1024.0)
}

/// `POST path` with a JSON body to the stand-in; waits for the status line.
/// The API stand-in's address.
const ADDR: &str = "127.0.0.1:6443";

fn post_json(addr: &str, path: &str, body: &Value) -> Result<()> {
    let mut s = std::net::TcpStream::connect(addr)?;
    let b = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: standin\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )?;
    let mut head = [0u8; 64];
    let got = s.read(&mut head)?;
    if !head[..got].starts_with(b"HTTP/1.1 200") {
        bail!("stand-in: {}", String::from_utf8_lossy(&head[..got]));
    }
    Ok(())
}

/// The real controller (`cozy-proxy run`) on `n` managed and `unmanaged`
/// other Services (and their EndpointSlices) in a namespace of its own:
/// time to the first sync, peak and current RSS after it, and, through the
/// API, the latency from a write (an EndpointSlice moved to a new pod) to
/// the change visible in the kernel (the LB IP's host route, which the
/// datapath changes last, read back with a route lookup), over `changes`
/// writes, one at a time; then, where `burst` > 0, `burst` EndpointSlices
/// moved in one write, to all of them visible in the kernel.
fn controller_run(
    n: usize,
    unmanaged: usize,
    backend: &str,
    objects: Objects,
    changes: usize,
    burst: usize,
) -> Result<Value> {
    let name = format!("cpbench-run-{}", std::process::id());
    let ns = Netns::enter(&name)?;
    let dir = std::env::temp_dir().join(format!("{name}-manifests"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    write_manifests(&dir, n, unmanaged)?;
    let pins = harness::test_bpffs()?.join(&name);
    let log = dir.join("log");
    // CPBENCH_WRAP: a profiler to run the controller under (e.g.
    // "heaptrack -o /tmp/cp"); its numbers are then the profiler's too.
    let wrap = std::env::var("CPBENCH_WRAP").unwrap_or_default();
    let mut words = wrap.split_whitespace();
    let mut cmd = match words.next() {
        Some(tool) => {
            let mut c = Command::new(tool);
            c.args(words).arg(harness::bin());
            c
        }
        None => Command::new(harness::bin()),
    };
    cmd.args(["run", "--backend", backend, "--metrics-addr", ""])
        .args(["--namespace-share", &namespace_share().to_string()])
        .arg("--bpf-pin-dir")
        .arg(&pins);
    let _server = match objects {
        Objects::Manifests => {
            cmd.arg("--manifests").arg(&dir);
            None
        }
        Objects::Api { debounce_ms } => {
            let server = harness::standin::Running::start_static(&name, dir.clone(), ADDR)?;
            let kubeconfig = dir.join("kubeconfig");
            fs::write(
                &kubeconfig,
                format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster: {{server: \"http://{ADDR}\"}}\n\
                     users:\n- name: u\n  user: {{token: t}}\ncontexts:\n- name: s\n  context: {{cluster: s, user: u}}\ncurrent-context: s\n"
                ),
            )?;
            cmd.arg("--kubeconfig")
                .arg(&kubeconfig)
                .arg("--debounce")
                .arg(format!("{debounce_ms}ms"));
            Some(server)
        }
    };
    let started = Instant::now();
    // A group of its own: a profiler and the controller under it stop
    // together.
    let mut child = std::os::unix::process::CommandExt::process_group(&mut cmd, 0)
        .stderr(fs::File::create(&log)?)
        .spawn()?;
    let result = (|| -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(600);
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
            std::thread::sleep(Duration::from_millis(20));
        }
        let synced = started.elapsed();
        std::thread::sleep(Duration::from_millis(500));
        let mut out = json!({
            "first_sync_s": synced.as_secs_f64(),
            "peak_rss_mib": memory_mib(child.id(), "VmHWM:")?,
            "rss_mib": memory_mib(child.id(), "VmRSS:")?,
            // Of it, the pages of the program's file (its code).
            "rss_file_mib": memory_mib(child.id(), "RssFile:")?,
        });
        if let Objects::Api { .. } = objects {
            let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
            let mut latency = Vec::new();
            for round in 0..changes {
                let i = victim(round, n);
                let pod = moved_pod(i, round + 1000);
                let lb: IpAddr = addresses(i).0.parse()?;
                let want: IpAddr = pod.parse()?;
                let slice = serde_json::to_value(&*slice_on(i, &pod)?)?;
                let t = Instant::now();
                post_json(ADDR, "/control/apply", &slice)?;
                loop {
                    let via = route::lookup(&sock, &lb).map(|l| l.via.gateway);
                    if matches!(via, Ok(Some(g)) if g == want) {
                        break;
                    }
                    if t.elapsed() > Duration::from_secs(10) {
                        bail!("change {round}: {lb} not routed to {pod} after 10 s");
                    }
                    // Not a spin: the controller and the stand-in share
                    // the CPUs with this loop.
                    std::thread::sleep(Duration::from_micros(100));
                }
                latency.push(ms(t.elapsed()));
            }
            let (min, med, p99, max) = stats(latency);
            out["api_to_kernel_ms"] =
                json!({"min": min, "median": med, "p99": p99, "max": max, "changes": changes});
            out["peak_rss_after_changes_mib"] = json!(memory_mib(child.id(), "VmHWM:")?);
            if burst > 0 {
                out["burst"] = write_burst(&sock, burst)?;
            }
        }
        Ok(out)
    })();
    if !wrap.is_empty() {
        // The controller alone first, killed: the profiler reads the rest
        // of its trace, and what was not freed is what it held at the end
        // (a clean exit would free it all).
        let _ = Command::new("pkill")
            .args(["-KILL", "-x", "cozy-proxy", "-g"])
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // SAFETY: signal to our own child's process group.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGTERM);
    }
    child.wait()?;
    let _ = Command::new(harness::bin())
        .args(["cleanup", "--bpf-pin-dir"])
        .arg(&pins)
        .status();
    drop(ns);
    // CPBENCH_LOG: where to keep the controller's log (with COZY_PROXY_LOG
    // set, e.g. "info,cozy_proxy=debug", its rounds and heap in detail).
    if let Some(keep) = std::env::var_os("CPBENCH_LOG") {
        let _ = fs::copy(&log, keep);
    }
    let _ = fs::remove_dir_all(&dir);
    result
}

/// The EndpointSlices of `burst` IPv6 Services (from the 251st) moved to
/// new pods in one write, each to an address of its own: the time until
/// every LB IP's host route leads to its new pod.
fn write_burst(sock: &NlSocket, burst: usize) -> Result<Value> {
    let mut want = Vec::with_capacity(burst);
    let mut slices = Vec::with_capacity(burst);
    for i in 250..250 + burst {
        let pod = format!("2001:db8:2::e:{i:x}");
        want.push((addresses(i).0.parse::<IpAddr>()?, pod.parse::<IpAddr>()?));
        slices.push(serde_json::to_value(&*slice_on(i, &pod)?)?);
    }
    let lbs: Vec<IpAddr> = want.iter().map(|w| w.0).collect();
    let t = Instant::now();
    post_json(ADDR, "/control/apply", &Value::Array(slices))?;
    let posted = t.elapsed();
    loop {
        let found = route::lookup_many(sock, &lbs)?;
        let moved = found
            .iter()
            .zip(&want)
            .filter(|((_, l), (_, pod))| matches!(l, Ok(l) if l.via.gateway == Some(*pod)))
            .count();
        if moved == burst {
            break;
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("burst: {moved} of {burst} changes visible after 120 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(json!({"changes": burst, "write_ms": ms(posted), "api_to_kernel_ms": ms(t.elapsed())}))
}

fn control_plane(args: &[String]) -> Result<()> {
    let sizes: Vec<usize> = args
        .first()
        .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![100, 1000, 10_000, 50_000]);
    let bpffs = harness::test_bpffs()?;
    let mut results = Vec::new();
    // Profiling aids: CPBENCH_BACKENDS=nft (a comma-separated list) runs
    // only these backends; CPBENCH_API_ONLY runs only the controller
    // through the API (debounce 0), skipping the in-process measurements.
    let backends: Vec<&str> = ["nft", "ebpf"]
        .into_iter()
        .filter(|b| {
            std::env::var("CPBENCH_BACKENDS").map_or(true, |l| l.split(',').any(|x| x == *b))
        })
        .collect();
    let api_only = std::env::var_os("CPBENCH_API_ONLY").is_some();
    for &n in &sizes {
        if api_only {
            let mut row = json!({ "services": n });
            for backend in &backends {
                let api = Objects::Api { debounce_ms: 0 };
                row[backend] = controller_run(n, n, backend, api, 100, 0)?;
                eprintln!("control-plane n={n} {backend}: {}", row[backend]);
            }
            results.push(row);
            continue;
        }
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
        let (_, plan_med, _, _) = stats(plan_ms);
        let changes = if n >= 10_000 { 100 } else { 200 };
        let rebuilds = if n >= 10_000 { 5 } else { 20 };
        let mut row = json!({"services": n, "plan_median_ms": plan_med});
        for &backend in &backends {
            let name = format!("cpbench-{}-{backend}-{n}", std::process::id());
            let ns = Netns::enter(&name)?;
            let r = match backend {
                "nft" => bench_backend(
                    Synced::new(NftKernel::new()?),
                    &services,
                    &slices,
                    changes,
                    rebuilds,
                )?,
                _ => {
                    let cfg = EbpfConfig {
                        pin_dir: bpffs.join(&name),
                        interfaces: Interfaces::Named(vec![]),
                        fast_path: false,
                        tc_attach: Default::default(),
                        xdp: cozy_proxy::ebpf::XdpChoice::Off,
                    };
                    bench_backend(
                        Synced::new(EbpfKernel::start(cfg)?),
                        &services,
                        &slices,
                        changes,
                        rebuilds,
                    )?
                }
            };
            drop(ns);
            if std::env::var_os("CPBENCH_APPLY_ONLY").is_some() {
                row[backend] = json!({ "apply": r });
                eprintln!("control-plane n={n} {backend}: {}", row[backend]);
                continue;
            }
            let manifests = controller_run(n, 0, backend, Objects::Manifests, 0, 0)?;
            row[backend] = json!({
                "apply": r,
                "controller_peak_rss_mib": manifests["peak_rss_mib"],
            });
            if n >= 1000 {
                // As many unmanaged Services as managed ones; the
                // controller's default debounce and none.
                // A burst of (up to) 10 000 changes at the default.
                for debounce_ms in [0, 50] {
                    let writes = if debounce_ms == 0 { 100 } else { 40 };
                    let burst = match debounce_ms {
                        0 => 0,
                        _ => n.saturating_sub(250).min(10_000),
                    };
                    let api = Objects::Api { debounce_ms };
                    row[backend][format!("api_debounce_{debounce_ms}ms")] =
                        controller_run(n, n, backend, api, writes, burst)?;
                }
            }
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
