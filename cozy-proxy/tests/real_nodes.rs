//! cozy-proxy as an operator runs it, on real nodes: two kubelets with
//! containerd, runc and the `ptp` CNI plugin in network namespaces, joined
//! to a real control plane with kube-scheduler, kube-proxy (nftables) on
//! each node and MetalLB announcing the LB IPs in layer 2
//! (`cozy_proxy_testkit::nodes::real_cluster`). The chart is installed
//! with the real `helm install`; its DaemonSet's pods are scheduled,
//! started by containerd under the chart's security settings and probed
//! by the kubelets. A tenant's workload is a Pod behind a labelled
//! Service; the outside router reaches its LB IP, and its egress leaves
//! as the LB IP. Needs root and `cargo xtask setup`.
use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit::{
    control_plane::k8s::{api_service, RELEASE_NAMESPACE, SELECTOR_LABEL},
    control_plane::metallb::MetalLb,
    controller::image::TEST_TAG,
    controller::manifests::Svc,
    nodes::{
        cluster::ClusterNet,
        kubelet::Cni,
        net::Fam,
        real_cluster::{RealCluster, POD_ADDRESSES},
    },
    traffic::{across::Streams, exchange, http_status, tcp_request, Server, SETTLE},
};
use std::net::IpAddr;

/// The port the outside reaches the workload on (any port passes in
/// passthrough; the port filter lists it).
const PORT: u16 = 7000;

/// A labelled Service for workload `name` in `mode`, MetalLB allocating
/// `lb` from its pool (`externalTrafficPolicy: Local`, as Cozystack's).
fn put_service(c: &RealCluster, name: &str, lb: IpAddr, filtered: bool) -> Result<()> {
    put_service_of(c, name, name, lb, filtered)
}

/// The same, Service `name` selecting workload `workload` (a second
/// family's Service of one workload).
fn put_service_of(
    c: &RealCluster,
    name: &str,
    workload: &str,
    lb: IpAddr,
    filtered: bool,
) -> Result<()> {
    let ports = [("TCP", PORT as i32), ("UDP", PORT as i32)];
    let svc = if filtered {
        Svc::new(name, lb).filter(&ports)
    } else {
        Svc::new(name, lb).ports(&ports)
    };
    let fam = if lb.is_ipv4() { Fam::V4 } else { Fam::V6 };
    let mut service = api_service(&svc, ClusterNet { fam }.address_type());
    service["spec"]["externalTrafficPolicy"] = "Local".into();
    service["spec"]["selector"] = serde_json::json!({SELECTOR_LABEL: workload});
    service["metadata"]["annotations"]["metallb.io/loadBalancerIPs"] = lb.to_string().into();
    c.cp.apply(&service.to_string())?;
    let got = c
        .eventually(SETTLE, || MetalLb::allocated(&c.cp, name))
        .with_context(|| c.metallb.log_tails())?;
    ensure!(got == lb, "MetalLB allocated {got}, not {lb}");
    Ok(())
}

/// Through the LB IP both ways: the outside reaches the workload (seen
/// from the outside's address), the workload reaches the outside (seen
/// from its LB IP).
fn check_both_ways(c: &RealCluster, pod_ns: &str, lb: IpAddr, ident: &str) -> Result<()> {
    let fam = if lb.is_ipv4() { Fam::V4 } else { Fam::V6 };
    let net = ClusterNet { fam };
    let (ext, far) = (c.topo.ext(), c.topo.far());
    let _in = (
        Server::tcp(pod_ns, fam, PORT, ident)?,
        Server::udp(pod_ns, fam, PORT, ident)?,
    );
    let _out = (
        Server::tcp(&far, fam, PORT, "far")?,
        Server::udp(&far, fam, PORT, "far")?,
    );
    exchange(&ext, lb, PORT, ident, net.ext()).with_context(|| c.report())?;
    exchange(pod_ns, net.far(), PORT, "far", lb).with_context(|| c.report())?;
    Ok(())
}

