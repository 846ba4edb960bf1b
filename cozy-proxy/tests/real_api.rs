//! The controller against a real Kubernetes control plane: etcd,
//! kube-apiserver (RBAC on) and kube-controller-manager, built from their
//! Go modules by `cargo xtask setup` and started per test in the node's
//! namespace (`cozy_proxy_testkit::k8s`). cozy-proxy runs with the token
//! of the chart's ServiceAccount, bound to exactly the chart's roles as
//! the real `helm template` renders them. Services are applied with
//! `kubectl`, their LoadBalancer status patched as a load-balancer
//! controller does; each endpoint is a Pod whose status is patched as a
//! kubelet would, so the EndpointSlices cozy-proxy reads are made by the
//! real EndpointSlice controller. Traffic is real, in the namespaces.
//!
//! The in-process stand-in (kube_source.rs) stays for what a real server
//! cannot be made to do on demand: cutting every open watch without a
//! restart, and serving a 410 on a list.
// Only the scenarios the API accepts as written are run here.
#[allow(dead_code)]
mod cases;
use cozy_proxy_testkit as harness;

use anyhow::{bail, ensure, Context, Result};
use harness::{
    controller::manifests::{Slice, Svc},
    nodes::net::Fam,
    scenario::WEB,
    traffic::{eventually, SETTLE},
    Backend, Env, SourceKind,
};
use std::time::Duration;

fn env(backend: Backend, fam: Fam) -> Result<Env> {
    Env::with_source(backend, SourceKind::RealApi, fam)
}

fn api(env: &Env) -> Result<&harness::control_plane::k8s::ControlPlane> {
    env.api.as_ref().context("a real control plane")
}

/// After an outage the watches come back on their backoff (kube-rs's
/// default, like client-go's: 0.8 s doubling to 30 s): the controller
/// converges within that bound.
const WATCH_BACKOFF_BOUND: Duration = Duration::from_secs(40);

fn settle_after_outage(env: &mut Env) -> Result<cozy_proxy::datapath::DatapathState> {
    eventually(WATCH_BACKOFF_BOUND, || env.settle())
}

fn run(backend: Backend, fam: Fam, scenario: fn(&mut Env) -> Result<()>) {
    let mut env = env(backend, fam).expect("topology and control plane");
    if let Err(e) = scenario(&mut env) {
        panic!("{e:#}\n--- controller log ---\n{}", env.ctl.log_text());
    }
}

/// The scenarios whose input the API accepts as the manifests write it
/// (not 19, whose creation times the API sets itself: conflicts are below;
/// not 20, whose invalid LB IPs the API refuses), for one runner's
/// arguments; `@few`: two of them.
macro_rules! accepted_by_the_api {
    (@few $($args:expr),*) => {
        use super::{harness, run, Backend, Fam};
        use crate::cases::{changes, filter};
        harness::datapath_suite!(@tests run($($args),*);
            filter::s07_listed_ports_pass, changes::s13_endpoint_moves);
    };
    ($($args:expr),*) => {
        use super::{harness, run, Backend, Fam};
        use crate::cases::{bad_input, changes, filter, passthrough};
        harness::datapath_suite!(@tests run($($args),*);
            passthrough::s02_any_port, passthrough::s04_egress_source,
            filter::s07_listed_ports_pass, filter::s08_unlisted_ports_dropped,
            changes::s12_mode_change, changes::s13_endpoint_moves,
            changes::s14_removal_restores_plain, changes::s15_no_ready_endpoint,
            bad_input::s17_invalid_annotation, bad_input::s18_several_endpoints);
    };
}

mod nft_v4 {
    accepted_by_the_api!(Backend::Nft, Fam::V4);
}

mod ebpf_v4 {
    accepted_by_the_api!(Backend::Ebpf, Fam::V4);
}

mod nft_v6 {
    accepted_by_the_api!(@few Backend::Nft, Fam::V6);
}

mod ebpf_v6 {
    accepted_by_the_api!(@few Backend::Ebpf, Fam::V6);
}

