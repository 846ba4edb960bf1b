//! Two real nodes (nodes/kubelet.rs) on the two-node cluster's LAN
//! (nodes/cluster.rs, routed or bridged, no pods wired by the tests: the
//! kubelets' pods get theirs from the `ptp` or `bridge` CNI plugin),
//! joined to a real
//! control plane in `ext` served on the LAN (kube-apiserver with the Node
//! authorizer, kube-controller-manager with the workload controllers,
//! kube-scheduler), the real kube-proxy in nftables mode on every node,
//! and MetalLB (its controller and a speaker per node, in layer 2, as
//! processes in the nodes' namespaces).
//!
//! cozy-proxy runs as the operator runs it: `helm install` of the chart,
//! its DaemonSet's pods scheduled, started by containerd under the chart's
//! security settings and probed by the kubelets; the tenants' workloads
//! are Pods (busybox standing in for a VM) behind labelled Services.
//!
//! What it does not model: MetalLB's components as containers (they run
//! as processes beside the kubelets; their Pod objects, which they read,
//! run a sleeping placeholder), cluster DNS, and image pulls
//! (nodes/images.rs).
use crate::control_plane::k8s::{self, ControlPlane, Workloads, RELEASE, RELEASE_NAMESPACE};
use crate::control_plane::metallb::{MetalLb, SpeakerNode};
use crate::nodes::cluster::{
    node_spec_yaml, pod_cidr_v4, pod_cidr_v6, ClusterNet, ClusterShape, ClusterTopology,
    API_ADDRESS,
};
use crate::nodes::images::{COZY_PROXY_REPOSITORY, WORKLOAD};
use crate::nodes::kubelet::{Cni, KubeletNode, NodeSpec};
use crate::nodes::net::Fam;
use crate::nodes::topology::cmd;
use crate::traffic::eventually;
use anyhow::{bail, Context, Result};
use std::{net::IpAddr, time::Duration};

/// The nodes: node1 and node2.
pub const NODES: usize = 2;

/// The addresses per family a node's CNI range holds.
pub const POD_ADDRESSES: usize = 31;

/// The namespace the tenants' workloads and Services live in.
pub const TENANT_NAMESPACE: &str = "default";

/// The cluster; dropped in this order: the nodes (their pods), MetalLB,
/// the control plane, the namespaces.
pub struct RealCluster {
    pub nodes: Vec<KubeletNode>,
    pub metallb: MetalLb,
    pub cp: ControlPlane,
    pub topo: ClusterTopology,
}

/// Node `k`'s CNI ranges: in its pod network, from .20 (the tests' wired
/// pods elsewhere use .1x), the gateway the first address; `size`
/// addresses per family.
fn pod_ranges(k: usize, size: usize) -> Vec<(String, IpAddr, IpAddr, IpAddr)> {
    let base = 64 * (k - 1);
    let v4 = |i: usize| -> IpAddr { format!("192.0.2.{}", base + i).parse().expect("v4") };
    let v6 = |i: usize| -> IpAddr {
        format!("2001:db8:2::{:x}", 0x100 * (k - 1) + i)
            .parse()
            .expect("v6")
    };
    vec![
        (pod_cidr_v4(k), v4(20), v4(20 + size - 1), v4(1)),
        (pod_cidr_v6(k), v6(0x20), v6(0x20 + size - 1), v6(1)),
    ]
}

/// The workload's container: busybox's httpd on port 8081 (in the
/// foreground), Ready once it listens.
fn workload_container() -> serde_json::Value {
    serde_json::json!({
        "name": "vm",
        "image": WORKLOAD,
        "imagePullPolicy": "Never",
        "args": ["httpd", "-f", "-p", "8081", "-h", "/tmp"],
        "readinessProbe": {"tcpSocket": {"port": 8081}, "periodSeconds": 1},
    })
}

/// Tenant workload `name`'s Pod on node `k`, labelled for its Service's
/// selector, running `container`.
fn workload_pod(
    name: &str,
    k: usize,
    grace_s: u32,
    container: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": TENANT_NAMESPACE,
                     "labels": {k8s::SELECTOR_LABEL: name}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": format!("node{k}")},
            "terminationGracePeriodSeconds": grace_s,
            "containers": [container],
        },
    })
}