/// The chart installed with each backend in turn (`helm upgrade
/// --install`, then `helm upgrade --set backend=`). On each: a tenant's
/// workload on node1 reached through its LB IPs both ways, IPv4 and
/// IPv6 (a Service per family); another on node2 behind a port-filtered
/// Service, its listed port reached and an unlisted one not; `kubectl
/// exec ... dump` showing the mapping, `kubectl logs` the controller's
/// log.
fn chart_serves_workloads(cni: Cni, backends: &[&str]) -> Result<()> {
    let c = RealCluster::start_with(cni, POD_ADDRESSES)?;
    let (v4, v6) = (ClusterNet { fam: Fam::V4 }, ClusterNet { fam: Fam::V6 });
    let vm1 = c.put_workload("vm1", 1)?;
    let vm2 = c.put_workload("vm2", 2)?;
    let pod_ip = c.pod_ip("vm1", Fam::V4)?;
    put_service(&c, "vm1", v4.lb(0), false)?;
    put_service_of(&c, "vm1-v6", "vm1", v6.lb(0), false)?;
    put_service(&c, "vm2", v4.lb(1), true)?;
    for &backend in backends {
        c.install(backend, TEST_TAG)?;
        let on = |what: &str| format!("backend={backend}: {what}");
        check_both_ways(&c, &vm1, v4.lb(0), "vm1").with_context(|| on("vm1 IPv4"))?;
        check_both_ways(&c, &vm1, v6.lb(0), "vm1").with_context(|| on("vm1 IPv6"))?;
        check_both_ways(&c, &vm2, v4.lb(1), "vm2").with_context(|| on("vm2's listed port"))?;
        // The unlisted port, right after the listed one answered.
        let _unlisted = Server::tcp(&vm2, Fam::V4, PORT + 1, "vm2")?;
        let got = tcp_request(&c.topo.ext(), v4.lb(1), PORT + 1);
        ensure!(
            got.is_err(),
            "{}",
            on(&format!("vm2's unlisted port answered: {got:?}"))
        );
        // As docs/operating.md says it: no flag names the backend.
        let dump = c.exec(1, &["/cozy-proxy", "dump"])?;
        let kind = if backend == "nft" { "nft" } else { "ebpf" };
        let lb = v4.lb(0);
        ensure!(
            dump.contains(&format!("backend: {kind} (installed)"))
                && dump.contains(&format!("{lb} -> {pod_ip}")),
            "{}",
            on(&format!(
                "dump on node1 lacks {kind} and {lb} -> {pod_ip}:\n{dump}"
            ))
        );
        let pod = c.cozy_proxy_pod(1)?;
        let logs = c.cp.kubectl(&["logs", "-n", RELEASE_NAMESPACE, &pod])?;
        ensure!(
            logs.contains("datapath synced"),
            "{}",
            on(&format!("kubectl logs {pod}: {logs}"))
        );
    }
    Ok(())
}

/// On routed nodes (`ptp`), every backend value.
#[test]
fn the_chart_serves_workloads_on_routed_nodes() -> Result<()> {
    chart_serves_workloads(Cni::Ptp, &["nft", "ebpf", "auto"])
}

/// On bridged nodes (`bridge`, the node's `cni0` with br_netfilter on),
/// each datapath.
#[test]
fn the_chart_serves_workloads_on_bridged_nodes() -> Result<()> {
    chart_serves_workloads(Cni::Bridge, &["ebpf", "nft"])
}

/// A step of the lifecycle, done to a running cluster.
type Step = dyn Fn(&mut RealCluster) -> Result<()>;