/// Two Services claim one LB IP, then one pod: the one the API server
/// created first keeps it, the other gets a Warning Event (read back with
/// kubectl); deleting the first hands it over.
#[test]
fn conflicts_follow_the_real_creation_order() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    let _p1 = env.serve_tcp(1, WEB)?;
    let _p2 = env.serve_tcp(2, WEB)?;
    let _p3 = env.serve_tcp(3, WEB)?;
    env.put_service(&Svc::new("a", env.lb(0)), &[env.pod_ip(1)])?;
    env.put_service(&Svc::new("c", env.lb(1)), &[env.pod_ip(2)])?;
    // creationTimestamp has a resolution of one second.
    std::thread::sleep(Duration::from_millis(1100));
    env.put_service(&Svc::new("b", env.lb(0)), &[env.pod_ip(3)])?;
    env.put_service(&Svc::new("d", env.lb(3)), &[env.pod_ip(2)])?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.tcp_reaches(env.lb(1), WEB, 2)?;
    env.ping_unanswered(env.lb(3))?;
    for (service, reason) in [("b", "LoadBalancerIPConflict"), ("d", "PodIPConflict")] {
        eventually(SETTLE, || {
            let events = api(&env)?.events_of(service)?;
            ensure!(
                events.iter().any(|e| e.starts_with(reason)),
                "no {reason} Event on {service}: {events:?}"
            );
            Ok(())
        })?;
    }
    env.delete_service("a")?;
    env.delete_service("c")?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 3)?;
    env.tcp_reaches(env.lb(3), WEB, 2)
}

/// A Service that is not ours gets the wholeIP annotation (no label: its
/// EndpointSlices do not change): its slices, not kept while it was not
/// ours, are listed again, and it is mapped.
#[test]
fn a_service_annotated_later_is_mapped_with_its_endpoints() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    let _p1 = env.serve_tcp(1, WEB)?;
    let _p2 = env.serve_tcp(2, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let mut vm2 = Svc::new("vm2", env.lb(1));
    vm2.label = false;
    env.put_service(&vm2, &[env.pod_ip(2)])?;
    let state = env.settle()?;
    ensure!(
        !state.svc_pod.contains_key(&env.lb(1)),
        "vm2 is not ours yet"
    );
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    vm2.whole_ip = Some("true".into());
    put_vm2(&mut env, &vm2, true)?;
    env.tcp_reaches(env.lb(1), WEB, 2)?;
    env.wait_log("a Service became ours: its EndpointSlices read")
}

/// Writes `vm2` (LB IP 1, pod 2) and waits until the node holds it mapped
/// or not, as `mapped` says.
fn put_vm2(env: &mut Env, vm2: &Svc, mapped: bool) -> Result<()> {
    env.put_service(vm2, &[env.pod_ip(2)])?;
    let state = env.settle()?;
    ensure!(
        (state.svc_pod.get(&env.lb(1)) == Some(&env.pod_ip(2))) == mapped,
        "vm2 mapped: {:?}, expected {mapped}",
        state.svc_pod
    );
    Ok(())
}

/// The API server's count of LIST requests for EndpointSlices of `scope`
/// (`cluster`: every namespace; `namespace`: one), from its metrics.
fn slice_lists(env: &Env, scope: &str) -> Result<u64> {
    let metrics = api(env)?.kubectl(&["get", "--raw", "/metrics"])?;
    let mut total = 0;
    for line in metrics.lines().filter(|l| {
        l.starts_with("apiserver_request_total{")
            && l.contains("resource=\"endpointslices\"")
            && l.contains(&format!("scope=\"{scope}\""))
            && l.contains("verb=\"LIST\"")
    }) {
        let n = line.rsplit(' ').next().context("a sample")?;
        total += n.parse::<f64>().with_context(|| line.to_string())? as u64;
    }
    Ok(total)
}

/// A tenant toggling the label of its own Service: each time it becomes
/// ours, its slices are read in its namespace; no node lists every
/// EndpointSlice of the cluster again.
#[test]
fn a_label_toggled_in_a_loop_reads_only_that_services_slices() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let mut vm2 = Svc::new("vm2", env.lb(1));
    vm2.label = false;
    env.put_service(&vm2, &[env.pod_ip(2)])?;
    env.settle()?;
    let (cluster, namespace) = (
        slice_lists(&env, "cluster")?,
        slice_lists(&env, "namespace")?,
    );
    const TOGGLES: u64 = 4;
    for _ in 0..TOGGLES {
        vm2.label = true;
        put_vm2(&mut env, &vm2, true)?;
        vm2.label = false;
        put_vm2(&mut env, &vm2, false)?;
    }
    let cluster = slice_lists(&env, "cluster")? - cluster;
    let namespace = slice_lists(&env, "namespace")? - namespace;
    println!("EndpointSlice lists while toggling {TOGGLES} times: {cluster} of every namespace, {namespace} of one");
    ensure!(cluster == 0, "{cluster} lists of every EndpointSlice");
    ensure!(namespace >= TOGGLES, "{namespace} lists in vm2's namespace");
    Ok(())
}