impl RealCluster {
    pub fn start() -> Result<RealCluster> {
        RealCluster::start_with(Cni::Ptp, POD_ADDRESSES)
    }

    /// The same with `cni` wiring the pods (the LAN's shape follows it:
    /// routed nodes for `ptp`, a bridge per node for `bridge`), node2's
    /// CNI range holding `node2_addresses` addresses per family (one: each
    /// pod there gets the address the one before it had).
    pub fn start_with(cni: Cni, node2_addresses: usize) -> Result<RealCluster> {
        let shape = match cni {
            Cni::Ptp => ClusterShape::Routed,
            Cni::Bridge => ClusterShape::Bridge,
        };
        let topo = ClusterTopology::with_pods(shape, 0)?;
        let cp = ControlPlane::start_for(
            &topo.ext(),
            std::env::temp_dir().join(format!("{}-k8s", topo.prefix)),
            API_ADDRESS,
            Workloads::Kubelets,
        )?;
        let mut cp = cp;
        let mut nodes = Vec::new();
        for k in 1..=NODES {
            let name = format!("node{k}");
            // The pod networks in the spec, as a node IPAM would set them.
            cp.apply(&node_spec_yaml(k))?;
            let addresses = [Fam::V4, Fam::V6]
                .into_iter()
                .map(|fam| ClusterNet { fam }.node(k))
                .collect();
            let spec = NodeSpec {
                cni,
                name: name.clone(),
                ns: topo.node(k),
                addresses,
                pod_ranges: pod_ranges(
                    k,
                    if k == 2 {
                        node2_addresses
                    } else {
                        POD_ADDRESSES
                    },
                ),
            };
            let dir = std::env::temp_dir().join(format!("{}-{name}", topo.prefix));
            nodes.push(KubeletNode::start(spec, dir, &cp)?);
            cp.start_node_kube_proxy(&topo.node(k), &name)?;
        }
        let pool: Vec<IpAddr> = [Fam::V4, Fam::V6]
            .into_iter()
            .flat_map(|fam| [ClusterNet { fam }.lb(0), ClusterNet { fam }.lb(1)])
            .collect();
        let names: Vec<(String, String)> = (1..=NODES)
            .map(|k| (topo.node(k), format!("node{k}")))
            .collect();
        let speakers: Vec<SpeakerNode> = (names.iter())
            .map(|(ns, name)| SpeakerNode { ns, name })
            .collect();
        let metallb = MetalLb::start_placed(&cp, &pool, &speakers, Some(WORKLOAD))?;
        // The router's LAN holds the LB range: the announcing speaker
        // answers for an LB IP there.
        cmd(&topo.ext(), "ip route replace 203.0.113.0/24 dev br0")?;
        cmd(&topo.ext(), "ip -6 route replace 2001:db8:203::/64 dev br0")?;
        Ok(RealCluster {
            nodes,
            metallb,
            cp,
            topo,
        })
    }

    /// `helm upgrade --install` of the chart with `backend` and the image
    /// of the binary under test (tag `tag`, imported on every node), then
    /// waits for the DaemonSet's rollout: a pod Ready on every node.
    pub fn install(&self, backend: &str, tag: &str) -> Result<()> {
        self.cp.install_chart_with(
            backend,
            &[
                format!("image.repository={COZY_PROXY_REPOSITORY}"),
                format!("image.tag={tag}"),
                "image.pullPolicy=Never".into(),
            ],
        )?;
        self.rollout()
    }

    /// Waits until the DaemonSet's pods are updated and Ready on every
    /// node; the error carries the pods' states and the kubelets' logs.
    pub fn rollout(&self) -> Result<()> {
        let out = self.cp.kubectl(&[
            "rollout",
            "status",
            "daemonset/cozy-proxy",
            "-n",
            RELEASE_NAMESPACE,
            "--timeout",
            "150s",
            "--request-timeout=0",
        ]);
        if let Err(e) = out {
            bail!("{e:#}\n{}", self.report());
        }
        Ok(())
    }

