//! A two-node cluster in network namespaces (scenarios 21-28 of
//! cozy-proxy/tests/cases/README.md):
//!
//! ```text
//!   far ── (MTU 1400 on ext's side) ── ext ═══ br0 ═══ node1 ── pod1 pod2 pod3
//!                                              ╚══════ node2 ── pod1 pod2 pod3
//! ```
//!
//! `ext` is the outside world and the LAN's router: a bridge joins it and
//! both nodes' uplinks (node-to-node traffic crosses it, as on a real LAN);
//! behind it `far`, across a hop whose MTU is 1400. The nodes route each
//! other's pod networks natively (as a CNI in routed mode), masquerade pod
//! traffic leaving the cluster (as CNIs do), and each runs its own
//! `cozy-proxy run --node-name nodeN` on the same manifests (Nodes with
//! podCIDRs and addresses, Services, EndpointSlices with nodeName).
use crate::control_plane::k8s::{self, ControlPlane};
use crate::control_plane::metallb::{MetalLb, SpeakerNode};
use crate::controller::manifests::{ManifestDir, Svc};
use crate::nodes::net::Fam;
use crate::nodes::topology::{
    bridge_gateway, cmd, join_node, new_ns, no_offload, ovn_router, pod_on_segment,
    remove_namespaces, unique_prefix, veth, wire_port, Shape,
};
use crate::sh::{feed_in, ok_in};
use crate::traffic::{eventually, Server};
use crate::{bin, expected_state, test_bpffs, Backend, Controller};
use anyhow::{bail, Context, Result};
use cozy_proxy::datapath::DatapathState;
use std::{fs, net::IpAddr, path::PathBuf, time::Duration};

/// Pods every node starts with.
pub const PODS: usize = 3;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

/// A pod: its node (1 or 2) and its index on that node (1..=3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pod {
    pub node: usize,
    pub index: usize,
}

pub const fn pod(node: usize, index: usize) -> Pod {
    Pod { node, index }
}

/// The addresses of the cluster, per family.
#[derive(Clone, Debug)]
pub struct ClusterNet {
    pub fam: Fam,
}

impl ClusterNet {
    pub fn ext(&self) -> IpAddr {
        match self.fam {
            Fam::V4 => ip("198.51.100.1"),
            Fam::V6 => ip("2001:db8:100::1"),
        }
    }

    /// Behind ext, across the MTU-1400 hop.
    pub fn far(&self) -> IpAddr {
        match self.fam {
            Fam::V4 => ip("198.51.100.130"),
            Fam::V6 => ip("2001:db8:200::2"),
        }
    }

    /// Node `k`'s uplink address.
    pub fn node(&self, k: usize) -> IpAddr {
        match self.fam {
            Fam::V4 => format!("198.51.100.{}", 1 + k).parse().expect("v4"),
            Fam::V6 => format!("2001:db8:100::{}", 1 + k).parse().expect("v6"),
        }
    }

    pub fn pod(&self, p: Pod) -> IpAddr {
        match self.fam {
            Fam::V4 => format!("192.0.2.{}", 64 * (p.node - 1) + 10 + p.index)
                .parse()
                .expect("v4"),
            Fam::V6 => format!("2001:db8:2::{:x}", 0x100 * (p.node - 1) + 0x10 + p.index)
                .parse()
                .expect("v6"),
        }
    }

    /// The node side of every pod's veth on node `k` (the pods' gateway).
    pub fn gateway(&self, k: usize) -> IpAddr {
        match self.fam {
            Fam::V4 => format!("192.0.2.{}", 64 * (k - 1) + 1).parse().expect("v4"),
            Fam::V6 => format!("2001:db8:2::{:x}", 0x100 * (k - 1) + 1)
                .parse()
                .expect("v6"),
        }
    }

    /// An address of node `k`'s pod network (IPv4) that no pod of the
    /// tests holds: the last of it, for another agent's own device there
    /// (Cilium's `cilium_host`).
    pub fn agent_router_v4(&self, k: usize) -> IpAddr {
        format!("192.0.2.{}", 64 * (k - 1) + 62)
            .parse()
            .expect("v4")
    }

