//! The Cilium lane: the real Cilium agent (cozy-proxy-testkit/src/agents/cilium.rs:
//! Cilium 1.20 configured by its own chart with Cozystack's values) on both
//! nodes of a two-node namespace cluster with the real control plane and
//! MetalLB, beside cozy-proxy's eBPF backend; every pod a Cilium endpoint,
//! announced by Cilium's own CNI plugin after the primary one. Checked:
//! Cilium's kube-proxy replacement skips cozy-proxy's Services and serves
//! a ClusterIP Service; cozy-proxy's programs run first on every hook, with
//! Cilium's after them in the same chains; the scenario subset (outside ->
//! LB IP, egress as the LB IP, the port filter, in-cluster clients, the
//! node's own socket); and an agent restart while traffic flows. IPv4, as
//! Cozystack runs Cilium. Needs root and `cargo xtask setup`.
use anyhow::{bail, ensure, Context, Result};
use cozy_proxy_testkit::{
    agents::cilium::{self, Cilium},
    control_plane::k8s::{api_service, ControlPlane, SELECTOR_LABEL},
    control_plane::metallb::MetalLb,
    controller::manifests::Svc,
    nodes::cluster::{pod, Cluster, ClusterShape, ClusterSource, Pod},
    nodes::net::Fam,
    sh::feed_in,
    traffic::across::Streams,
    traffic::{answer, eventually, tcp_request, Server, SETTLE},
    Backend,
};
use std::{net::IpAddr, time::Duration};

const PORT: u16 = 8080;
/// Not listed by the filtered Service.
const UNLISTED: u16 = 8082;
/// The ClusterIP Service's port (to the pod's PORT).
const CLUSTER_PORT: u16 = 80;

/// The mapped pods and the Cilium-served backend.
const VM: Pod = pod(1, 1);
const VMF: Pod = pod(2, 1);
const WEB: Pod = pod(2, 2);

fn name(p: Pod) -> String {
    format!("n{}p{}", p.node, p.index)
}

/// The cluster, cozy-proxy on both nodes, Cilium's agents started after
/// it, every pod in the API and announced to its node's agent.
struct Lane {
    c: Cluster,
    cilium: Cilium,
}

impl Lane {
    /// On routed nodes: Cilium on the uplinks, every pod's veth its
    /// endpoint. On Kube-OVN's shape: Cilium on the uplinks and `ovn0`
    /// (the pods' veths are beyond the node there).
    fn new(shape: ClusterShape) -> Result<Lane> {
        let c = Cluster::with_source(Backend::Ebpf, Fam::V4, shape, ClusterSource::RealApi)?;
        let devices = match shape {
            ClusterShape::Gateway => "uplink ovn0",
            _ => "uplink",
        };
        let cilium = cilium::on_cluster(&c, devices)?;
        let lane = Lane { c, cilium };
        for k in 1..=2 {
            for i in 1..=3 {
                let p = pod(k, i);
                let backs = match p {
                    VM => "vm",
                    VMF => "vmf",
                    WEB => "web",
                    _ => "none",
                };
                lane.put_pod(p, backs)?;
                if shape != ClusterShape::Gateway {
                    let (_, veth) = lane.c.topo.pod_port(p);
                    lane.cilium.announce_pod(
                        k,
                        &lane.c.pod_ns(p),
                        &veth,
                        &name(p),
                        lane.c.pod_ip(p),
                    )?;
                }
            }
        }
        Ok(lane)
    }

    fn cp(&self) -> &ControlPlane {
        &self.c.api.as_ref().expect("the real API").cp
    }