/// The Warning Event of a bad annotation, as `kubectl get events` shows it.
#[test]
fn warnings_are_events_kubectl_shows() -> Result<()> {
    let mut env = env(Backend::Ebpf, Fam::V4)?;
    let mut svc = Svc::new("vm1", env.lb(0));
    svc.whole_ip = Some("yes".into());
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    let api = api(&env)?;
    eventually(SETTLE, || {
        let out = api.kubectl(&[
            "get",
            "events",
            "-n",
            "default",
            "-o",
            "jsonpath={range .items[*]}{.type} {.reason} {.involvedObject.kind}/{.involvedObject.name} {.reportingComponent} {.message}{\"\\n\"}{end}",
        ])?;
        let line = out
            .lines()
            .find(|l| l.contains("InvalidAnnotation"))
            .with_context(|| format!("no InvalidAnnotation Event: {out}"))?;
        ensure!(
            line.starts_with("Warning InvalidAnnotation Service/vm1 cozy-proxy")
                && line.contains("wholeIP=\"yes\""),
            "{line}"
        );
        Ok(())
    })
}

/// RBAC is real: without the chart's rule on EndpointSlices the controller
/// cannot list them and never becomes ready; with the rule back it does.
#[test]
fn a_missing_rbac_rule_is_refused_by_the_server() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    let api = api(&env)?;
    api.edit_cluster_role("cozy-proxy", |rules| {
        let before = rules.len();
        rules.retain(|r| r["resources"][0] != "endpointslices");
        ensure!(
            rules.len() + 1 == before,
            "no endpointslices rule: {rules:?}"
        );
        Ok(())
    })?;
    env.ctl.restart()?;
    let api = env.api.as_ref().context("api")?;
    eventually(Duration::from_secs(10), || {
        let log = env.ctl.log_text();
        ensure!(log.contains("forbidden"), "no 403 in the log yet");
        Ok(())
    })?;
    ensure!(
        env.controller_http("/readyz")?.0 == 503,
        "ready without EndpointSlices"
    );
    // The chart's rules again (helm upgrade): the controller recovers.
    api.install_chart(env.backend.arg())?;
    eventually(Duration::from_secs(30), || {
        match env.controller_http("/readyz")? {
            (200, _) => Ok(()),
            (code, body) => bail!("readyz {code}: {body}"),
        }
    })?;
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), WEB, 1)
}

/// kube-apiserver killed: the datapath stays as it is and keeps carrying
/// traffic; a controller restarted meanwhile is not ready and touches
/// nothing; the server back, changes flow again.
#[test]
fn an_api_server_outage_keeps_the_datapath_and_it_recovers() -> Result<()> {
    let mut env = env(Backend::Ebpf, Fam::V4)?;
    let _web = env.serve_tcp(1, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let before = env.settle()?;
    env.api.as_mut().context("api")?.stop_apiserver();
    std::thread::sleep(Duration::from_secs(3));
    ensure!(env.dump()? == before, "the datapath changed in the outage");
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.ctl.restart()?;
    std::thread::sleep(Duration::from_secs(1));
    ensure!(
        env.controller_http("/readyz")?.0 == 503,
        "ready without the API"
    );
    ensure!(
        env.dump()? == before,
        "a controller without the API touched it"
    );
    env.api.as_mut().context("api")?.start_apiserver()?;
    eventually(Duration::from_secs(30), || {
        match env.controller_http("/readyz")? {
            (200, _) => Ok(()),
            (code, body) => bail!("readyz {code}: {body}"),
        }
    })?;
    let _web3 = env.serve_tcp(3, WEB)?;
    env.put_service(&Svc::new("vm3", env.lb(2)), &[env.pod_ip(3)])?;
    let pod3 = env.pod_ip(3).to_string();
    api(&env)?.wait_ready_endpoint("vm3", &pod3, Duration::from_secs(60))?;
    settle_after_outage(&mut env)?;
    env.tcp_reaches(env.lb(2), WEB, 3)
}

/// etcd compacted while the server is down: the watches resume from a
/// resourceVersion the restarted server no longer has, get a real 410
/// Gone, relist, and the controller holds the current state.
#[test]
fn a_compacted_history_gives_410_and_a_relist() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    let cp = env.api.as_mut().context("api")?;
    cp.stop_apiserver();
    cp.compact_etcd(20)?;
    cp.start_apiserver()?;
    eventually(Duration::from_secs(30), || {
        let log = env.ctl.log_text();
        ensure!(
            log.contains("too old resource version") || log.contains("Expired"),
            "no 410 Gone in the log yet"
        );
        Ok(())
    })?;
    let _web = env.serve_tcp(2, WEB)?;
    env.put_service(&Svc::new("vm2", env.lb(1)), &[env.pod_ip(2)])?;
    let pod2 = env.pod_ip(2).to_string();
    api(&env)?.wait_ready_endpoint("vm2", &pod2, Duration::from_secs(60))?;
    env.delete_service("vm1")?;
    let state = settle_after_outage(&mut env)?;
    ensure!(state.svc_pod.len() == 1, "{state:?}");
    env.tcp_reaches(env.lb(1), WEB, 2)
}

