//! The datapath benchmark (`cargo xtask bench datapath`), separate from the
//! tests: in the scenario topology, in one run, the same path ext -> node ->
//! pod1 (and pod1 -> ext) through (a) plain routing to the pod IP, no NAT at
//! all (the baseline), (b) the nft backend, (c) the eBPF backend, (d) a
//! kube-proxy-style stateful conntrack DNAT/SNAT of the LB IP (`nft ...
//! dnat to`). TCP throughput and 64-byte UDP packet rate (iperf3), new TCP
//! connections per second, UDP round-trip latency (sockperf); each repeated
//! and reported min/median/max.
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
