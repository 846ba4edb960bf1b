//! The datapath benchmark (`cargo xtask bench datapath [REPS]`, 5 by default), separate
//! from the tests. In the scenario topology (without the CNI masquerade),
//! the same path ext -> node -> pod1 (ingress) and pod1 -> ext (egress)
//! through every case, all set up side by side and measured in turns
//! (repetition by repetition), once with the veths' offloads off and once
//! on (checksum offload, TSO/GSO: what a real node does):
//! - `baseline` and `baseline_again`: plain routing to the pod IP, no NAT
//!   (twice: the A/A control; their spread is the noise floor);
//! - `baseline_conntrack`: the same routing with conntrack on (one `ct
//!   state` rule), as on a node where kube-proxy, Kube-OVN or a CNI's
//!   masquerade uses it; the eBPF stack path's packets pass conntrack too
//!   (its hairpin masquerade is a `nat` chain);
//! - `nft`, `ebpf` (stack path), `ebpf_fast` (the fast path), `ebpf_xdp`
//!   (the XDP path: the fast path from the XDP program on the uplink,
//!   `--xdp=auto`);
//! - `conntrack_dnat`: the peer, a kube-proxy-style stateful `dnat to` /
//!   `snat to` of the LB IP;
//! - `kube_proxy`: the real kube-proxy (nftables mode, built from its Go
//!   module by `cargo xtask setup`) with a real API server, serving the
//!   same LB IP as an unlabelled LoadBalancer Service with
//!   `externalTrafficPolicy: Local` (the client's address kept, as
//!   cozy-proxy keeps it) on the ports the meters use. Egress is the pod's
//!   own traffic through kube-proxy's chains, leaving with the pod IP:
//!   kube-proxy has no source-IP preservation to measure.
//!
//! Every case's pod has GRO on at its end of its veth, as the XDP path
//! needs of a pod's interface to redirect into it: the topologies are the
//! same in every case.
//!
//! Then "one VM under a flood": pod1 port-filtered (its listed port: the
//! connection meter's), 64-byte UDP datagrams from many source ports at an
//! unlisted port from one CPU, while the connection meter, on the other,
//! opens connections to the listed port: the datapath's drops per second
//! (its own counter) and the connections per second, against the same
//! meter without the flood; for the eBPF backend's stack path (TC drops
//! the flood after routing and conntrack) and its XDP path.
//!
//! Metrics: 64-byte UDP packets per second received at the far end, one
//! flow and many flows (trafgen from a raw socket, the receiver's
//! interface counter), TCP throughput (iperf3), UDP round trip p50/p99
//! (sockperf), and new TCP connections per second: one client connecting
//! and resetting in sequence, the rate taken from the median connection
//! time (robust to the one SYN in a thousand that waits for a
//! retransmission, which made a count over a fixed time spread 10x).
use cozy_proxy_testkit as harness;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if datapath::helper(&args)? {
        return Ok(());
    }
    datapath::run(&args)
}

mod datapath {
    use super::harness::{
        control_plane::k8s::ControlPlane,
        controller::manifests::{slice, Svc},
        nodes::net::{Fam, Net},
        nodes::topology::Topology,
        packets::frames::mac,
        sh::{feed_in, ok_in, run_in, Proc},
        traffic::eventually,
        Backend, Env,
    };
    use anyhow::{bail, Context, Result};
    use serde_json::{json, Value};
    use std::{net::IpAddr, process::Stdio, time::Duration};

    const SECONDS: u64 = 2;
    const CASES: [&str; 9] = [
        "baseline",
        "baseline_again",
        "baseline_conntrack",
        "nft",
        "ebpf",
        "ebpf_fast",
        "ebpf_xdp",
        "conntrack_dnat",
        "kube_proxy",
    ];

    /// The flood's cases, and the port it is aimed at (unlisted).
    const FLOOD_CASES: [&str; 2] = ["ebpf", "ebpf_xdp"];
    const FLOOD_PORT: u16 = 9999;

    /// The ports the meters use (trafgen's UDP, iperf3, sockperf, the
    /// connection meter): what a port-based proxy has to list.
    const PORTS: [(&str, u16); 4] = [("UDP", 9), ("TCP", 5201), ("UDP", 11111), ("TCP", 6000)];

    pub enum Holder {
        Plain(Topology),
        Cozy(Box<Env>),
        /// Held for its processes; the first field, so stopped before
        /// the namespaces it runs in are removed.
        Api {
            _control_plane: Box<ControlPlane>,
            topo: Topology,
        },
    }