/// The chart's DaemonSet decides: present at a stop (a rolling update),
/// the datapath stays; deleted (helm uninstall), it goes.
#[test]
fn the_datapath_goes_only_with_the_charts_daemonset() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let before = env.settle()?;
    env.ctl.stop()?;
    ensure!(env.dump()? == before, "a restart removed the datapath");
    env.wait_log("our DaemonSet remains")?;
    env.ctl.restart()?;
    env.settle()?;
    api(&env)?.kubectl(&[
        "delete",
        "daemonset",
        "cozy-proxy",
        "-n",
        harness::control_plane::k8s::RELEASE_NAMESPACE,
    ])?;
    env.ctl.stop()?;
    env.wait_log("uninstall; removing the datapath")?;
    let ruleset = harness::sh::ok_in(&env.topo.node(), &["nft", "list", "ruleset"])?;
    ensure!(!ruleset.contains("cozy_proxy"), "left: {ruleset}");
    Ok(())
}

/// The node's backend label, set with kubectl, is read through the API
/// (the chart's `nodes get` rule): the restarted controller switches.
#[test]
fn the_node_label_overrides_the_backend() -> Result<()> {
    let env = ebpf_node_switched_to_nft_by_its_label()?;
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), WEB, 1)
}

/// A node running eBPF with vm1, labelled for nft with kubectl and its
/// controller restarted: nft holds vm1 and the eBPF state is gone.
fn ebpf_node_switched_to_nft_by_its_label() -> Result<Env> {
    let mut env = env(Backend::Ebpf, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    api(&env)?.kubectl(&[
        "label",
        "node",
        "node1",
        "networking.cozystack.io/cozy-proxy-backend=nft",
    ])?;
    env.ctl.restart()?;
    env.wait_log("backend chosen by the node label")?;
    let node = env.topo.node();
    eventually(SETTLE, || {
        let table = harness::sh::ok_in(&node, &["nft", "list", "table", "ip", "cozy_proxy"])?;
        ensure!(table.contains("203.0.113.10"), "{table}");
        ensure!(!env.ctl.pin_dir.exists(), "eBPF pins left");
        Ok(())
    })?;
    Ok(env)
}

/// The real kube-proxy (nftables mode) beside cozy-proxy on one node: it
/// skips the Service labelled for cozy-proxy (no rule for its LB IP or
/// cluster IP) and serves an unlabelled LoadBalancer Service; both LB IPs
/// carry traffic from the outside, each by its own proxy.
fn kube_proxy_skips_our_services(backend: Backend) -> Result<()> {
    let mut env = env(backend, Fam::V4)?;
    let node_ip = env.net.node;
    let cp = env.api.as_mut().context("api")?;
    cp.set_node_address("node1", node_ip)?;
    cp.start_kube_proxy("node1")?;
    env.dir.put(
        "node1",
        &harness::control_plane::k8s::node_yaml("node1", Some(node_ip)),
    )?;
    let _p1 = env.serve_tcp(1, WEB)?;
    let _p2 = env.serve_tcp(2, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    let mut theirs = Svc::new("web", env.lb(1));
    theirs.label = false;
    theirs.ports = vec![("TCP".into(), WEB.into())];
    env.put_service(&theirs, &[env.pod_ip(2)])?;
    env.settle()?;
    let api = api(&env)?;
    let ip_of = |name: &str| {
        api.kubectl(&[
            "get",
            "service",
            name,
            "-n",
            "default",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])
    };
    let (ours, web) = (ip_of("vm1")?, ip_of("web")?);
    let node = env.topo.node();
    eventually(Duration::from_secs(30), || {
        let table = harness::sh::ok_in(&node, &["nft", "list", "table", "ip", "kube-proxy"])?;
        ensure!(
            table.contains(&web) && table.contains(&env.lb(1).to_string()),
            "kube-proxy has not programmed web ({web}, {}) yet",
            env.lb(1)
        );
        ensure!(
            !table.contains(&ours) && !table.contains(&env.lb(0).to_string()),
            "kube-proxy programmed the Service labelled for cozy-proxy:\n{table}"
        );
        Ok(())
    })?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    let got = eventually(SETTLE, || {
        harness::traffic::tcp_request(&env.topo.ext(), env.lb(1), WEB)
    })?;
    ensure!(got.starts_with("pod2 "), "web's LB IP answered {got:?}");
    let web_ip = web.parse().context("web's cluster IP")?;
    let got = eventually(SETTLE, || harness::traffic::tcp_request(&node, web_ip, WEB))?;
    ensure!(
        got.starts_with("pod2 "),
        "web's cluster IP answered {got:?}"
    );
    Ok(())
}

#[test]
fn kube_proxy_skips_our_services_nft() -> Result<()> {
    kube_proxy_skips_our_services(Backend::Nft)
}

#[test]
fn kube_proxy_skips_our_services_ebpf() -> Result<()> {
    kube_proxy_skips_our_services(Backend::Ebpf)
}

/// Each Service's Events come from one node (no storm of nodes x
/// warnings), chosen by hashing over the cluster's nodes. With nodes node1
/// and node2, this controller (node1) publishes the warning of a Service
/// node1 owns and not that of one node2 owns.
#[test]
fn only_the_owning_node_publishes_a_services_events() -> Result<()> {
    let env = env(Backend::Nft, Fam::V4)?;
    let cp = api(&env)?;
    cp.create_node("node2")?;
    let nodes = ["node1".to_string(), "node2".to_string()].into();
    let owned_by = |node: &str| {
        (0..100)
            .map(|i| format!("vm{i}"))
            .find(|n| cozy_proxy::events::owner("default", n, &nodes).as_deref() == Some(node))
    };
    let (here_name, there_name) = (
        owned_by("node1").context("a name")?,
        owned_by("node2").context("a name")?,
    );
    let mut here = Svc::new(&here_name, env.lb(0));
    here.whole_ip = Some("yes".into());
    let mut there = Svc::new(&there_name, env.lb(1));
    there.whole_ip = Some("yes".into());
    let pod2 = env.pod_ip(2).to_string();
    cp.put_service(&there, "IPv4", &[(pod2, None)], "node2")?;
    env.put_service(&here, &[env.pod_ip(1)])?;
    eventually(SETTLE, || {
        let events = cp.events_of(&here_name)?;
        ensure!(
            events.iter().any(|e| e.starts_with("InvalidAnnotation")),
            "no Event on {here_name}: {events:?}"
        );
        Ok(())
    })?;
    // Both warnings were computed in the same rounds; give the other
    // every chance to appear.
    env.wait_log(&format!(
        "service=default/{there_name} reason=InvalidAnnotation"
    ))?;
    std::thread::sleep(Duration::from_secs(2));
    let events = cp.events_of(&there_name)?;
    ensure!(
        events.is_empty(),
        "node1 published {there_name}'s Events: {events:?}"
    );
    Ok(())
}

/// The node label could not be read (here: the ClusterRole lost `get` on
/// nodes): the controller keeps running the backend installed on the node
/// (the one the label chose last time), not --backend beside it, and
/// removes nothing.
#[test]
fn an_unreadable_node_label_removes_nothing() -> Result<()> {
    let mut env = ebpf_node_switched_to_nft_by_its_label()?;
    let node = env.topo.node();
    // Take `get` on nodes away (list and watch stay: the controller still
    // syncs), and restart.
    let cp = api(&env)?;
    cp.edit_cluster_role("cozy-proxy", |rules| {
        for rule in rules.iter_mut() {
            if rule["resources"][0] == "nodes" {
                rule["verbs"] = serde_json::json!(["list", "watch"]);
            }
        }
        Ok(())
    })?;
    env.ctl.restart()?;
    eventually(Duration::from_secs(20), || {
        ensure!(
            env.ctl
                .log_text()
                .contains("the other backend's state is kept"),
            "not yet"
        );
        Ok(())
    })?;
    env.wait_log("keeping the backend installed on this node")?;
    // nft runs, as the label chose last time: its table is there, and no
    // eBPF state came beside it.
    harness::sh::ok_in(&node, &["nft", "list", "table", "ip", "cozy_proxy"])
        .context("the nft state was removed")?;
    ensure!(
        !cozy_proxy::ebpf::layouts::pin_path(&env.ctl.pin_dir, "addrs").exists(),
        "eBPF started beside nft"
    );
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), WEB, 1)
}