/// The operator's steps, in order, with traffic flowing through vm1's LB
/// IP (datagrams at 100/s each way, a held TCP connection each way,
/// `traffic::across`), the chart installed with `backend` (`other`: the
/// one switched to and back): each costs nothing. Then `helm uninstall`
/// leaves nothing on either node nor in the API.
fn lifecycle(backend: &'static str, other: &'static str) -> Result<()> {
    let mut c = RealCluster::start()?;
    let lb = ClusterNet { fam: Fam::V4 }.lb(0);
    let vm = c.put_workload("vm1", 1)?;
    put_service(&c, "vm1", lb, false)?;
    c.install(backend, TEST_TAG)?;
    c.tag_image(TEST_TAG, "next")?;
    let steps: Vec<(String, Box<Step>)> = vec![
        (
            "helm upgrade to a new image tag".into(),
            Box::new(move |c| c.install(backend, "next")),
        ),
        (
            format!("helm upgrade --set backend={other}"),
            Box::new(move |c| c.install(other, "next")),
        ),
        (
            format!("helm upgrade --set backend={backend}"),
            Box::new(move |c| c.install(backend, "next")),
        ),
        (
            "cozy-proxy pod deleted on node1".into(),
            Box::new(|c| c.delete_cozy_proxy_pod(1)),
        ),
        (
            "kubelet and containerd restarted on node1".into(),
            Box::new(|c| {
                let RealCluster { nodes, cp, .. } = c;
                nodes[0].restart_runtime(cp)
            }),
        ),
        (
            "node2's cozy-proxy pod deleted".into(),
            Box::new(|c| c.delete_cozy_proxy_pod(2)),
        ),
    ];
    let ext_ip = ClusterNet { fam: Fam::V4 }.ext();
    let mut table = vec![format!(
        "| step ({backend}) | lost in | lost out | longest stall in / out |"
    )];
    let mut failures = Vec::new();
    for (name, step) in steps {
        let streams = Streams::between(&vm, &c.topo.ext(), ext_ip, lb, PORT)
            .with_context(|| format!("{name}: the streams before"))?;
        step(&mut c).with_context(|| name.clone())?;
        std::thread::sleep(std::time::Duration::from_secs(2));
        let crossing = streams.finish();
        table.push(format!(
            "| {name} | {} of {} | {} of {} | {:?} / {:?} |",
            crossing.lost_in,
            crossing.sent_in,
            crossing.lost_out,
            crossing.sent_out,
            crossing.held_in.longest_stall,
            crossing.held_out.longest_stall
        ));
        if let Err(e) = crossing.check(0) {
            failures.push(format!("{name}: {e:#}"));
        }
    }
    println!("{}", table.join("\n"));
    ensure!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        table.join("\n")
    );
    // The positive control: what the check reads holds node1's datapath.
    let datapath = if backend == "ebpf" { "pinned:" } else { "nft:" };
    let before = c.leftovers(1)?;
    ensure!(
        before.iter().any(|l| l.starts_with(datapath))
            && before.iter().any(|l| l.starts_with("route:")),
        "node1's datapath is not where the check reads: {before:?}"
    );
    c.uninstall()?;
    for k in 1..=2 {
        let left = c.leftovers(k)?;
        ensure!(
            left.is_empty(),
            "node{k} after helm uninstall:\n{}",
            left.join("\n")
        );
    }
    let objects = c.cp.kubectl(&[
        "get",
        "daemonsets,serviceaccounts,roles,rolebindings,clusterroles,clusterrolebindings",
        "-A",
        "-l",
        "app.kubernetes.io/name=cozy-proxy",
        "-o",
        "name",
    ])?;
    ensure!(
        objects.trim().is_empty(),
        "in the API after helm uninstall:\n{objects}"
    );
    Ok(())
}

#[test]
fn upgrades_switches_and_restarts_lose_nothing_ebpf() -> Result<()> {
    lifecycle("ebpf", "nft")
}

#[test]
fn upgrades_switches_and_restarts_lose_nothing_nft() -> Result<()> {
    lifecycle("nft", "ebpf")
}

/// Does the workload's own httpd answer at `lb:8081` from `ns`?
fn httpd_answers(ns: &str, lb: IpAddr) -> bool {
    http_status(ns, &format!("http://{lb}:8081/")).is_ok_and(|code| code == "404")
}