    /// Pod `p` as its kubelet reports it: on its node, its IP, ready,
    /// picked by Service `backs`.
    fn put_pod(&self, p: Pod, backs: &str) -> Result<()> {
        let cp = self.cp();
        let n = name(p);
        cp.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {n}\n  namespace: default\n  labels:\n    {SELECTOR_LABEL}: {backs}\n\
             spec:\n  nodeName: node{}\n  containers:\n  - {{name: vm, image: registry.invalid/vm:1}}\n",
            p.node
        ))?;
        let ip = self.c.pod_ip(p).to_string();
        cp.patch_status(
            "pod",
            &n,
            Some("default"),
            &serde_json::json!({"status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }}),
        )
    }

    /// A Service of cozy-proxy's (`svc`: its label, its mode) as a user
    /// creates it, MetalLB allocating `lb` (`externalTrafficPolicy:
    /// Local`, as Cozystack's).
    fn put_lb_service(&self, svc: &Svc, lb: IpAddr) -> Result<()> {
        let mut service = api_service(svc, "IPv4");
        service["spec"]["externalTrafficPolicy"] = "Local".into();
        service["metadata"]["annotations"]["metallb.io/loadBalancerIPs"] = lb.to_string().into();
        self.cp().apply(&service.to_string())?;
        let api = self.c.api.as_ref().context("the real API")?;
        let got = eventually(SETTLE, || MetalLb::allocated(self.cp(), &svc.name))
            .with_context(|| api.metallb.log_tails())?;
        ensure!(got == lb, "MetalLB allocated {got}, not {lb}");
        Ok(())
    }

    /// A ClusterIP Service no one labels for cozy-proxy: Cilium serves
    /// it. Its ClusterIP.
    fn put_cluster_ip(&self, service: &str) -> Result<IpAddr> {
        self.cp().apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {service}\n  namespace: default\n\
             spec:\n  selector:\n    {SELECTOR_LABEL}: {service}\n  ports:\n  - {{port: {CLUSTER_PORT}, targetPort: {PORT}, protocol: TCP}}\n"
        ))?;
        let ip = self.cp().kubectl(&[
            "get",
            "service",
            service,
            "-n",
            "default",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])?;
        ip.trim().parse().context("a ClusterIP")
    }

    /// Both cozy-proxy nodes translate or steer the LB IPs of `lbs`.
    fn cozy_proxy_holds(&self, lbs: &[(IpAddr, Pod)]) -> Result<()> {
        eventually(Duration::from_secs(20), || {
            for (lb, p) in lbs {
                let state = self.c.dump(p.node)?;
                ensure!(
                    state.svc_pod.get(lb) == Some(&self.c.pod_ip(*p)),
                    "node{}: {lb} not mapped to its pod: {:?}",
                    p.node,
                    state.svc_pod
                );
            }
            Ok(())
        })
        .with_context(|| self.c.logs())
    }

    /// Each agent's service table (`cilium-dbg service list`), as text.
    fn cilium_services(&self) -> Result<Vec<String>> {
        self.cilium
            .agents
            .iter()
            .map(|a| a.dbg(&["service", "list"]))
            .collect()
    }
}

/// Cilium's kube-proxy replacement serves the ClusterIP Service and not
/// cozy-proxy's; cozy-proxy's programs run first on every hook, Cilium's
/// after them; the scenario subset holds beside Cilium; an agent restart
/// loses nothing of a mapped pod's traffic.
#[test]
fn cozy_proxy_beside_a_real_cilium_agent() -> Result<()> {
    let mut lane = Lane::new(ClusterShape::Routed)?;
    let (lb, lbf) = (lane.c.lb(0), lane.c.lb(1));
    lane.put_lb_service(&Svc::new("vm", lb), lb)?;
    lane.put_lb_service(
        &Svc::new("vmf", lbf).filter(&[("TCP", PORT), ("UDP", PORT)]),
        lbf,
    )?;
    let cluster_ip = lane.put_cluster_ip("web")?;
    lane.cozy_proxy_holds(&[(lb, VM), (lbf, VMF)])?;

    // Cilium serves the ClusterIP with its backend (without one, its
    // socket programs refuse a connect with EHOSTUNREACH), and skips the
    // labelled Services.
    if std::env::var("CILIUM_SHOW").is_ok() {
        for t in lane.cilium_services()? {
            println!("{t}");
        }
    }
    let backend = format!("{}:{PORT}", lane.c.pod_ip(WEB));
    eventually(Duration::from_secs(20), || {
        for table in lane.cilium_services()? {
            ensure!(
                table
                    .lines()
                    .any(|row| row.contains(&format!("{cluster_ip}:{CLUSTER_PORT}"))
                        && row.contains(&backend)),
                "Cilium does not serve {cluster_ip} by {backend}: {table}"
            );
            for lb in [lb, lbf] {
                ensure!(
                    !table.contains(&lb.to_string()),
                    "Cilium serves cozy-proxy's {lb}: {table}"
                );
            }
        }
        Ok(())
    })?;

    // Ours first on every hook of both nodes, Cilium's behind them: its
    // device programs on the uplink, its endpoint programs on the pods'
    // veths (attached after it reports itself ready).
    eventually(Duration::from_secs(60), || ours_first_cilium_behind(&lane))?;
    scenario_subset_and_restart(&mut lane, lb, lbf, cluster_ip)
}