    pub fn lb(&self, i: usize) -> IpAddr {
        match self.fam {
            Fam::V4 => format!("203.0.113.{}", 10 * (i + 1)).parse().expect("v4"),
            Fam::V6 => format!("2001:db8:203::{}", 10 * (i + 1))
                .parse()
                .expect("v6"),
        }
    }

    pub fn address_type(&self) -> &'static str {
        match self.fam {
            Fam::V4 => "IPv4",
            Fam::V6 => "IPv6",
        }
    }
}

pub fn pod_cidr_v4(k: usize) -> String {
    format!("192.0.2.{}/26", 64 * (k - 1))
}

pub fn pod_cidr_v6(k: usize) -> String {
    format!("2001:db8:2::{:x}/120", 0x100 * (k - 1))
}

/// The namespaces of a two-node cluster.
pub struct ClusterTopology {
    pub prefix: String,
    pub shape: ClusterShape,
    /// The pods the tests wire on each node ([`PODS`]), or none where a
    /// CNI plugin wires the kubelets' pods (nodes/real_cluster.rs).
    pub pods: usize,
}

/// How the nodes reach their pods and each other's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterShape {
    /// Routed veths, native routing between the nodes (Calico, Cilium).
    Routed,
    /// A bridge per node holding its pods' gateway, the other node's pods
    /// routed via its address (Flannel host-gw, kindnet).
    Bridge,
    /// A bridge per node, the nodes' pod networks joined by VXLAN (Flannel
    /// VXLAN: `flannel.1`, VNI 1, port 8472, static neighbours and
    /// forwarding entries as flanneld writes them).
    Overlay,
    /// Kube-OVN's: every pod on one segment `ls` in the router's namespace
    /// `ovn` (OVN's distributed switch: pod-to-pod traffic never crosses
    /// a node), a join network with each node's `ovn0`, the pod subnet
    /// routed via the router on every node. The router sends a pod's
    /// traffic out through its own node's `ovn0` (Kube-OVN's distributed
    /// gateway: policy routes by source) and a node's address through
    /// that node's `ovn0` (its node policies).
    Gateway,
}

impl ClusterShape {
    /// The node shape each node has.
    pub fn node_shape(self) -> Shape {
        match self {
            ClusterShape::Routed => Shape::Routed,
            ClusterShape::Gateway => Shape::Gateway,
            _ => Shape::Bridge,
        }
    }
}

impl ClusterTopology {
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    pub fn ext(&self) -> String {
        self.ns("ext")
    }

    pub fn far(&self) -> String {
        self.ns("far")
    }

    pub fn node(&self, k: usize) -> String {
        self.ns(&format!("n{k}"))
    }

    pub fn pod(&self, p: Pod) -> String {
        self.ns(&format!("n{}p{}", p.node, p.index))
    }

    /// Where pod `p`'s own veth ends on its node.
    pub fn pod_port(&self, p: Pod) -> (String, String) {
        match self.shape {
            ClusterShape::Gateway => (self.ovn(), format!("n{}p{}", p.node, p.index)),
            _ => (self.node(p.node), format!("pod{}", p.index)),
        }
    }

    /// The router's namespace of the Gateway shape.
    pub fn ovn(&self) -> String {
        self.ns("ovn")
    }

    fn all(&self) -> Vec<String> {
        let mut all = vec![self.ext(), self.far(), self.ovn()];
        for k in 1..=2 {
            all.push(self.node(k));
            all.extend((1..=self.pods).map(|i| self.pod(pod(k, i))));
        }
        all
    }

    pub fn new(shape: ClusterShape) -> Result<ClusterTopology> {
        ClusterTopology::with_pods(shape, PODS)
    }

    /// The same with `pods` pods on each node.
    pub fn with_pods(shape: ClusterShape, pods: usize) -> Result<ClusterTopology> {
        let t = ClusterTopology {
            prefix: unique_prefix("cpc"),
            shape,
            pods,
        };
        if let Err(e) = t.build() {
            remove_namespaces(&t.all());
            return Err(e);
        }
        Ok(t)
    }