    /// What a failure report needs: the pods, their events, the end of
    /// each node's kubelet and containerd logs.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for args in [
            &["get", "pods", "-A", "-o", "wide"][..],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
        ] {
            out += &format!(
                "--- kubectl {} ---\n{}\n",
                args.join(" "),
                self.cp.kubectl(args).unwrap_or_else(|e| format!("{e:#}"))
            );
        }
        for n in &self.nodes {
            for log in ["kubelet.log", "containerd.log"] {
                out += &format!("--- {} {log} ---\n{}\n", n.spec.name, n.log_tail(log, 25));
            }
        }
        out
    }

    /// A tenant's workload: a Pod of the workload image on node `k`
    /// (busybox's httpd on port 8081, its readiness probe), labelled for
    /// Service `name`'s selector; returns once it is Ready, its sandbox's
    /// network namespace attached on the host as `<prefix>-w-<name>`.
    pub fn put_workload(&self, name: &str, k: usize) -> Result<String> {
        self.cp
            .apply(&workload_pod(name, k, 2, workload_container()).to_string())?;
        let ready = self.cp.kubectl(&[
            "wait",
            "--for=condition=Ready",
            &format!("pod/{name}"),
            "-n",
            TENANT_NAMESPACE,
            "--timeout=90s",
            "--request-timeout=0",
        ]);
        if let Err(e) = ready {
            bail!("{e:#}\n{}", self.report());
        }
        let ns = format!("{}-w-{name}", self.topo.prefix);
        self.nodes[k - 1].attach_pod_netns(TENANT_NAMESPACE, name, &ns)?;
        Ok(ns)
    }

    /// A tenant's workload Pod on node `k` whose readiness is a file: Ready
    /// while `/tmp/ready` exists (`set_ready`); its grace period
    /// `grace_s` seconds, through which it keeps running (its shell, pid
    /// 1, ignores SIGTERM) and its readiness probe goes on. Returns at
    /// once (the pod is not Ready yet).
    pub fn put_probed_workload(&self, name: &str, k: usize, grace_s: u32) -> Result<()> {
        let container = serde_json::json!({
            "name": "vm",
            "image": WORKLOAD,
            "imagePullPolicy": "Never",
            "args": ["sh", "-c", "httpd -p 8081 -h /tmp; exec sleep 2147483647"],
            "readinessProbe": {
                "exec": {"command": ["cat", "/tmp/ready"]},
                "periodSeconds": 1,
                "failureThreshold": 1,
            },
        });
        let pod = workload_pod(name, k, grace_s, container);
        self.cp.apply(&pod.to_string())
    }

    /// Makes workload `name`'s readiness probe pass or fail.
    pub fn set_ready(&self, name: &str, ready: bool) -> Result<()> {
        let change = if ready {
            "touch /tmp/ready"
        } else {
            "rm -f /tmp/ready"
        };
        self.cp
            .kubectl(&[
                "exec",
                "-n",
                TENANT_NAMESPACE,
                name,
                "--",
                "sh",
                "-c",
                change,
            ])
            .map(|_| ())
    }

    /// The EndpointSlice conditions of Service `name`'s endpoint(s), as
    /// `ready/serving/terminating` lines.
    pub fn slice_conditions(&self, name: &str) -> Result<String> {
        self.cp.kubectl(&[
            "get",
            "endpointslices",
            "-n",
            TENANT_NAMESPACE,
            "-l",
            &format!("kubernetes.io/service-name={name}"),
            "-o",
            "jsonpath={range .items[*].endpoints[*]}{.addresses[0]} {.conditions.ready}/{.conditions.serving}/{.conditions.terminating}{\"\\n\"}{end}",
        ])
    }

    /// The pod node `k`'s datapath maps LB IP `lb` to, read by `kubectl
    /// exec ... dump -o json` in its cozy-proxy pod.
    pub fn mapped(&self, k: usize, lb: IpAddr) -> Result<Option<IpAddr>> {
        let out = self.exec(k, &["/cozy-proxy", "dump", "-o", "json"])?;
        let dump: serde_json::Value = serde_json::from_str(&out).context("dump -o json")?;
        Ok(dump["state"]["svc_pod"][lb.to_string()]
            .as_str()
            .and_then(|p| p.parse().ok()))
    }

    /// A tenant's workload as a Deployment of one replica (a VM's
    /// controller recreates it elsewhere when its node is drained): the
    /// workload image's httpd on port 8081, labelled for Service `name`.
    /// Returns once its pod is Ready, with that pod's name and node.
    pub fn put_deployment(&self, name: &str) -> Result<(String, String)> {
        let deployment = serde_json::json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": TENANT_NAMESPACE},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {k8s::SELECTOR_LABEL: name}},
                "template": {
                    "metadata": {"labels": {k8s::SELECTOR_LABEL: name}},
                    "spec": {
                        "terminationGracePeriodSeconds": 2,
                        "containers": [workload_container()],
                    },
                },
            },
        });
        self.cp.apply(&deployment.to_string())?;
        self.ready_pod_of(name, None)
    }

    /// The Ready pod of workload `name` (on a node other than `not_on`,
    /// if given): its name and node; waits up to 90 s.
    pub fn ready_pod_of(&self, name: &str, not_on: Option<&str>) -> Result<(String, String)> {
        self.eventually(Duration::from_secs(90), || {
            let out = self.pods(
                TENANT_NAMESPACE,
                &format!("{}={name}", k8s::SELECTOR_LABEL),
                "jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.conditions[?(@.type==\"Ready\")].status} {.metadata.deletionTimestamp}{\"\\n\"}{end}",
            )?;
            for line in out.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if let [pod, node, "True"] = f.as_slice() {
                    if Some(*node) != not_on {
                        return Ok((pod.to_string(), node.to_string()));
                    }
                }
            }
            bail!("no Ready pod of {name} (not on {not_on:?}): {out}")
        })
    }

    /// How long Pod `pod` took from its creation to Ready, from its
    /// status (the API's timestamps, to the second).
    pub fn time_to_ready(&self, pod: &str) -> Result<Duration> {
        let out = self.cp.kubectl(&[
            "get",
            "pod",
            pod,
            "-n",
            TENANT_NAMESPACE,
            "-o",
            "jsonpath={.metadata.creationTimestamp} {.status.conditions[?(@.type==\"Ready\")].lastTransitionTime}",
        ])?;
        let times: Vec<i64> = (out.split_whitespace())
            .map(|t| {
                let out = crate::sh::ok(&["date", "-d", t, "+%s"])?;
                out.trim().parse::<i64>().context("date +%s")
            })
            .collect::<Result<_>>()?;
        match times.as_slice() {
            [created, ready] if ready >= created => {
                Ok(Duration::from_secs((ready - created) as u64))
            }
            _ => bail!("pod {pod}'s times: {out:?}"),
        }
    }

    /// Attaches Pod `pod`'s network namespace on node `node` as
    /// `<prefix>-w-<pod>`; returns its name.
    pub fn attach(&self, pod: &str, node: &str) -> Result<String> {
        let k: usize = node
            .trim_start_matches("node")
            .parse()
            .with_context(|| format!("node name {node}"))?;
        let ns = format!("{}-w-{pod}", self.topo.prefix);
        self.nodes[k - 1].attach_pod_netns(TENANT_NAMESPACE, pod, &ns)?;
        Ok(ns)
    }

    /// Deletes Pod `name` and waits until it is gone (its sandbox torn
    /// down, its address released).
    pub fn delete_pod(&self, name: &str) -> Result<()> {
        self.cp
            .kubectl(&[
                "delete",
                "pod",
                name,
                "-n",
                TENANT_NAMESPACE,
                "--wait=true",
                "--timeout=60s",
                "--request-timeout=0",
            ])
            .map(|_| ())
    }

    /// The address family's IP of Pod `name`.
    pub fn pod_ip(&self, name: &str, fam: Fam) -> Result<IpAddr> {
        let out = self.cp.kubectl(&[
            "get",
            "pod",
            name,
            "-n",
            TENANT_NAMESPACE,
            "-o",
            "jsonpath={.status.podIPs[*].ip}",
        ])?;
        out.split_whitespace()
            .filter_map(|a| a.parse::<IpAddr>().ok())
            .find(|a| a.is_ipv4() == (fam == Fam::V4))
            .with_context(|| format!("pod {name} has no {fam:?} address: {out:?}"))
    }

    /// `kubectl get pods` in `namespace` with label selector `selector`,
    /// output `output`.
    fn pods(&self, namespace: &str, selector: &str, output: &str) -> Result<String> {
        self.cp
            .kubectl(&["get", "pods", "-n", namespace, "-l", selector, "-o", output])
    }

    /// Node `k`'s cozy-proxy pod.
    pub fn cozy_proxy_pod(&self, k: usize) -> Result<String> {
        let out = self.cp.kubectl(&[
            "get",
            "pods",
            "-n",
            RELEASE_NAMESPACE,
            "-l",
            "app.kubernetes.io/name=cozy-proxy",
            "--field-selector",
            &format!("spec.nodeName=node{k}"),
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?;
        out.split_whitespace()
            .next()
            .map(str::to_string)
            .with_context(|| format!("no cozy-proxy pod on node{k}"))
    }

    /// `kubectl exec` of `args` in node `k`'s cozy-proxy pod.
    pub fn exec(&self, k: usize, args: &[&str]) -> Result<String> {
        let pod = self.cozy_proxy_pod(k)?;
        let mut all = vec!["exec", "-n", RELEASE_NAMESPACE, pod.as_str(), "--"];
        all.extend_from_slice(args);
        self.cp.kubectl(&all)
    }

    /// The cozy-proxy image of tag `from` tagged `to` on every node.
    pub fn tag_image(&self, from: &str, to: &str) -> Result<()> {
        let image = |tag: &str| format!("{COZY_PROXY_REPOSITORY}:{tag}");
        for n in &self.nodes {
            n.tag_image(&image(from), &image(to))?;
        }
        Ok(())
    }

    /// Deletes node `k`'s cozy-proxy pod, as an operator would; returns
    /// once the DaemonSet's replacement is Ready.
    pub fn delete_cozy_proxy_pod(&self, k: usize) -> Result<()> {
        let pod = self.cozy_proxy_pod(k)?;
        self.cp.kubectl(&[
            "delete",
            "pod",
            "-n",
            RELEASE_NAMESPACE,
            &pod,
            "--request-timeout=0",
        ])?;
        self.rollout()
    }

    /// `helm uninstall`; returns once the cozy-proxy pods are gone.
    pub fn uninstall(&self) -> Result<()> {
        self.cp
            .helm(&["uninstall", RELEASE, "--wait", "--timeout", "120s"])?;
        self.eventually(Duration::from_secs(60), || {
            let left = self.pods(
                RELEASE_NAMESPACE,
                "app.kubernetes.io/name=cozy-proxy",
                "name",
            )?;
            anyhow::ensure!(left.trim().is_empty(), "still there: {left}");
            Ok(())
        })
    }

    /// What cozy-proxy left on node `k`: its nft tables, its pinned BPF
    /// objects (the binary under test's own `dump` of the eBPF backend,
    /// in the node's namespaces), its LB IPs' routes. Empty: nothing.
    pub fn leftovers(&self, k: usize) -> Result<Vec<String>> {
        let node = &self.nodes[k - 1];
        let mut left = Vec::new();
        let tables = node.ok(&["nft", "list", "tables"])?;
        left.extend(
            (tables.lines())
                .filter(|l| l.contains("cozy_proxy"))
                .map(|l| format!("nft: {l}")),
        );
        let pins = node.ok(&[
            "sh",
            "-c",
            "ls -A /sys/fs/bpf/cozy-proxy 2>/dev/null || true",
        ])?;
        left.extend(
            (pins.split_whitespace()).map(|p| format!("pinned: /sys/fs/bpf/cozy-proxy/{p}")),
        );
        for family in ["-4", "-6"] {
            let routes = node.ok(&["ip", family, "route", "show", "proto", "249"])?;
            left.extend(routes.lines().map(|r| format!("route: {r}")));
        }
        Ok(left)
    }

    /// Waits `within` for `check`.
    pub fn eventually<T>(&self, within: Duration, check: impl FnMut() -> Result<T>) -> Result<T> {
        eventually(within, check).with_context(|| self.report())
    }
}

impl Drop for RealCluster {
    /// The workloads' namespaces attached on the host go; the rest goes
    /// with the fields.
    fn drop(&mut self) {
        let prefix = format!("{}-w-", self.topo.prefix);
        let listed = crate::sh::ok(&["ip", "netns", "list"]).unwrap_or_default();
        for name in listed.lines().filter_map(|l| l.split_whitespace().next()) {
            if name.starts_with(&prefix) {
                let _ = crate::sh::ok(&["ip", "netns", "del", name]);
            }
        }
    }
}