    pub struct Case {
        name: &'static str,
        holder: Holder,
    }

    impl Case {
        fn topo(&self) -> &Topology {
            match &self.holder {
                Holder::Plain(t) => t,
                Holder::Cozy(e) => &e.topo,
                Holder::Api { topo, .. } => topo,
            }
        }

        /// Where ext sends to reach pod1.
        fn target(&self, net: &Net) -> IpAddr {
            if self.name.starts_with("baseline") {
                net.pods[0]
            } else {
                net.lbs[0]
            }
        }
    }

    fn no_cni_masquerade(t: &Topology) -> Result<()> {
        // No case pays for a NAT it does not use, and the baseline is
        // routing alone.
        ok_in(&t.node(), &["nft", "delete", "table", "ip", "cni"])?;
        ok_in(&t.node(), &["nft", "delete", "table", "ip6", "cni"]).map(|_| ())
    }

    /// Every veth end of the topology.
    fn veth_ends(t: &Topology) -> Vec<(String, String)> {
        let mut v = vec![
            (t.node(), "uplink".to_string()),
            (t.ext(), "uplink".to_string()),
        ];
        for i in 1..=t.pods {
            v.push((t.node(), format!("pod{i}")));
            v.push((t.pod(i), "eth0".to_string()));
        }
        v
    }

    fn backend_of(case: &str) -> Backend {
        match case {
            "nft" => Backend::Nft,
            "ebpf" => Backend::Ebpf,
            "ebpf_xdp" => Backend::EbpfXdp,
            _ => Backend::EbpfFast,
        }
    }

    /// GRO on at the pods' ends of their veths (as the XDP path needs).
    /// DPBENCH_POD_GRO=0 (a profiling aid): left as the veth has it.
    fn pods_gro_on(t: &Topology) -> Result<()> {
        if std::env::var("DPBENCH_POD_GRO").as_deref() == Ok("0") {
            return Ok(());
        }
        for i in 1..=t.pods {
            ok_in(&t.pod(i), &["ethtool", "-K", "eth0", "gro", "on"])?;
        }
        Ok(())
    }

    /// A case's topology as every case is measured: without the CNI
    /// masquerade, the veths' offloads as chosen, GRO at the pods.
    fn as_measured(t: &Topology, offloads: bool) -> Result<()> {
        no_cni_masquerade(t)?;
        set_offloads(t, offloads)?;
        pods_gro_on(t)
    }

    fn set_offloads(t: &Topology, on: bool) -> Result<()> {
        let state = if on { "on" } else { "off" };
        for (ns, dev) in veth_ends(t) {
            ok_in(&ns, &["ethtool", "-K", &dev, "tx", state])?;
        }
        Ok(())
    }