    fn build(&self) -> Result<()> {
        let (ext, far) = (self.ext(), self.far());
        new_ns(&ext)?;
        new_ns(&far)?;
        if self.shape == ClusterShape::Gateway {
            self.build_router()?;
        }
        // The LAN: a bridge in ext, its own address on it.
        cmd(&ext, "ip link add br0 type bridge")?;
        cmd(&ext, "ip addr add 198.51.100.1/25 dev br0")?;
        cmd(&ext, "ip addr add 2001:db8:100::1/64 dev br0 nodad")?;
        cmd(&ext, "ip link set br0 up")?;
        cmd(
            &ext,
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
        )?;
        // far, across a hop whose MTU is 1400 on ext's side.
        veth("to-far", &ext, "uplink", &far)?;
        cmd(&ext, "ip addr add 198.51.100.129/25 dev to-far")?;
        cmd(&ext, "ip addr add 2001:db8:200::1/64 dev to-far nodad")?;
        cmd(&ext, "ip link set to-far mtu 1400")?;
        cmd(&far, "ip addr add 198.51.100.130/25 dev uplink")?;
        cmd(&far, "ip addr add 2001:db8:200::2/64 dev uplink nodad")?;
        for (ns, dev) in [(&ext, "to-far"), (&far, "uplink")] {
            no_offload(ns, dev)?;
            cmd(ns, &format!("ip link set {dev} up"))?;
        }
        cmd(&far, "ip route add default via 198.51.100.129")?;
        cmd(&far, "ip -6 route add default via 2001:db8:200::1")?;
        for k in 1..=2 {
            self.build_node(k)?;
        }
        if self.shape == ClusterShape::Overlay {
            for k in 1..=2 {
                self.vxlan_peer(k)?;
            }
        }
        // ext routes the LB range to node1 (a test may move an LB IP to
        // node2), and each node's pod network to that node.
        cmd(&ext, "ip route add 203.0.113.0/24 via 198.51.100.2")?;
        cmd(
            &ext,
            "ip -6 route add 2001:db8:203::/64 via 2001:db8:100::2",
        )?;
        for k in 1..=2 {
            cmd(
                &ext,
                &format!("ip route add {} via 198.51.100.{}", pod_cidr_v4(k), 1 + k),
            )?;
            cmd(
                &ext,
                &format!(
                    "ip -6 route add {} via 2001:db8:100::{}",
                    pod_cidr_v6(k),
                    1 + k
                ),
            )?;
        }
        Ok(())
    }