/// `kubectl drain` of the node that runs a tenant's workload (a
/// Deployment, as a VM's controller recreates its VM elsewhere): the pod
/// is recreated on the other node, MetalLB announces the LB IP from there
/// (`externalTrafficPolicy: Local`) and cozy-proxy maps it to the new pod,
/// whose egress leaves as the LB IP. The outage, seen from outside at the
/// workload's own httpd, is bounded by the pod's own restart (its
/// creation to Ready) plus 10 s.
#[test]
fn a_drained_nodes_workload_keeps_its_lb_ip_on_the_other_node() -> Result<()> {
    use std::time::{Duration, Instant};
    let c = RealCluster::start()?;
    c.install("ebpf", TEST_TAG)?;
    let lb = ClusterNet { fam: Fam::V4 }.lb(1);
    let (pod, node) = c.put_deployment("vm2")?;
    put_service(&c, "vm2", lb, false)?;
    let ns = c.attach(&pod, &node)?;
    check_both_ways(&c, &ns, lb, "vm2")?;
    let ext = c.topo.ext();
    ensure!(httpd_answers(&ext, lb), "the workload's httpd at {lb}:8081");
    // Answers seen from outside every 100 ms, until told to stop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let (stop, ext) = (stop.clone(), ext.clone());
        std::thread::spawn(move || {
            let mut answered = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if httpd_answers(&ext, lb) {
                    answered.push(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            answered
        })
    };
    let drained = Instant::now();
    c.cp.kubectl(&[
        "drain",
        &node,
        "--ignore-daemonsets",
        "--force",
        "--delete-emptydir-data",
        "--timeout=120s",
        "--request-timeout=0",
    ])
    .with_context(|| c.report())?;
    let (moved, to) = c.ready_pod_of("vm2", Some(&node))?;
    let drain_took = drained.elapsed();
    let restart = c.time_to_ready(&moved)?;
    c.eventually(Duration::from_secs(20), || {
        ensure!(httpd_answers(&ext, lb), "not answering at {lb}:8081 yet");
        Ok(())
    })?;
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = poller
        .join()
        .map_err(|_| anyhow::anyhow!("the poller panicked"))?;
    let outage = answered
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    println!(
        "drain of {node} ({drain_took:?}): {pod} -> {moved} on {to}, created to Ready in \
         {restart:?}; longest gap between answers {outage:?}"
    );
    ensure!(to != node, "recreated on the drained node");
    let ns = c.attach(&moved, &to)?;
    check_both_ways(&c, &ns, lb, "vm2")?;
    ensure!(
        outage < restart + Duration::from_secs(10),
        "outage {outage:?}, the pod's restart {restart:?}"
    );
    Ok(())
}

/// The chart's `notReadyHold`.
const NOT_READY_HOLD: std::time::Duration = std::time::Duration::from_secs(15);

/// The EndpointSlices the real EndpointSlice controller writes from the
/// kubelet's probes, and what node1's datapath makes of them
/// (docs/traffic.md, "Which endpoint backs an LB IP"), on eBPF: a pod
/// starting (not ready) never backs its LB IP; Ready, it does; its
/// readiness probe failing, the LB IP stays through the hold of a
/// readiness flap, then goes; deleted while its probe still
/// passes (serving and terminating), it keeps the LB IP and its traffic
/// through the grace period; terminating and no longer serving, the LB IP
/// goes.
#[test]
fn the_kubelets_probes_decide_which_endpoint_backs_the_lb_ip() -> Result<()> {
    use cozy_proxy_testkit::traffic::eventually;
    use std::time::Duration;
    let c = RealCluster::start()?;
    c.install("ebpf", TEST_TAG)?;
    let lb = ClusterNet { fam: Fam::V4 }.lb(0);
    c.put_probed_workload("vm3", 1, 60)?;
    put_service(&c, "vm3", lb, false)?;
    // The sandbox and its address come first (a loaded node: seconds).
    let ip = c.eventually(Duration::from_secs(60), || c.pod_ip("vm3", Fam::V4))?;
    let conditions = |want: &str| {
        let want = format!("{ip} {want}");
        c.eventually(Duration::from_secs(30), || {
            let got = c.slice_conditions("vm3")?;
            ensure!(got.trim() == want, "slice: {got:?}, want {want:?}");
            Ok(())
        })
    };
    let mapped = |want: Option<IpAddr>| {
        c.eventually(SETTLE, || {
            let got = c.mapped(1, lb)?;
            ensure!(got == want, "node1 maps {lb} to {got:?}, want {want:?}");
            Ok(())
        })
    };
    // Starting: never backs the LB IP (sampled over 3 s once the slice
    // says so).
    conditions("false/false/false")?;
    for _ in 0..3 {
        ensure!(c.mapped(1, lb)?.is_none(), "a starting pod backs {lb}");
        std::thread::sleep(Duration::from_secs(1));
    }
    c.set_ready("vm3", true)?;
    conditions("true/true/false")?;
    mapped(Some(ip))?;
    let ns = c.attach("vm3", "node1")?;
    check_both_ways(&c, &ns, lb, "vm3").context("Ready")?;
    // Its probe failing: held (the chart's `notReadyHold`, 15 s), then
    // gone.
    c.set_ready("vm3", false)?;
    conditions("false/false/false")?;
    let failing = std::time::Instant::now();
    for _ in 0..3 {
        ensure!(c.mapped(1, lb)? == Some(ip), "not held: readiness failing");
        std::thread::sleep(Duration::from_secs(1));
    }
    c.eventually(NOT_READY_HOLD + SETTLE, || {
        ensure!(c.mapped(1, lb)?.is_none(), "still mapped");
        Ok(())
    })
    .context("readiness failing, after the hold")?;
    ensure!(
        failing.elapsed() >= NOT_READY_HOLD - Duration::from_secs(3),
        "unmapped {:?} after the slice said not ready, before the hold's end",
        failing.elapsed()
    );
    c.set_ready("vm3", true)?;
    conditions("true/true/false")?;
    mapped(Some(ip))?;
    c.cp.kubectl(&["delete", "pod", "vm3", "-n", "default", "--wait=false"])?;
    conditions("false/true/true")?;
    mapped(Some(ip)).context("serving while terminating")?;
    eventually(SETTLE, || check_both_ways(&c, &ns, lb, "vm3")).context("terminating")?;
    c.set_ready("vm3", false)?;
    conditions("false/false/true")?;
    mapped(None).context("terminating, no longer serving")
}

/// A pod IP reused after deletion (node2's CNI range holds one address):
/// tenant A's pod is deleted, tenant B's pod on the same node gets its
/// address. A's LB IP is not mapped to B's pod (it goes dark with A's
/// endpoints), B's LB IP is, and B's egress leaves as B's LB IP.
#[test]
fn a_pod_ip_reused_after_deletion_serves_only_its_own_lb_ip() -> Result<()> {
    let c = RealCluster::start_with(Cni::Ptp, 1)?;
    c.install("ebpf", TEST_TAG)?;
    let net = ClusterNet { fam: Fam::V4 };
    let (lb_a, lb_b) = (net.lb(0), net.lb(1));
    let vma = c.put_workload("vma", 2)?;
    let reused = c.pod_ip("vma", Fam::V4)?;
    put_service(&c, "vma", lb_a, false)?;
    check_both_ways(&c, &vma, lb_a, "vma")?;
    c.delete_pod("vma")?;
    let unmapped = |lb: IpAddr| {
        c.eventually(SETTLE, || {
            let got = c.mapped(2, lb)?;
            ensure!(got.is_none(), "node2 maps {lb} to {got:?}");
            Ok(())
        })
    };
    unmapped(lb_a).context("A's pod deleted")?;
    let vmb = c.put_workload("vmb", 2)?;
    let ip_b = c.pod_ip("vmb", Fam::V4)?;
    ensure!(ip_b == reused, "B's pod got {ip_b}, not A's old {reused}");
    put_service(&c, "vmb", lb_b, false)?;
    check_both_ways(&c, &vmb, lb_b, "vmb").context("B's LB IP")?;
    unmapped(lb_a).context("A's LB IP, B's pod on A's old address")?;
    // The outside gets nothing from B's pod at A's LB IP.
    let _b = Server::tcp(&vmb, Fam::V4, PORT, "vmb")?;
    let ext = c.topo.ext();
    c.eventually(SETTLE, || tcp_request(&ext, lb_b, PORT))
        .context("the positive control: B's server at B's LB IP")?;
    let got = tcp_request(&ext, lb_a, PORT);
    ensure!(got.is_err(), "A's LB IP answered from B's pod: {got:?}");
    Ok(())
}