    /// A topology whose node runs the nft `rules` (`nft -f`) and nothing
    /// of ours.
    fn plain_with_rules(rules: &str) -> Result<Holder> {
        let t = Topology::new()?;
        let out = feed_in(&t.node(), &["nft", "-f", "-"], rules.as_bytes(), 5)?;
        if !out.status.success() {
            bail!("the case's rules: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(Holder::Plain(t))
    }

    fn setup(name: &'static str, net: &Net, offloads: bool) -> Result<Case> {
        let holder = match name {
            "baseline" | "baseline_again" => Holder::Plain(Topology::new()?),
            "baseline_conntrack" => plain_with_rules(
                "table inet conntrack_on {\n chain pre { type filter hook prerouting priority filter; ct state established,related accept; }\n}\n",
            )?,
            "conntrack_dnat" => plain_with_rules(&format!(
                "table ip peer {{\n chain pre {{ type nat hook prerouting priority dstnat; ip daddr {lb} dnat to {pod}; }}\n \
                 chain post {{ type nat hook postrouting priority srcnat; ip saddr {pod} oifname \"uplink\" snat to {lb}; }}\n}}\n",
                lb = net.lbs[0],
                pod = net.pods[0]
            ))?,
            "kube_proxy" => {
                let t = Topology::new()?;
                Holder::Api {
                    _control_plane: Box::new(kube_proxy(&t, net)?),
                    topo: t,
                }
            }
            backend => {
                let b = backend_of(backend);
                let mut env = Env::new(b, Fam::V4)?;
                env.dir.put("vm1", &Svc::new("vm1", net.lbs[0]).yaml())?;
                env.dir.put(
                    "vm1-eps",
                    &slice("vm1", "IPv4", &[(net.pods[0].to_string(), None)]),
                )?;
                env.settle()?;
                Holder::Cozy(Box::new(env))
            }
        };
        let case = Case { name, holder };
        as_measured(case.topo(), offloads)?;
        // Neighbours learnt both ways before anything is measured.
        let t = case.topo();
        let ping = |ns: &str, dst: IpAddr| {
            ok_in(
                ns,
                &["ping", "-c", "2", "-i", "0.2", "-W", "1", &dst.to_string()],
            )
        };
        // kube-proxy forwards only the Service's ports: ICMP to its LB IP
        // goes nowhere, the pod IP takes the same two hops.
        let warm = if name == "kube_proxy" {
            net.pods[0]
        } else {
            case.target(net)
        };
        ping(&t.ext(), warm)?;
        ping(&t.pod(1), net.ext)?;
        Ok(case)
    }

    /// A real API server in the node's namespace and the real kube-proxy
    /// serving the LB IP on [`PORTS`] to pod1, on node1; returns once
    /// kube-proxy's ruleset has the LB IP and its endpoint.
    fn kube_proxy(t: &Topology, net: &Net) -> Result<ControlPlane> {
        let mut cp = ControlPlane::start(
            &t.node(),
            std::env::temp_dir().join(format!("{}-k8s", t.prefix)),
        )?;
        cp.create_node("node1")?;
        cp.set_node_address("node1", net.node)?;
        cp.start_kube_proxy("node1")?;
        let mut svc = Svc::new("vm1", net.lbs[0]);
        svc.label = false;
        svc.ports = PORTS
            .iter()
            .map(|(p, n)| (p.to_string(), i32::from(*n)))
            .collect();
        cp.put_service(&svc, "IPv4", &[(net.pods[0].to_string(), None)], "node1")?;
        cp.kubectl(&[
            "patch",
            "service",
            "vm1",
            "-n",
            "default",
            "--type=merge",
            "-p",
            r#"{"spec":{"externalTrafficPolicy":"Local"}}"#,
        ])?;
        cp.wait_ready_endpoint("vm1", &net.pods[0].to_string(), Duration::from_secs(30))?;
        let (lb, pod) = (net.lbs[0].to_string(), net.pods[0].to_string());
        eventually(Duration::from_secs(30), || {
            let table = ok_in(&t.node(), &["nft", "list", "table", "ip", "kube-proxy"])?;
            if table.contains(&lb) && table.contains(&pod) {
                Ok(())
            } else {
                bail!("kube-proxy has not programmed {lb} -> {pod} yet:\n{table}")
            }
        })?;
        Ok(cp)
    }

    fn rx_packets(ns: &str, dev: &str) -> Result<u64> {
        let out = ok_in(ns, &["ip", "-s", "-j", "link", "show", "dev", dev])?;
        let v: Value = serde_json::from_str(&out)?;
        v[0]["stats64"]["rx"]["packets"]
            .as_u64()
            .context("rx packets")
    }

    /// 64-byte UDP frames from `from` (its `dev`, toward `peer_dev` of
    /// `peer_ns`) to `dst` at `dport`, one flow or many (random source
    /// ports).
    pub struct Frames<'a> {
        from: &'a str,
        dev: &'a str,
        peer_ns: &'a str,
        peer_dev: &'a str,
        src: IpAddr,
        dst: IpAddr,
        dport: u16,
        many_flows: bool,
    }

    impl Frames<'_> {
        /// trafgen sending them for SECONDS from one CPU (the first):
        /// the command, and its configuration file (to be kept while it
        /// runs).
        fn trafgen(&self) -> Result<(Vec<String>, std::path::PathBuf)> {
            let fmt_mac = |m: [u8; 6]| {
                m.iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":")
            };
            let (da, sa) = (
                fmt_mac(mac(self.peer_ns, self.peer_dev)?),
                fmt_mac(mac(self.from, self.dev)?),
            );
            let sport = if self.many_flows { "drnd()" } else { "40000" };
            let (src, dst, dport) = (self.src, self.dst, self.dport);
            // 60 bytes on the wire (64 with the FCS).
            let conf = format!(
                "{{ eth(da={da}, sa={sa}), ipv4(sa={src}, da={dst}, ttl=64), udp(sp={sport}, dp={dport}), fill(0x00, 18) }}\n"
            );
            let file = std::env::temp_dir()
                .join(format!("bench-trafgen-{}-{dport}.cfg", std::process::id()));
            std::fs::write(&file, conf)?;
            let cmd = [
                "timeout",
                "-s",
                "INT",
                &SECONDS.to_string(),
                "trafgen",
                "--dev",
                self.dev,
                "--conf",
                &file.display().to_string(),
                "--cpus",
                "1",
                "-C",
                "-q",
            ]
            .map(String::from)
            .to_vec();
            Ok((cmd, file))
        }
    }

    /// The frames for SECONDS: packets per second arriving at `rx`'s
    /// interface.
    fn pps(frames: &Frames<'_>, rx: (&str, &str)) -> Result<f64> {
        let (cmd, _conf) = frames.trafgen()?;
        let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let before = rx_packets(rx.0, rx.1)?;
        let start = std::time::Instant::now();
        let _ = run_in(frames.from, &cmd)?;
        let took = start.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(200));
        let after = rx_packets(rx.0, rx.1)?;
        Ok((after - before) as f64 / took)
    }

    fn iperf(server_ns: &str, client_ns: &str, target: IpAddr) -> Result<f64> {
        let _server = Proc::spawn_in(
            server_ns,
            &["iperf3", "-s", "-1", "-p", "5201"],
            Stdio::null(),
            Stdio::null(),
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let t = target.to_string();
        let secs = SECONDS.to_string();
        let out = run_in(
            client_ns,
            &["iperf3", "-c", &t, "-p", "5201", "-t", &secs, "-J"],
        )?;
        let v: Value = serde_json::from_slice(&out.stdout).context("iperf3 JSON")?;
        v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .map(|b| b / 1e9)
            .with_context(|| format!("iperf3 gave no rate: {}", v["error"]))
    }

    /// `cmd` run on CPU `cpu` only.
    fn pinned<'a>(cpu: &'a str, cmd: &[&'a str]) -> Vec<&'a str> {
        ["taskset", "-c", cpu]
            .into_iter()
            .chain(cmd.iter().copied())
            .collect()
    }

    /// New TCP connections per second, from the median connection time.
    fn connections(server_ns: &str, client_ns: &str, target: IpAddr) -> Result<f64> {
        let exe = std::env::current_exe()?.display().to_string();
        // Client and server on one CPU, the last: a connect is a few
        // round trips of wake-ups, and where the scheduler places the two
        // moved the median from run to run (5 runs of 2 s: max/min
        // 1.17-1.49 unpinned, 1.04-1.20 pinned; baseline and ebpf_fast,
        // both directions).
        let cpu = std::thread::available_parallelism()
            .map_or(0, |n| n.get() - 1)
            .to_string();
        let server_cmd = pinned(&cpu, &[&exe, "accept-server", "6000"]);
        let _server = Proc::spawn_in(server_ns, &server_cmd, Stdio::null(), Stdio::null())?;
        std::thread::sleep(Duration::from_millis(300));
        let (target, secs) = (target.to_string(), SECONDS.to_string());
        let client_cmd = pinned(&cpu, &[&exe, "connect-client", &target, "6000", &secs]);
        let out = ok_in(client_ns, &client_cmd)?;
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
                &SECONDS.to_string(),
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

    /// pod1 port-filtered (the connection meter's port listed), its
    /// datapath ready, for the flood.
    fn flood_case(name: &'static str, net: &Net) -> Result<Env> {
        let mut env = Env::new(backend_of(name), Fam::V4)?;
        let svc = Svc::new("vm1", net.lbs[0]).filter(&[("TCP", 6000)]);
        env.dir.put("vm1", &svc.yaml())?;
        env.dir.put(
            "vm1-eps",
            &slice("vm1", "IPv4", &[(net.pods[0].to_string(), None)]),
        )?;
        env.settle()?;
        as_measured(&env.topo, true)?;
        // Neighbours learnt both ways (ICMP is not listed: from the pod).
        ok_in(
            &env.topo.pod(1),
            &[
                "ping",
                "-c",
                "2",
                "-i",
                "0.2",
                "-W",
                "1",
                &net.ext.to_string(),
            ],
        )?;
        Ok(env)
    }

    /// The datapath's drops at the filtered pod's unlisted ports so far.
    fn filtered_drops(env: &Env) -> Result<u64> {
        env.dump_json()?["counters"]["drops"]["filtered_port"]["packets"]
            .as_u64()
            .context("filtered_port drops")
    }

    /// One repetition of the flood for one case: connections per second to
    /// the listed port without it, and during it; the datapath's drops per
    /// second during it.
    fn under_flood(env: &Env, net: &Net) -> Result<[f64; 3]> {
        let t = &env.topo;
        let (ext, pod1) = (t.ext(), t.pod(1));
        let lb = net.lbs[0];
        let free = connections(&pod1, &ext, lb)?;
        let frames = Frames {
            from: &ext,
            dev: "uplink",
            peer_ns: &t.node(),
            peer_dev: "uplink",
            src: net.ext,
            dst: lb,
            dport: FLOOD_PORT,
            many_flows: true,
        };
        let (cmd, _conf) = frames.trafgen()?;
        let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let before = filtered_drops(env)?;
        let start = std::time::Instant::now();
        let mut flood = Proc::spawn_in(&ext, &cmd, Stdio::null(), Stdio::null())?;
        // The meter runs on the last CPU, trafgen on the first.
        std::thread::sleep(Duration::from_millis(100));
        let served = connections(&pod1, &ext, lb)?;
        let _ = flood.child.wait();
        let took = start.elapsed().as_secs_f64();
        let dropped = (filtered_drops(env)? - before) as f64 / took;
        Ok([free, served, dropped])
    }

    const FLOOD_METRICS: [&str; 3] = ["conn_per_s_without", "conn_per_s_during", "dropped_per_s"];

    fn flood(net: &Net, reps: usize) -> Result<Value> {
        let envs: Vec<(&str, Env)> = FLOOD_CASES
            .iter()
            .filter(|c| chosen("DPBENCH_CASES", c))
            .map(|c| Ok((*c, flood_case(c, net)?)))
            .collect::<Result<_>>()?;
        let mut runs = vec![vec![Vec::new(); FLOOD_METRICS.len()]; envs.len()];
        for rep in 0..reps {
            for ((name, env), r) in envs.iter().zip(runs.iter_mut()) {
                let values =
                    under_flood(env, net).with_context(|| format!("{name} under a flood"))?;
                eprintln!("datapath flood rep {rep} {name}: {values:?}");
                for (m, v) in values.into_iter().enumerate() {
                    r[m].push(v);
                }
            }
        }
        let mut out = serde_json::Map::new();
        for ((name, _), r) in envs.iter().zip(runs) {
            let m: serde_json::Map<String, Value> = (FLOOD_METRICS.iter())
                .zip(r)
                .map(|(k, v)| (k.to_string(), summary(v)))
                .collect();
            out.insert(name.to_string(), Value::Object(m));
        }
        Ok(Value::Object(out))
    }

    fn summary(mut v: Vec<f64>) -> Value {
        v.sort_by(|a, b| a.total_cmp(b));
        json!({"min": v[0], "median": v[v.len() / 2], "max": v[v.len() - 1], "runs": v})
    }

    const METRICS: [&str; 6] = [
        "pps_one_flow",
        "pps_many_flows",
        "tcp_gbps",
        "rtt_p50_us",
        "rtt_p99_us",
        "conn_per_s",
    ];

    /// One repetition of every metric for one case and direction.
    fn measure(case: &Case, net: &Net, dir: &str) -> Result<Vec<f64>> {
        let t = case.topo();
        let (ext, node, pod1) = (t.ext(), t.node(), t.pod(1));
        let target = case.target(net);
        let (from, dev, peer_dev, src, dst, rx, server, client, to) = if dir == "ingress" {
            (
                ext.clone(),
                "uplink",
                "uplink",
                net.ext,
                target,
                (pod1.as_str(), "eth0"),
                pod1.as_str(),
                ext.as_str(),
                target,
            )
        } else {
            (
                pod1.clone(),
                "eth0",
                "pod1",
                net.pods[0],
                net.ext,
                (ext.as_str(), "uplink"),
                ext.as_str(),
                pod1.as_str(),
                net.ext,
            )
        };
        // DPBENCH_METRICS (a profiling aid): only these metrics are
        // measured, the others are reported as null.
        let wanted = |m: &str| chosen("DPBENCH_METRICS", m);
        let mut v = vec![f64::NAN; METRICS.len()];
        let frames = |many_flows| Frames {
            from: &from,
            dev,
            peer_ns: &node,
            peer_dev,
            src,
            dst,
            dport: 9,
            many_flows,
        };
        if wanted("pps_one_flow") {
            v[0] = pps(&frames(false), rx)?;
        }
        if wanted("pps_many_flows") {
            v[1] = pps(&frames(true), rx)?;
        }
        if wanted("tcp_gbps") {
            v[2] = iperf(server, client, to)?;
        }
        if wanted("rtt_p50_us") || wanted("rtt_p99_us") {
            (v[3], v[4]) = latency(server, client, to)?;
        }
        if wanted("conn_per_s") {
            v[5] = connections(server, client, to)?;
        }
        Ok(v)
    }

    /// [`measure`], again after a failed attempt (a meter that got no
    /// answer, as iperf3 once in a few hundred runs here), up to three
    /// times; each failure is printed.
    fn measured(case: &Case, net: &Net, dir: &str) -> Result<Vec<f64>> {
        let mut attempt = 1;
        loop {
            match measure(case, net, dir) {
                Err(e) if attempt < 3 => {
                    eprintln!(
                        "datapath {} {dir}, attempt {attempt}: {e:#}; again",
                        case.name
                    );
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    /// Is `name` in the comma-separated list `var` (everything is, when
    /// `var` is not set)?
    fn chosen(var: &str, name: &str) -> bool {
        std::env::var(var).map_or(true, |list| list.split(',').any(|x| x == name))
    }

    pub fn run(args: &[String]) -> Result<()> {
        let reps: usize = args.first().and_then(|r| r.parse().ok()).unwrap_or(5);
        let net = Net::new(Fam::V4);
        let mut results = serde_json::Map::new();
        // DPBENCH_CASES, DPBENCH_OFFLOADS (profiling aids): only these
        // cases, only offloads on or off.
        let names: Vec<&str> = CASES
            .into_iter()
            .filter(|c| chosen("DPBENCH_CASES", c))
            .collect();
        let offload_modes: Vec<bool> = match std::env::var("DPBENCH_OFFLOADS").as_deref() {
            Ok("on") => vec![true],
            Ok("off") => vec![false],
            _ => vec![false, true],
        };
        for offloads in offload_modes {
            let cases: Vec<Case> = names
                .iter()
                .map(|name| setup(name, &net, offloads))
                .collect::<Result<_>>()?;
            // runs[case][dir][metric]
            let mut runs = vec![vec![vec![Vec::new(); METRICS.len()]; 2]; cases.len()];
            for rep in 0..reps {
                for (c, case) in cases.iter().enumerate() {
                    for (d, dir) in ["ingress", "egress"].iter().enumerate() {
                        // DPBENCH_DIRS (a profiling aid): only these
                        // directions, the others reported as null.
                        if !chosen("DPBENCH_DIRS", dir) {
                            for metric in runs[c][d].iter_mut() {
                                metric.push(f64::NAN);
                            }
                            continue;
                        }
                        let values = measured(case, &net, dir)
                            .with_context(|| format!("{} {dir}", case.name))?;
                        eprintln!(
                            "datapath offloads={offloads} rep {rep} {} {dir}: {values:?}",
                            case.name
                        );
                        for (m, v) in values.into_iter().enumerate() {
                            runs[c][d][m].push(v);
                        }
                    }
                }
            }
            let mut per_case = serde_json::Map::new();
            for (c, case) in cases.iter().enumerate() {
                let mut per_dir = serde_json::Map::new();
                for (d, dir) in ["ingress", "egress"].iter().enumerate() {
                    let mut m = serde_json::Map::new();
                    for (k, metric) in METRICS.iter().enumerate() {
                        m.insert(metric.to_string(), summary(runs[c][d][k].clone()));
                    }
                    per_dir.insert(dir.to_string(), Value::Object(m));
                }
                per_case.insert(case.name.into(), Value::Object(per_dir));
            }
            let key = if offloads {
                "offloads_on"
            } else {
                "offloads_off"
            };
            results.insert(key.into(), Value::Object(per_case));
            drop(cases);
        }
        // DPBENCH_FLOOD=0 (a profiling aid): no flood section.
        let flood = if std::env::var("DPBENCH_FLOOD").as_deref() == Ok("0") {
            Value::Null
        } else {
            flood(&net, reps)?
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "datapath": results, "flood": flood, "cases": names, "repetitions": reps,
                "seconds_per_run": SECONDS,
            }))?
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
                let mut times = Vec::new();
                while std::time::Instant::now() < end {
                    let start = std::time::Instant::now();
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
                    times.push(start.elapsed().as_secs_f64());
                }
                if times.is_empty() {
                    bail!("no connection made");
                }
                times.sort_by(|a, b| a.total_cmp(b));
                println!("{}", 1.0 / times[times.len() / 2]);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