    fn build_node(&self, k: usize) -> Result<()> {
        let (ext, node) = (self.ext(), self.node(k));
        new_ns(&node)?;
        let port = format!("to-n{k}");
        veth(&port, &ext, "uplink", &node)?;
        cmd(&ext, &format!("ip link set {port} master br0"))?;
        cmd(
            &node,
            &format!("ip addr add 198.51.100.{}/25 dev uplink", 1 + k),
        )?;
        cmd(
            &node,
            &format!("ip addr add 2001:db8:100::{}/64 dev uplink nodad", 1 + k),
        )?;
        for (ns, dev) in [(&ext, port.as_str()), (&node, "uplink")] {
            no_offload(ns, dev)?;
            cmd(ns, &format!("ip link set {dev} up"))?;
        }
        cmd(&node, "ip route add default via 198.51.100.1")?;
        cmd(&node, "ip -6 route add default via 2001:db8:100::1")?;
        // Native routing toward the other node's pods (the overlay routes
        // them through its tunnel instead).
        let other = 3 - k;
        if matches!(self.shape, ClusterShape::Routed | ClusterShape::Bridge) {
            cmd(
                &node,
                &format!(
                    "ip route add {} via 198.51.100.{}",
                    pod_cidr_v4(other),
                    1 + other
                ),
            )?;
            cmd(
                &node,
                &format!(
                    "ip -6 route add {} via 2001:db8:100::{}",
                    pod_cidr_v6(other),
                    1 + other
                ),
            )?;
        }
        cmd(
            &node,
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
        )?;
        let (v4, v6) = (ClusterNet { fam: Fam::V4 }, ClusterNet { fam: Fam::V6 });
        if self.shape == ClusterShape::Gateway {
            self.join(k)?;
        }
        if matches!(self.shape, ClusterShape::Bridge | ClusterShape::Overlay) {
            bridge_gateway(
                &node,
                &format!("{}/26", v4.gateway(k)),
                &format!("{}/120", v6.gateway(k)),
            )?;
        }
        if self.shape == ClusterShape::Overlay {
            self.vxlan(k)?;
        }
        for i in 1..=self.pods {
            let p = pod(k, i);
            let pns = self.pod(p);
            new_ns(&pns)?;
            let host_if = format!("pod{i}");
            if self.shape == ClusterShape::Gateway {
                wire_port(&self.ovn(), "ls", &self.pod_port(p).1, &pns)?;
                pod_on_segment(
                    &pns,
                    (&v4.pod(p).to_string(), 25, "192.0.2.1"),
                    (&v6.pod(p).to_string(), 64, "2001:db8:2::1"),
                )?;
                continue;
            }
            if self.shape != ClusterShape::Routed {
                wire_port(&node, "cni0", &host_if, &pns)?;
                pod_on_segment(
                    &pns,
                    (&v4.pod(p).to_string(), 26, &v4.gateway(k).to_string()),
                    (&v6.pod(p).to_string(), 120, &v6.gateway(k).to_string()),
                )?;
                continue;
            }
            veth(&host_if, &node, "eth0", &pns)?;
            cmd(
                &node,
                &format!("ip addr add {}/32 dev {host_if}", v4.gateway(k)),
            )?;
            cmd(
                &node,
                &format!("ip addr add {}/128 dev {host_if} nodad", v6.gateway(k)),
            )?;
            cmd(&pns, &format!("ip addr add {}/32 dev eth0", v4.pod(p)))?;
            cmd(
                &pns,
                &format!("ip addr add {}/128 dev eth0 nodad", v6.pod(p)),
            )?;
            for (ns, dev) in [(&node, host_if.as_str()), (&pns, "eth0")] {
                no_offload(ns, dev)?;
                cmd(ns, &format!("ip link set {dev} up"))?;
            }
            cmd(
                &node,
                &format!("ip route add {}/32 dev {host_if}", v4.pod(p)),
            )?;
            cmd(
                &node,
                &format!("ip -6 route add {}/128 dev {host_if}", v6.pod(p)),
            )?;
            cmd(&pns, &format!("ip route add {} dev eth0", v4.gateway(k)))?;
            cmd(&pns, &format!("ip route add default via {}", v4.gateway(k)))?;
            cmd(&pns, &format!("ip -6 route add {} dev eth0", v6.gateway(k)))?;
            cmd(
                &pns,
                &format!("ip -6 route add default via {}", v6.gateway(k)),
            )?;
        }
        // The CNI's masquerade for pod traffic leaving the cluster.
        let rules = "table ip cni {\n  chain post {\n    type nat hook postrouting priority srcnat;\n    \
             ip saddr 192.0.2.0/24 ip daddr != 192.0.2.0/24 oifname \"uplink\" masquerade\n  }\n}\n\
             table ip6 cni {\n  chain post {\n    type nat hook postrouting priority srcnat;\n    \
             ip6 saddr 2001:db8:2::/64 ip6 daddr != 2001:db8:2::/64 oifname \"uplink\" masquerade\n  }\n}\n";
        let out = feed_in(&node, &["nft", "-f", "-"], rules.as_bytes(), 5)?;
        if !out.status.success() {
            bail!("masquerade rules: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }
}

/// Node `k`'s `ovn0` addresses on the join network.
fn ovn0(k: usize) -> (String, String) {
    (
        format!("192.0.2.{}", 193 + k),
        format!("2001:db8:64::{}", 1 + k),
    )
}

impl ClusterTopology {
    /// The Gateway shape's router: the pods' segment `ls` (the pods'
    /// gateway on it), the join network, and Kube-OVN's routing policy:
    /// the routes of the main table (connected networks, node policies)
    /// first, then the pods of node `k` out through node `k`'s `ovn0`.
    fn build_router(&self) -> Result<()> {
        let ovn = self.ovn();
        ovn_router(&ovn)?;
        for fam in ["-4", "-6"] {
            cmd(
                &ovn,
                &format!("ip {fam} rule add pref 50 lookup main suppress_prefixlength 0"),
            )?;
        }
        // Node k's routes in its table come with its ovn0 (join()).
        for k in 1..=2 {
            let table = 100 + k;
            cmd(
                &ovn,
                &format!(
                    "ip rule add pref {table} from {} lookup {table}",
                    pod_cidr_v4(k)
                ),
            )?;
            cmd(
                &ovn,
                &format!(
                    "ip -6 rule add pref {table} from {} lookup {table}",
                    pod_cidr_v6(k)
                ),
            )?;
        }
        Ok(())
    }

    /// Node `k`'s `ovn0` on the join network (with its route to the pod
    /// subnet via the router), and the router's routes through it: node
    /// `k`'s pods out, node `k`'s addresses in.
    fn join(&self, k: usize) -> Result<()> {
        let (ovn, node) = (self.ovn(), self.node(k));
        let (j4, j6) = ovn0(k);
        join_node(
            &ovn,
            &node,
            &format!("n{k}"),
            &format!("{j4}/26"),
            &format!("{j6}/64"),
        )?;
        let table = 100 + k;
        cmd(
            &ovn,
            &format!("ip route add default via {j4} table {table}"),
        )?;
        cmd(
            &ovn,
            &format!("ip -6 route add default via {j6} table {table}"),
        )?;
        cmd(
            &ovn,
            &format!("ip route add 198.51.100.{}/32 via {j4}", 1 + k),
        )?;
        cmd(
            &ovn,
            &format!("ip -6 route add 2001:db8:100::{}/128 via {j6}", 1 + k),
        )
    }
}

/// Node `k`'s VXLAN end, as flanneld sets it up.
fn vtep_mac(k: usize) -> String {
    format!("02:00:00:00:0f:0{k}")
}

/// Node `k`'s VXLAN address: its pod network's first address (as Flannel).
fn vtep(k: usize) -> (String, String) {
    (
        format!("192.0.2.{}", 64 * (k - 1)),
        format!("2001:db8:2::{:x}", 0x100 * (k - 1)),
    )
}

impl ClusterTopology {
    /// Node `k`'s `flannel.1`.
    fn vxlan(&self, k: usize) -> Result<()> {
        let node = self.node(k);
        cmd(
            &node,
            &format!(
                "ip link add flannel.1 address {} type vxlan id 1 local 198.51.100.{} dstport 8472 nolearning dev uplink",
                vtep_mac(k),
                1 + k
            ),
        )?;
        let (v4, v6) = vtep(k);
        cmd(&node, &format!("ip addr add {v4}/32 dev flannel.1"))?;
        cmd(&node, &format!("ip addr add {v6}/128 dev flannel.1 nodad"))?;
        cmd(&node, "ip link set flannel.1 mtu 1450")?;
        no_offload(&node, "flannel.1")?;
        cmd(&node, "ip link set flannel.1 up")
    }

    /// Node `k`'s way to the other node's pods through the tunnel: a
    /// route via the other's VXLAN address, its neighbour entry and its
    /// forwarding entry (the other node's underlay address).
    fn vxlan_peer(&self, k: usize) -> Result<()> {
        let (node, other) = (self.node(k), 3 - k);
        let (o4, o6) = vtep(other);
        let mac = vtep_mac(other);
        cmd(
            &node,
            &format!(
                "ip route add {} via {o4} dev flannel.1 onlink",
                pod_cidr_v4(other)
            ),
        )?;
        cmd(
            &node,
            &format!(
                "ip -6 route add {} via {o6} dev flannel.1 onlink",
                pod_cidr_v6(other)
            ),
        )?;
        for addr in [&o4, &o6] {
            cmd(
                &node,
                &format!("ip neigh add {addr} lladdr {mac} dev flannel.1 nud permanent"),
            )?;
        }
        cmd(
            &node,
            &format!(
                "bridge fdb append {mac} dev flannel.1 dst 198.51.100.{}",
                1 + other
            ),
        )
    }
}

impl Drop for ClusterTopology {
    fn drop(&mut self) {
        remove_namespaces(&self.all());
    }
}

/// The API's address: ext's on the LAN.
pub const API_ADDRESS: &str = "198.51.100.1";

/// The control plane in `ext`, the chart's RBAC, both Nodes, MetalLB with
/// a pool of the first LB IP of each family; the LB range made on-link at
/// `ext`. Returns the controllers' source arguments.
fn real_api(
    topo: &ClusterTopology,
    backend: Backend,
    dir: &ManifestDir,
) -> Result<(ClusterApi, Vec<String>)> {
    let cp = ControlPlane::start_on(
        &topo.ext(),
        std::env::temp_dir().join(format!("{}-k8s", topo.prefix)),
        API_ADDRESS,
    )?;
    cp.install_chart(backend.arg())?;
    dir.put("servicecidr", &k8s::service_cidr_yaml())?;
    for k in 1..=2 {
        let node = format!("node{k}");
        // The spec (podCIDRs) applied; the addresses patched into the
        // status as a kubelet does (two InternalIPs: apply would merge them
        // by type).
        cp.apply(&node_spec_yaml(k))?;
        let addresses: Vec<serde_json::Value> = [Fam::V4, Fam::V6]
            .iter()
            .map(|&fam| serde_json::json!({"type": "InternalIP", "address": ClusterNet { fam }.node(k).to_string()}))
            .collect();
        cp.patch_status(
            "node",
            &node,
            None,
            &serde_json::json!({"status": {"addresses": addresses}}),
        )?;
    }
    let pool: Vec<IpAddr> = [Fam::V4, Fam::V6]
        .into_iter()
        .flat_map(|fam| [ClusterNet { fam }.lb(0), ClusterNet { fam }.lb(1)])
        .collect();
    let speakers = [(topo.node(1), "node1"), (topo.node(2), "node2")];
    let speakers: Vec<SpeakerNode> = (speakers.iter())
        .map(|(ns, name)| SpeakerNode { ns, name })
        .collect();
    let metallb = MetalLb::start(&cp, &pool, &speakers)?;
    // The router's LAN holds the LB range: it asks for an LB IP there,
    // and the announcing speaker answers.
    cmd(&topo.ext(), "ip route replace 203.0.113.0/24 dev br0")?;
    cmd(&topo.ext(), "ip -6 route replace 2001:db8:203::/64 dev br0")?;
    let args = cp.controller_args()?;
    Ok((ClusterApi { metallb, cp }, args))
}

/// Node `k`'s object without its status: the spec (pod networks), as a
/// node IPAM sets it.
pub fn node_spec_yaml(k: usize) -> String {
    let object = node_yaml(k);
    object
        .split("status:")
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Node manifests: addresses and pod networks, as the API publishes them.
fn node_yaml(k: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node{k}\nspec:\n  podCIDRs: [\"{}\", \"{}\"]\n\
         status:\n  addresses:\n  - {{type: InternalIP, address: \"198.51.100.{}\"}}\n  - {{type: InternalIP, address: \"2001:db8:100::{}\"}}\n",
        pod_cidr_v4(k),
        pod_cidr_v6(k),
        1 + k,
        1 + k
    )
}

/// Where the controllers read the cluster from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterSource {
    /// One manifest directory.
    Manifests,
    /// A real control plane on the LAN (in `ext`, served on its address)
    /// with a real MetalLB: its controller allocates the LB IPs, a speaker
    /// on each node announces them, and `ext` reaches the LB range on its
    /// LAN by ARP and NDP (no route to a node).
    RealApi,
}

/// The real control plane and MetalLB of a [`ClusterSource::RealApi`]
/// cluster (MetalLB stops first).
pub struct ClusterApi {
    pub metallb: MetalLb,
    pub cp: ControlPlane,
}

/// A cluster with one controller per node. The manifest directory holds
/// what the cluster holds (the controllers read it, or with a real API
/// the tests compare the datapaths against it).
pub struct Cluster {
    pub ctls: Vec<Controller>,
    /// Dropped after the controllers (a stopping controller asks the API
    /// for its DaemonSet) and before the namespaces.
    pub api: Option<ClusterApi>,
    pub dir: ManifestDir,
    pub topo: ClusterTopology,
    pub net: ClusterNet,
    pub backend: Backend,
}

impl Cluster {
    pub fn new(backend: Backend, fam: Fam) -> Result<Cluster> {
        Cluster::with_shape(backend, fam, ClusterShape::Routed)
    }

    pub fn with_shape(backend: Backend, fam: Fam, shape: ClusterShape) -> Result<Cluster> {
        Cluster::with_source(backend, fam, shape, ClusterSource::Manifests)
    }

    pub fn with_source(
        backend: Backend,
        fam: Fam,
        shape: ClusterShape,
        source: ClusterSource,
    ) -> Result<Cluster> {
        let topo = ClusterTopology::new(shape)?;
        backend.xdp_pods(
            (1..=2)
                .flat_map(|k| (1..=PODS).map(move |i| pod(k, i)))
                .map(|p| (topo.pod(p), "eth0".to_string())),
        )?;
        let dir = ManifestDir::new(&topo.prefix)?;
        for k in 1..=2 {
            dir.put(&format!("node{k}"), &node_yaml(k))?;
        }
        let (api, source) = match source {
            ClusterSource::Manifests => (
                None,
                vec!["--manifests".into(), dir.path.display().to_string()],
            ),
            ClusterSource::RealApi => {
                let (api, args) = real_api(&topo, backend, &dir)?;
                (Some(api), args)
            }
        };
        let mut ctls = Vec::new();
        for k in 1..=2 {
            let log = std::env::temp_dir().join(format!("{}-n{k}-controller.log", topo.prefix));
            let _ = fs::remove_file(&log);
            let pin_dir = match backend {
                Backend::Ebpf | Backend::EbpfFast | Backend::EbpfXdp => {
                    test_bpffs()?.join(format!("{}-n{k}", topo.prefix))
                }
                Backend::Nft => std::env::temp_dir().join(format!("{}-unused-pins", topo.prefix)),
            };
            ctls.push(Controller::start(
                &topo.node(k),
                &format!("node{k}"),
                backend,
                source.clone(),
                pin_dir,
                log,
            )?);
        }
        Ok(Cluster {
            ctls,
            api,
            dir,
            topo,
            net: ClusterNet { fam },
            backend,
        })
    }

    pub fn fam(&self) -> Fam {
        self.net.fam
    }

    pub fn ctl(&mut self, k: usize) -> &mut Controller {
        &mut self.ctls[k - 1]
    }

    pub fn pod_ns(&self, p: Pod) -> String {
        self.topo.pod(p)
    }

    pub fn pod_ip(&self, p: Pod) -> IpAddr {
        self.net.pod(p)
    }

    pub fn lb(&self, i: usize) -> IpAddr {
        self.net.lb(i)
    }

    /// Writes a Service and its EndpointSlice: `p` ready, with its node.
    pub fn put_service(&self, svc: &Svc, p: Pod) -> Result<()> {
        self.dir.put(&svc.name, &svc.yaml())?;
        let slice = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-e\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\n\
             addressType: {}\nendpoints:\n- addresses: [\"{}\"]\n  nodeName: node{}\n",
            self.net.address_type(),
            self.pod_ip(p),
            p.node,
            name = svc.name
        );
        self.dir.put(&format!("{}-endpoints", svc.name), &slice)
    }

    pub fn delete_service(&self, name: &str) -> Result<()> {
        self.dir.remove(name)?;
        self.dir.remove(&format!("{name}-endpoints"))
    }

    /// Node `k`'s datapath, read back by `cozy-proxy dump`.
    pub fn dump(&self, k: usize) -> Result<DatapathState> {
        let v = self.dump_json(k)?;
        Ok(serde_json::from_value(v["state"].clone())?)
    }

    /// Node `k`'s `cozy-proxy dump -o json`, as it prints it (the
    /// controller asked at its default health address).
    pub fn dump_json(&self, k: usize) -> Result<serde_json::Value> {
        let out = ok_in(
            &self.topo.node(k),
            &[
                &bin(),
                "dump",
                "--backend",
                self.backend.arg(),
                "-o",
                "json",
                "--bpf-pin-dir",
                &self.ctls[k - 1].pin_dir.display().to_string(),
            ],
        )?;
        serde_json::from_str(&out).context("dump output")
    }

    /// Waits until both nodes hold what the manifests ask of each.
    pub fn settle(&mut self) -> Result<()> {
        for k in 1..=2 {
            let node = format!("node{k}");
            let want = expected_state(self.dir.path(), &self.topo.node(k), Some(&node), &[])?;
            let got = eventually(Duration::from_secs(5), || {
                let got = self.dump(k)?;
                if got != want {
                    bail!("node{k}: datapath not yet as expected:\n got {got:?}\nwant {want:?}");
                }
                Ok(())
            });
            if let Err(e) = got {
                bail!(
                    "{e:#}\n--- node{k} log ---\n{}",
                    self.ctls[k - 1].log_text()
                );
            }
            if !self.ctls[k - 1].alive() {
                bail!(
                    "node{k}'s controller died:\n{}",
                    self.ctls[k - 1].log_text()
                );
            }
        }
        Ok(())
    }

    /// A TCP and a UDP server in `ns` answering `"<ident> <peer>"`.
    pub fn serve(&self, ns: &str, port: u16, ident: &str) -> Result<(Server, Server)> {
        Ok((
            Server::tcp(ns, self.fam(), port, ident)?,
            Server::udp(ns, self.fam(), port, ident)?,
        ))
    }

    /// From `from`, a TCP and a UDP exchange with `to:port` both answer
    /// `"<ident> <seen>"`: the server identified itself, and saw `seen`
    /// as the source.
    pub fn exchange(
        &self,
        from: &str,
        to: IpAddr,
        port: u16,
        ident: &str,
        seen: IpAddr,
    ) -> Result<()> {
        crate::traffic::exchange(from, to, port, ident, seen)
    }

    /// A scratch file for this cluster.
    pub fn scratch(&self, name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("{}-{name}", self.topo.prefix))
    }

    /// What node `k`'s kernel holds for a failure report: its conntrack
    /// entries, nftables ruleset, neighbours and routes, and the packet
    /// counters that are not zero.
    pub fn kernel_state(&self, k: usize) -> String {
        let ns = self.topo.node(k);
        [
            vec!["conntrack", "-L"],
            vec!["nft", "list", "ruleset"],
            vec!["ip", "neigh"],
            vec!["ip", "route", "show", "table", "all"],
            vec!["nstat", "-a", "-s"],
        ]
        .iter()
        .map(|args| {
            let out = crate::sh::run_in(&ns, args).map_or_else(
                |e| e.to_string(),
                |o| {
                    String::from_utf8_lossy(&o.stdout).into_owned()
                        + &String::from_utf8_lossy(&o.stderr)
                },
            );
            format!("--- node{k}: {} ---\n{out}", args.join(" "))
        })
        .collect()
    }

    /// Both controllers' logs, for a failure report.
    pub fn logs(&self) -> String {
        self.ctls
            .iter()
            .map(|c| format!("--- {} ---\n{}", c.node, c.log_text()))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.ctls {
            let _ = c.stop();
            let pins = c.pin_dir.display().to_string();
            let _ = crate::sh::run_in(
                &self
                    .topo
                    .node(c.node.trim_start_matches("node").parse().unwrap_or(1)),
                &[&bin(), "cleanup", "--bpf-pin-dir", &pins],
            );
        }
    }
}