/// A CRD as far as cozy-proxy reads it (its objects' specs kept as they
/// are written).
fn crd(group: &str, version: &str, kind: &str, plural: &str) -> String {
    format!(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n\
         metadata: {{name: {plural}.{group}}}\nspec:\n  group: {group}\n  scope: Cluster\n  \
         names: {{plural: {plural}, singular: {singular}, kind: {kind}, listKind: {kind}List}}\n  \
         versions:\n  - name: {version}\n    served: true\n    storage: true\n    \
         schema: {{openAPIV3Schema: {{type: object, x-kubernetes-preserve-unknown-fields: true}}}}\n",
        singular = kind.to_lowercase()
    )
}

/// The CRDs of Kube-OVN, Calico and Cilium.
const POOL_CRDS: [(&str, &str, &str, &str); 3] = [
    ("kubeovn.io", "v1", "Subnet", "subnets"),
    ("crd.projectcalico.org", "v1", "IPPool", "ippools"),
    (
        "cilium.io",
        "v2alpha1",
        "CiliumPodIPPool",
        "ciliumpodippools",
    ),
];

/// One pool of each: the pods' network as a Kube-OVN Subnet (dual-stack,
/// as Kube-OVN writes it), a Calico IPPool and a Cilium CiliumPodIPPool.
const POOLS: &str = "\
apiVersion: kubeovn.io/v1
kind: Subnet
metadata: {name: ovn-default}
spec: {cidrBlock: \"192.0.2.0/24,2001:db8:2::/64\", gateway: 192.0.2.1}
---
apiVersion: crd.projectcalico.org/v1
kind: IPPool
metadata: {name: default-ipv4-ippool}
spec: {cidr: 192.0.2.0/25}
---
apiVersion: cilium.io/v2alpha1
kind: CiliumPodIPPool
metadata: {name: pool}
spec: {ipv4: {cidrs: [192.0.2.128/26], maskSize: 28}, ipv6: {cidrs: [\"2001:db8:2:1::/64\"], maskSize: 96}}
";

/// Kube-OVN, Calico IPAM and Cilium's multi-pool IPAM leave the Nodes'
/// spec.podCIDRs empty: without `--cluster-cidrs` a pod reaching a mapped
/// pod by its pod IP is answered from the mapped pod's LB IP, and times
/// out. With the CNIs' own pool objects readable (their CRDs installed
/// before the start), their networks are in-cluster: logged with where
/// they come from, shown by `dump`, and the pod reaches the mapped pod.
#[test]
fn pod_networks_come_from_the_cnis_pool_objects() -> Result<()> {
    let mut env = env(Backend::Ebpf, Fam::V4)?;
    let _web = env.serve_tcp(1, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    let (pod2, pod1) = (env.pod_ns(2), env.pod_ip(1));
    ensure!(
        harness::traffic::tcp_request(&pod2, pod1, WEB).is_err(),
        "pod2 reached the mapped pod by its IP without any in-cluster range"
    );
    let cp = api(&env)?;
    for (group, version, kind, plural) in POOL_CRDS {
        cp.apply(&crd(group, version, kind, plural))?;
        cp.kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=20s",
            &format!("crd/{plural}.{group}"),
        ])?;
    }
    cp.apply(POOLS)?;
    env.ctl.restart()?;
    for needle in [
        "192.0.2.0/24 (Kube-OVN Subnet ovn-default)",
        "2001:db8:2::/64 (Kube-OVN Subnet ovn-default)",
        "192.0.2.0/25 (Calico IPPool default-ipv4-ippool)",
        "192.0.2.128/26 (Cilium CiliumPodIPPool pool)",
        "2001:db8:2:1::/64 (Cilium CiliumPodIPPool pool)",
    ] {
        env.wait_log(needle)?;
    }
    let state = env.dump()?;
    let ranges = format!("{:?}", state.cluster);
    ensure!(
        ranges.contains("192.0.2.0") && ranges.contains("192.0.2.255"),
        "dump's in-cluster ranges lack the Subnet: {ranges}"
    );
    let got = eventually(SETTLE, || harness::traffic::tcp_request(&pod2, pod1, WEB))?;
    ensure!(
        got == harness::traffic::answer("pod1", env.pod_ip(2)),
        "pod2 -> pod1 by pod IP: {got:?}"
    );
    Ok(())
}

/// `helm uninstall` deletes the DaemonSet and then the chart's RBAC
/// objects before the pods stop: a stopping controller can no longer read
/// its DaemonSet (403). The watch it kept saw the deletion: the datapath
/// goes all the same. (The objects are deleted with kubectl in helm's
/// uninstall order: the DaemonSet, then the bindings and roles.)
#[test]
fn an_uninstall_that_takes_the_rules_first_still_removes_the_datapath() -> Result<()> {
    let mut env = env(Backend::Nft, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    let api = api(&env)?;
    let ns = harness::control_plane::k8s::RELEASE_NAMESPACE;
    api.kubectl(&["delete", "daemonset", "cozy-proxy", "-n", ns])?;
    for (kind, namespaced) in [
        ("rolebinding", true),
        ("role", true),
        ("clusterrolebinding", false),
        ("clusterrole", false),
    ] {
        let mut args = vec!["delete", kind, "cozy-proxy"];
        if namespaced {
            args.extend(["-n", ns]);
        }
        api.kubectl(&args)?;
    }
    env.ctl.stop()?;
    env.wait_log("uninstall; removing the datapath")?;
    let ruleset = harness::sh::ok_in(&env.topo.node(), &["nft", "list", "ruleset"])?;
    ensure!(!ruleset.contains("cozy_proxy"), "left: {ruleset}");
    Ok(())
}

/// The real `helm uninstall` (the DaemonSet, its RBAC objects and its
/// ServiceAccount deleted in one pass), then the node's pod stopping, as
/// the kubelet stops it: nothing of the chart is left in the API, and
/// nothing of ours on the node (no nft table, pin, tcx link or route).
fn helm_uninstall_leaves_nothing(backend: Backend) -> Result<()> {
    use aya::programs::TcAttachType;
    let mut env = env(backend, Fam::V4)?;
    let svc = Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22)]);
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    api(&env)?.helm(&["uninstall", harness::control_plane::k8s::RELEASE])?;
    env.ctl.stop()?;
    env.wait_log("uninstall; removing the datapath")?;
    let api = api(&env)?;
    let ns = harness::control_plane::k8s::RELEASE_NAMESPACE;
    let left = api.kubectl(&[
        "get",
        "daemonset,serviceaccount,role,rolebinding",
        "-n",
        ns,
        "-l",
        "app.kubernetes.io/instance=cozy-proxy",
        "-o",
        "name",
    ])?;
    ensure!(left.trim().is_empty(), "left in the API: {left}");
    for kind in ["clusterrole", "clusterrolebinding"] {
        let left = api.kubectl(&[
            "get",
            kind,
            "cozy-proxy",
            "--ignore-not-found",
            "-o",
            "name",
        ])?;
        ensure!(left.trim().is_empty(), "left in the API: {left}");
    }
    let releases = api.helm(&["list", "-q"])?;
    ensure!(releases.trim().is_empty(), "releases: {releases}");
    let node = env.topo.node();
    let ruleset = harness::sh::ok_in(&node, &["nft", "list", "ruleset"])?;
    ensure!(!ruleset.contains("cozy_proxy"), "left: {ruleset}");
    for family in ["-4", "-6"] {
        let routes = harness::sh::ok_in(&node, &["ip", family, "route", "show", "proto", "249"])?;
        ensure!(routes.trim().is_empty(), "routes left: {routes}");
    }
    let pins: Vec<_> = match std::fs::read_dir(&env.ctl.pin_dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    ensure!(pins.is_empty(), "pins left: {pins:?}");
    for dev in ["uplink", "pod1", "pod2", "pod3"] {
        for hook in [TcAttachType::Ingress, TcAttachType::Egress] {
            let chain = harness::agents::tc_program::OtherAgent::tcx_chain(&node, dev, hook)?;
            ensure!(chain.is_empty(), "programs on {dev} {hook:?}: {chain:?}");
        }
    }
    Ok(())
}

#[test]
fn helm_uninstall_leaves_nothing_nft() -> Result<()> {
    helm_uninstall_leaves_nothing(Backend::Nft)
}

#[test]
fn helm_uninstall_leaves_nothing_ebpf() -> Result<()> {
    helm_uninstall_leaves_nothing(Backend::Ebpf)
}

/// Tenant A, who may write EndpointSlices in its namespace, writes slices
/// for its selector-less Services naming tenant B's pods: one by hand, one
/// with the EndpointSlice controller's label, the Service as its owner and
/// a `targetRef` into its own namespace (the controller leaves a
/// selector-less Service's slices alone, so both stay). A's Services are
/// older, so that where the slices are trusted (the positive control at the
/// end: `--trust-unmanaged-slices=tenant-a`, as every slice was before)
/// they win B's pods, B's LB IPs go dark and B's pods leave as A's LB IPs.
/// By default neither slice counts: B keeps its pods both ways, A's LB IPs
/// stay unmapped, and each of A's Services gets an UntrustedEndpointSlice
/// Event and the warning metric.
fn slices_naming_another_tenants_pods(backend: Backend) -> Result<()> {
    const TENANT: &str = "tenant-a";
    let mut env = env(backend, Fam::V4)?;
    let _p1 = env.serve_tcp(1, WEB)?;
    let _p2 = env.serve_tcp(2, WEB)?;
    let cp = api(&env)?;
    cp.kubectl(&["create", "namespace", TENANT])?;
    let mut tenant_a = Vec::new();
    for (name, lb, pod, forged_label) in [
        ("a1", env.lb(0), env.pod_ip(1), false),
        ("a2", env.lb(3), env.pod_ip(2), true),
    ] {
        let svc = Svc::new(name, lb).in_namespace(TENANT);
        let mut object = harness::control_plane::k8s::api_service(&svc, "IPv4");
        if let Some(spec) = object["spec"].as_object_mut() {
            spec.remove("selector");
        }
        cp.apply(&format!("{object:#}\n"))?;
        let status = serde_json::json!({"status": svc.value()["status"]});
        cp.patch_status("service", name, Some(TENANT), &status)?;
        let meta = |path: &str| -> Result<String> {
            let path = format!("jsonpath={{.metadata.{path}}}");
            let out = cp.kubectl(&["get", "service", name, "-n", TENANT, "-o", &path])?;
            Ok(out.trim().to_string())
        };
        let uid = meta("uid")?;
        let pod = pod.to_string();
        let mut forged = Slice::new(name, "IPv4", &[(&pod, None)])
            .named(&format!("{name}-forged"))
            .in_namespace(TENANT)
            .on_node(&env.ctl.node)
            .ports(&[("p0", 80, "TCP")]);
        if forged_label {
            forged = forged.by_the_controller(&uid);
        }
        let slice = forged.value();
        cp.apply(&format!("{slice:#}\n"))?;
        // The model's copy (for the expected datapath): the Service with
        // its real creation time; its slice only once it is trusted.
        let held = svc.created(&meta("creationTimestamp")?);
        env.dir.put(&format!("{TENANT}-{name}"), &held.yaml())?;
        tenant_a.push((held, slice));
    }
    // creationTimestamp has a resolution of one second: B is younger.
    std::thread::sleep(Duration::from_millis(1100));
    env.put_service(&Svc::new("b1", env.lb(1)), &[env.pod_ip(1)])?;
    env.put_service(&Svc::new("b2", env.lb(2)), &[env.pod_ip(2)])?;
    env.settle()?;
    env.tcp_reaches(env.lb(1), WEB, 1)?;
    env.tcp_reaches(env.lb(2), WEB, 2)?;
    env.egress_seen_as(1, env.lb(1))?;
    env.egress_seen_as(2, env.lb(2))?;
    env.ping_unanswered(env.lb(0))?;
    env.ping_unanswered(env.lb(3))?;
    let cp = api(&env)?;
    for (name, why) in [
        ("a1", "a1-forged (no managed-by label)"),
        ("a2", "a2-forged (the Service has no selector)"),
    ] {
        eventually(SETTLE, || {
            let events = cp.events_in(TENANT, name)?;
            ensure!(
                events
                    .iter()
                    .any(|e| e.starts_with("UntrustedEndpointSlice") && e.contains(why)),
                "no UntrustedEndpointSlice Event on {TENANT}/{name} naming {why:?}: {events:?}"
            );
            Ok(())
        })?;
    }
    let (_, metrics) = env.controller_http("/metrics")?;
    ensure!(
        metrics.contains("cozy_proxy_warnings{reason=\"UntrustedEndpointSlice\"} 2"),
        "warning metric: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("cozy_proxy_warnings"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // The positive control: the operator trusts tenant-a's slices, and
    // the older Services take B's pods, as any slice did before.
    for (held, slice) in &tenant_a {
        env.dir.put(
            &format!("{TENANT}-{}-slice", held.name),
            &format!("{slice:#}\n"),
        )?;
    }
    env.ctl
        .extra_args
        .push(format!("--trust-unmanaged-slices={TENANT}"));
    env.ctl.restart()?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.tcp_reaches(env.lb(3), WEB, 2)?;
    env.egress_seen_as(1, env.lb(0))?;
    env.ping_unanswered(env.lb(1))
}

#[test]
fn slices_naming_another_tenants_pods_count_for_nothing_nft() -> Result<()> {
    slices_naming_another_tenants_pods(Backend::Nft)
}

#[test]
fn slices_naming_another_tenants_pods_count_for_nothing_ebpf() -> Result<()> {
    slices_naming_another_tenants_pods(Backend::Ebpf)
}
