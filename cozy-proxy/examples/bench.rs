//! Benchmarks (`cargo xtask bench control-plane|datapath`), separate from
//! the tests: nothing in the test suite depends on timing.
//!
//! control-plane: plan computation and datapath apply for 100 .. 50 000
//! managed Services (mixed IPv4/IPv6, mixed modes) on both backends, in a
//! network namespace of its own: full initial sync, one change applied
//! (median, p99), and as peer a rebuild-everything strategy (empty the
//! datapath, fill it again) for the same change; peak RSS of the real
//! controller (`cozy-proxy run` on the same Services as manifests).
//!
//! datapath: see `datapath` below.
#[path = "../tests/harness/mod.rs"]
mod harness;

use anyhow::{bail, Context, Result};
use cozy_proxy::{
    datapath::{Datapath, DatapathState},
    ebpf::{EbpfBackend, EbpfConfig, Interfaces},
    model::compute_plan,
    nft::NftBackend,
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
    if datapath::helper(&args)? {
        return Ok(());
    }
    match args.first().map(String::as_str) {
        Some("control-plane") => control_plane(&args[1..]),
        Some("datapath") => datapath::run(&args[1..]),
        _ => bail!("usage: bench control-plane [SIZES] | datapath"),
    }
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
    if live.state != current {
        let d = live.state.diff(&current);
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
            outcome = Some(compute_plan(&services, &slices));
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
        let state = DatapathState::from_plan(&outcome.plan);
        let (_, plan_med, _, _) = stats(plan_ms);
        let changes = if n >= 10_000 { 100 } else { 200 };
        let rebuilds = if n >= 10_000 { 5 } else { 20 };
        let mut row = json!({"services": n, "plan_median_ms": plan_med});
        for backend in ["nft", "ebpf"] {
            let name = format!("cpbench-{}-{backend}-{n}", std::process::id());
            let ns = Netns::enter(&name)?;
            let r = match backend {
                "nft" => bench_backend(NftBackend::new()?, &state, n, changes, rebuilds)?,
                _ => {
                    let cfg = EbpfConfig {
                        pin_dir: bpffs.join(&name),
                        interfaces: Interfaces::Named(vec![]),
                    };
                    bench_backend(EbpfBackend::new(cfg)?, &state, n, changes, rebuilds)?
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

/// datapath: in the scenario topology, in one run, the same path
/// ext -> node -> pod1 (and pod1 -> ext) through (a) plain routing to the pod
/// IP, no NAT at all (the baseline), (b) the nft backend, (c) the eBPF
/// backend, (d) a kube-proxy-style stateful conntrack DNAT/SNAT of the LB IP
/// (`nft ... dnat to`). TCP throughput and 64-byte UDP packet rate
/// (iperf3), new TCP connections per second, UDP round-trip latency
/// (sockperf); each repeated and reported min/median/max.
mod datapath {
    use super::harness::{
        manifests::{slice, Svc},
        net::{Fam, Net},
        sh::{feed_in, ok_in, run_in, Proc},
        topology::Topology,
        Backend, Env,
    };
    use anyhow::{bail, Context, Result};
    use serde_json::{json, Value};
    use std::{net::IpAddr, process::Stdio, time::Duration};

    const SECONDS: &str = "2";

    pub enum Case {
        Baseline(Topology),
        Cozy(Box<Env>),
        Conntrack(Topology),
    }

    impl Case {
        fn topo(&self) -> &Topology {
            match self {
                Case::Baseline(t) | Case::Conntrack(t) => t,
                Case::Cozy(e) => &e.topo,
            }
        }
    }

    /// Where ext sends to reach pod1 in each case.
    fn target(case: &Case, net: &Net) -> IpAddr {
        match case {
            Case::Baseline(_) => net.pods[0],
            _ => net.lbs[0],
        }
    }

    fn no_cni_masquerade(t: &Topology) -> Result<()> {
        // Every case without the CNI's masquerade: the baseline must be
        // routing alone, and no case pays for a NAT it does not use.
        ok_in(&t.node(), &["nft", "delete", "table", "ip", "cni"])?;
        ok_in(&t.node(), &["nft", "delete", "table", "ip6", "cni"]).map(|_| ())
    }

    fn setup(name: &str, net: &Net) -> Result<Case> {
        Ok(match name {
            "baseline" => {
                let t = Topology::new()?;
                no_cni_masquerade(&t)?;
                Case::Baseline(t)
            }
            "conntrack_dnat" => {
                let t = Topology::new()?;
                no_cni_masquerade(&t)?;
                let rules = format!(
                    "table ip peer {{\n chain pre {{ type nat hook prerouting priority dstnat; ip daddr {lb} dnat to {pod}; }}\n \
                     chain post {{ type nat hook postrouting priority srcnat; ip saddr {pod} oifname \"uplink\" snat to {lb}; }}\n}}\n",
                    lb = net.lbs[0],
                    pod = net.pods[0]
                );
                let out = feed_in(&t.node(), &["nft", "-f", "-"], rules.as_bytes(), 5)?;
                if !out.status.success() {
                    bail!("peer rules: {}", String::from_utf8_lossy(&out.stderr));
                }
                Case::Conntrack(t)
            }
            backend => {
                let b = if backend == "nft" {
                    Backend::Nft
                } else {
                    Backend::Ebpf
                };
                let mut env = Env::new(b, Fam::V4)?;
                no_cni_masquerade(&env.topo)?;
                env.dir.put("vm1", &Svc::new("vm1", net.lbs[0]).yaml())?;
                env.dir.put(
                    "vm1-eps",
                    &slice("vm1", "IPv4", &[(net.pods[0].to_string(), None)]),
                )?;
                env.settle()?;
                Case::Cozy(Box::new(env))
            }
        })
    }

    fn iperf(server_ns: &str, client_ns: &str, target: IpAddr, udp: bool) -> Result<f64> {
        let _server = Proc::spawn_in(
            server_ns,
            &["iperf3", "-s", "-1", "-p", "5201"],
            Stdio::null(),
            Stdio::null(),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let t = target.to_string();
        let mut args = vec!["iperf3", "-c", &t, "-p", "5201", "-t", SECONDS, "-J"];
        if udp {
            args.extend(["-u", "-l", "64", "-b", "0"]);
        }
        let out = run_in(client_ns, &args)?;
        let v: Value = serde_json::from_slice(&out.stdout).context("iperf3 JSON")?;
        if udp {
            let sum = &v["end"]["sum"];
            let packets = sum["packets"].as_f64().context("packets")?;
            let lost = sum["lost_packets"].as_f64().unwrap_or(0.0);
            let secs = sum["seconds"].as_f64().context("seconds")?;
            Ok((packets - lost) / secs)
        } else {
            v["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .context("bps")
        }
    }

    /// New TCP connections per second (connect, close) for 2 s.
    fn connections(server_ns: &str, client_ns: &str, target: IpAddr) -> Result<f64> {
        let exe = std::env::current_exe()?.display().to_string();
        let _server = Proc::spawn_in(
            server_ns,
            &[&exe, "accept-server", "6000"],
            Stdio::null(),
            Stdio::null(),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let out = ok_in(
            client_ns,
            &[&exe, "connect-client", &target.to_string(), "6000", SECONDS],
        )?;
        out.trim().parse::<f64>().context("connections per second")
    }

    /// UDP round trip, (p50, p99) in microseconds.
    fn latency(server_ns: &str, client_ns: &str, target: IpAddr) -> Result<(f64, f64)> {
        let _server = Proc::spawn_in(
            server_ns,
            &["sockperf", "sr", "-i", "0.0.0.0", "-p", "11111"],
            Stdio::null(),
            Stdio::null(),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let out = run_in(
            client_ns,
            &[
                "sockperf",
                "pp",
                "-i",
                &target.to_string(),
                "-p",
                "11111",
                "-t",
                SECONDS,
            ],
        )?;
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        let pct = |p: &str| -> Option<f64> {
            text.lines()
                .find(|l| l.contains(&format!("percentile {p}")))
                .and_then(|l| l.split('=').nth(1))
                .and_then(|v| v.trim().parse().ok())
        };
        match (pct("50.000"), pct("99.000")) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => bail!("sockperf output: {text}"),
        }
    }

    fn summary(mut v: Vec<f64>) -> Value {
        v.sort_by(|a, b| a.total_cmp(b));
        json!({"min": v[0], "median": v[v.len() / 2], "max": v[v.len() - 1]})
    }

    pub fn run(args: &[String]) -> Result<()> {
        let reps: usize = args.first().and_then(|r| r.parse().ok()).unwrap_or(5);
        let net = Net::new(Fam::V4);
        let mut results = serde_json::Map::new();
        for name in ["baseline", "nft", "ebpf", "conntrack_dnat"] {
            let case = setup(name, &net)?;
            let t = case.topo();
            let (ext, pod1) = (t.ext(), t.pod(1));
            let mut per_dir = serde_json::Map::new();
            for (dir, server, client, to) in [
                ("ingress", pod1.as_str(), ext.as_str(), target(&case, &net)),
                ("egress", ext.as_str(), pod1.as_str(), net.ext),
            ] {
                let (mut tcp, mut udp, mut cps, mut p50, mut p99) =
                    (vec![], vec![], vec![], vec![], vec![]);
                for _ in 0..reps {
                    tcp.push(iperf(server, client, to, false)? / 1e9);
                    udp.push(iperf(server, client, to, true)?);
                    cps.push(connections(server, client, to)?);
                    let (a, b) = latency(server, client, to)?;
                    p50.push(a);
                    p99.push(b);
                }
                let r = json!({
                    "tcp_gbps": summary(tcp), "udp64_pps": summary(udp), "tcp_conn_per_s": summary(cps),
                    "rtt_p50_us": summary(p50), "rtt_p99_us": summary(p99),
                });
                eprintln!("datapath {name} {dir}: {r}");
                per_dir.insert(dir.into(), r);
            }
            results.insert(name.into(), Value::Object(per_dir));
        }
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"datapath": results, "repetitions": reps, "seconds_per_run": SECONDS})
            )?
        );
        Ok(())
    }

    /// Helper processes run inside the namespaces.
    pub fn helper(args: &[String]) -> Result<bool> {
        use std::net::{TcpListener, TcpStream};
        match args.first().map(String::as_str) {
            Some("accept-server") => {
                let port = args.get(1).context("port")?;
                let listener = TcpListener::bind(format!("0.0.0.0:{port}"))?;
                // Never close first (no FIN, no TIME_WAIT here): the client
                // resets each connection; reset sockets are dropped in bulk.
                let mut held = Vec::new();
                for stream in listener.incoming() {
                    held.push(stream);
                    if held.len() > 4096 {
                        held.clear();
                    }
                }
                Ok(true)
            }
            Some("connect-client") => {
                let target: IpAddr = args.get(1).context("target")?.parse()?;
                let port: u16 = args.get(2).context("port")?.parse()?;
                let secs: u64 = args.get(3).context("seconds")?.parse()?;
                let end = std::time::Instant::now() + Duration::from_secs(secs);
                let mut n = 0u64;
                while std::time::Instant::now() < end {
                    // A lost SYN (a full backlog) costs its timeout, not the run.
                    let Ok(s) =
                        TcpStream::connect_timeout(&(target, port).into(), Duration::from_secs(1))
                    else {
                        continue;
                    };
                    // RST on close (SO_LINGER 0): no TIME_WAIT pile-up.
                    let linger = libc::linger {
                        l_onoff: 1,
                        l_linger: 0,
                    };
                    // SAFETY: valid option value for the socket we own.
                    unsafe {
                        libc::setsockopt(
                            std::os::fd::AsRawFd::as_raw_fd(&s),
                            libc::SOL_SOCKET,
                            libc::SO_LINGER,
                            &linger as *const _ as *const libc::c_void,
                            std::mem::size_of::<libc::linger>() as u32,
                        );
                    }
                    drop(s);
                    n += 1;
                }
                println!("{}", n as f64 / secs as f64);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