fn ours_first_cilium_behind(lane: &Lane) -> Result<()> {
    for k in 1..=2 {
        let dump = lane.c.dump_json(k)?;
        let chains = dump["details"]["chains"].as_array().context("chains")?;
        let mut cilium_seen = 0;
        for chain in chains {
            ensure!(chain["ours_at"] == 0, "node{k}: ours not first: {chain}");
            let names: Vec<&str> = (chain["programs"].as_array().context("programs")?.iter())
                .filter_map(|p| p["name"].as_str())
                .collect();
            let theirs = names.iter().filter(|n| n.starts_with("cil_")).count();
            cilium_seen += theirs;
            let dev = chain["interface"].as_str().unwrap_or_default();
            if dev == "uplink" || dev.starts_with("pod") {
                ensure!(theirs > 0, "node{k} {dev}: no Cilium program in {names:?}");
            }
        }
        ensure!(
            cilium_seen >= 8,
            "node{k}: Cilium's programs in the chains: {cilium_seen}"
        );
    }
    Ok(())
}

/// Outside -> LB IP, the port filter, egress as the LB IP, in-cluster
/// clients and the node's own socket, the ClusterIP Cilium serves; then
/// node1's agent restarted under traffic; then the label's control.
fn scenario_subset_and_restart(
    lane: &mut Lane,
    lb: IpAddr,
    lbf: IpAddr,
    cluster_ip: IpAddr,
) -> Result<()> {
    let (ext, ext_ip) = (lane.c.topo.ext(), lane.c.net.ext());
    let serve = |p: Pod| -> Result<Vec<Server>> {
        let ns = lane.c.pod_ns(p);
        let n = name(p);
        Ok(vec![
            Server::tcp(&ns, Fam::V4, PORT, &n)?,
            Server::udp(&ns, Fam::V4, PORT, &n)?,
            Server::tcp(&ns, Fam::V4, UNLISTED, &n)?,
        ])
    };
    let _servers: Vec<Server> = [VM, VMF, WEB]
        .into_iter()
        .map(serve)
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    // Outside -> LB IP, both protocols, the client seen.
    lane.c.exchange(&ext, lb, PORT, "n1p1", ext_ip)?;
    lane.c.exchange(&ext, lbf, PORT, "n2p1", ext_ip)?;
    // The port filter.
    if let Ok(got) = tcp_request(&ext, lbf, UNLISTED) {
        bail!("the unlisted port of {lbf} answered: {got:?}");
    }
    // The mapped pod's egress leaves as its LB IP.
    {
        let _far = lane.c.serve(&ext, 7000, "ext")?;
        lane.c
            .exchange(&lane.c.pod_ns(VM), ext_ip, 7000, "ext", lb)?;
    }
    // In-cluster clients of the LB IP, on its node and the other: they
    // see it answer, it sees them (client-side translation).
    for client in [pod(1, 2), pod(2, 3)] {
        let ns = lane.c.pod_ns(client);
        lane.c
            .exchange(&ns, lb, PORT, "n1p1", lane.c.pod_ip(client))?;
    }
    // The node's own socket.
    let node2 = lane.c.topo.node(2);
    let got = eventually(SETTLE, || tcp_request(&node2, lb, PORT))?;
    ensure!(got.starts_with("n1p1 "), "node2 -> {lb}: {got:?}");
    // The ClusterIP Service Cilium serves, from a pod's socket in the
    // cgroup Cilium's socket programs act on (as a kubelet places a pod).
    let client = lane.c.pod_ns(pod(1, 3));
    let socat = lane.cilium.agents[0].in_cgroup(&[
        "ip",
        "netns",
        "exec",
        &client,
        "socat",
        "-T2",
        "-",
        &format!("TCP:{cluster_ip}:{CLUSTER_PORT},connect-timeout=2"),
    ]);
    let args: Vec<&str> = socat.iter().map(String::as_str).collect();
    let got = eventually(SETTLE, || {
        let out = feed_in(&lane.c.topo.node(1), &args, b"hello\n", 5)?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        ensure!(
            !text.is_empty(),
            "no answer: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(text)
    })?;
    ensure!(
        got == answer("n2p2", lane.c.pod_ip(pod(1, 3))),
        "{cluster_ip}:{CLUSTER_PORT}: {got:?}"
    );

    // node1's agent restarted (its pinned programs, maps and endpoints
    // kept, as on a node) while the mapped pod's streams run.
    let streams = Streams::between(&lane.c.pod_ns(VM), &ext, ext_ip, lb, 8090)?;
    lane.cilium.agents[0].stop();
    std::thread::sleep(Duration::from_secs(1));
    lane.cilium.agents[0].start()?;
    std::thread::sleep(Duration::from_secs(2));
    let crossing = streams.finish();
    println!("Cilium agent restart: {}", crossing.report());
    crossing.print_losses();
    crossing.check(0)?;
    // Still first everywhere, and still served.
    let dump = lane.c.dump_json(1)?;
    for chain in dump["details"]["chains"].as_array().context("chains")? {
        ensure!(chain["ours_at"] == 0, "after the restart: {chain}");
    }
    lane.c.exchange(&ext, lb, PORT, "n1p1", ext_ip)?;

    // The control: the label taken off, the Service is Cilium's (its
    // LoadBalancer entry appears), cozy-proxy's no more.
    lane.cp().kubectl(&[
        "label",
        "service",
        "vm",
        "-n",
        "default",
        "service.kubernetes.io/service-proxy-name-",
    ])?;
    eventually(Duration::from_secs(20), || {
        for table in lane.cilium_services()? {
            ensure!(
                table.contains(&format!("{lb}:")),
                "Cilium does not take the unlabelled {lb}: {table}"
            );
        }
        Ok(())
    })?;
    Ok(())
}

/// Kube-OVN's shape, Cilium on `ovn0` as Cozystack configures it: the
/// hairpin of an in-cluster client of an LB IP, which cozy-proxy's
/// programs mark on `ovn0` for their masquerade rule, passes Cilium's
/// programs behind them on the same hook; outside clients and the pod's
/// egress too.
#[test]
fn the_hairpin_through_ovn0_beside_a_real_cilium_agent() -> Result<()> {
    let lane = Lane::new(ClusterShape::Gateway)?;
    let lb = lane.c.lb(0);
    lane.put_lb_service(&Svc::new("vm", lb), lb)?;
    lane.cozy_proxy_holds(&[(lb, VM)])?;
    // Cilium attaches to its devices after it reports itself ready.
    eventually(Duration::from_secs(60), || {
        for k in 1..=2 {
            let dump = lane.c.dump_json(k)?;
            let chains = dump["details"]["chains"].as_array().context("chains")?;
            let ovn0: Vec<&serde_json::Value> =
                chains.iter().filter(|c| c["interface"] == "ovn0").collect();
            ensure!(ovn0.len() == 2, "node{k}: ovn0's chains: {ovn0:?}");
            for chain in ovn0 {
                ensure!(chain["ours_at"] == 0, "node{k}: ours not first: {chain}");
                ensure!(
                    chain["programs"].to_string().contains("cil_"),
                    "node{k}: no Cilium program on ovn0: {chain}"
                );
            }
        }
        Ok(())
    })?;
    let (ext, ext_ip) = (lane.c.topo.ext(), lane.c.net.ext());
    let _servers = lane.c.serve(&lane.c.pod_ns(VM), PORT, "n1p1")?;
    let traffic = || -> Result<()> {
        lane.c.exchange(&ext, lb, PORT, "n1p1", ext_ip)?;
        // In-cluster clients on both nodes: masqueraded to their node's
        // join address (the hairpin), answered from the LB IP.
        for client in [pod(1, 2), pod(2, 2)] {
            let ns = lane.c.pod_ns(client);
            let got = eventually(SETTLE, || tcp_request(&ns, lb, PORT))?;
            ensure!(got.starts_with("n1p1 "), "{ns} -> {lb}: {got:?}");
        }
        let _far = lane.c.serve(&ext, 7000, "ext")?;
        lane.c.exchange(&lane.c.pod_ns(VM), ext_ip, 7000, "ext", lb)
    };
    // The cause first, then what the nodes held.
    traffic().map_err(|e| {
        anyhow::anyhow!(
            "{e:#}\n{}\n{}\n--- the Cilium agents ---\n{}\n{}\n{}",
            lane.c.kernel_state(1),
            lane.c.kernel_state(2),
            lane.cilium.agents[0].log_tail(30),
            lane.cilium.agents[1].log_tail(30),
            lane.c.logs()
        )
    })?;
    Ok(())
}
