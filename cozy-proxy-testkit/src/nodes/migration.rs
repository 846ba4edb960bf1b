//! A VM that live-migrates between the two nodes of a [`Cluster`] (routed
//! veths, or a bridge per node), as KubeVirt on Kube-OVN does it: the VM keeps its IP and its
//! sockets; its interface moves from one node to the other; the network
//! then delivers its IP at the node it runs on. The VM is one namespace
//! with an interface toward each node (the one it runs through, and the
//! target's while a migration is under way), its address on both, so its
//! sockets survive the move.
//!
//! And the objects a migration writes: the EndpointSlice as the
//! EndpointSlice controller writes it from the two virt-launcher pods'
//! conditions, or, with a real API, the pods themselves.
use crate::control_plane::k8s::{ControlPlane, SELECTOR_LABEL};
use crate::nodes::cluster::{Cluster, ClusterShape};
use crate::nodes::net::Fam;
use crate::nodes::topology::{cmd, ip_batch, new_ns, no_offload, remove_namespaces, veth};
use crate::traffic::{eventually, SETTLE};
use anyhow::{ensure, Result};
use std::net::IpAddr;

/// The VM's addresses: in node1's pod network, as a VM created there got
/// it (and kept it).
pub fn vm_ip(fam: Fam) -> IpAddr {
    match fam {
        Fam::V4 => "192.0.2.20".parse().expect("v4"),
        Fam::V6 => "2001:db8:2::20".parse().expect("v6"),
    }
}

/// The interface toward node `k`, in the VM's namespace.
fn eth(k: usize) -> String {
    format!("eth{k}")
}

pub struct Vm {
    pub ns: String,
    /// The node the VM runs on.
    pub on: usize,
    shape: ClusterShape,
}

/// The node's side of the VM's link.
const PORT: &str = "vm";

impl Vm {
    /// The VM, running on node1: on routed nodes a veth of its own toward
    /// each node (the node's side holding the pods' gateway address), on
    /// bridged nodes a port of each node's pod bridge.
    pub fn start(c: &Cluster) -> Result<Vm> {
        let shape = c.topo.shape;
        ensure!(
            matches!(shape, ClusterShape::Routed | ClusterShape::Bridge),
            "the migrating VM is built on routed or bridged nodes"
        );
        let vm = Vm {
            ns: c.topo.ns("vm"),
            on: 1,
            shape,
        };
        new_ns(&vm.ns)?;
        for k in 1..=2 {
            let node = c.topo.node(k);
            veth(PORT, &node, &eth(k), &vm.ns)?;
            if shape == ClusterShape::Bridge {
                cmd(&node, &format!("ip link set {PORT} master cni0"))?;
            } else {
                let (g4, g6) = gateways(k);
                cmd(&node, &format!("ip addr add {g4}/32 dev {PORT}"))?;
                cmd(&node, &format!("ip addr add {g6}/128 dev {PORT} nodad"))?;
            }
            no_offload(&node, PORT)?;
            no_offload(&vm.ns, &eth(k))?;
            cmd(&node, &format!("ip link set {PORT} up"))?;
            // The address stays on an interface that goes down (IPv6
            // removes it otherwise).
            cmd(
                &vm.ns,
                &format!("sysctl -qw net.ipv6.conf.{}.keep_addr_on_down=1", eth(k)),
            )?;
            for fam in [Fam::V4, Fam::V6] {
                let len = if fam == Fam::V4 { 32 } else { 128 };
                cmd(
                    &vm.ns,
                    &format!("ip addr add {}/{len} dev {} nodad", vm_ip(fam), eth(k)),
                )?;
            }
        }
        ip_batch(&vm.ns, &vm.attach(1))?;
        let here: Vec<String> = [Fam::V4, Fam::V6].map(|f| vm.route_here(f)).into();
        ip_batch(&c.topo.node(1), &here)?;
        Ok(vm)
    }

    /// Node `k`'s route into the VM's port: the port itself (routed), or
    /// the pod bridge it is a port of.
    fn route_here(&self, fam: Fam) -> String {
        let dev = match self.shape {
            ClusterShape::Bridge => "cni0",
            _ => PORT,
        };
        format!("route replace {} dev {dev}", vm_ip(fam))
    }

    /// The VM's side of the move: its interface toward node `k` up with
    /// the routes through it (as `ip -batch` lines; the family follows
    /// from the addresses).
    fn attach(&self, k: usize) -> Vec<String> {
        let (g4, g6) = gateways(k);
        let dev = eth(k);
        vec![
            format!("link set {dev} up"),
            format!("route replace {g4} dev {dev}"),
            format!("route replace default via {g4} dev {dev}"),
            format!("route replace {g6} dev {dev}"),
            format!("route replace default via {g6} dev {dev}"),
        ]
    }

    /// A migration target on node `k`: the VM's interface toward `k` up
    /// (and the node's side carrying), the VM's routes still through the
    /// node it runs on. A target pod's link is up long before the
    /// switch-over, so the switch-over ([`Vm::move_to`]) only moves routes
    /// and takes the source's link down.
    pub fn target(&self, k: usize) -> Result<()> {
        ip_batch(&self.ns, &[format!("link set {} up", eth(k))])
    }

    /// The target on node `k` gone (a failed migration): its link down.
    pub fn target_gone(&self, k: usize) -> Result<()> {
        ensure!(k != self.on, "the VM runs through node{k}");
        ip_batch(&self.ns, &[format!("link set {} down", eth(k))])
    }

    /// Live migration's switch-over to node `k`: the VM resumes there (its
    /// interface toward `k` up, the other down), and the network delivers
    /// its IP at `k` (the node routes it into the VM's port, the other node
    /// routes it to `k`). One `ip -batch` per namespace, so that the
    /// network follows the VM within milliseconds, as a real network
    /// follows its gratuitous announcement.
    pub fn move_to(&mut self, c: &Cluster, k: usize) -> Result<()> {
        let from = self.on;
        let mut vm = self.attach(k);
        vm.push(format!("link set {} down", eth(from)));
        let (mut here, mut there) = (Vec::new(), Vec::new());
        for fam in [Fam::V4, Fam::V6] {
            here.push(self.route_here(fam));
            let net = crate::nodes::cluster::ClusterNet { fam };
            there.push(format!("route replace {} via {}", vm_ip(fam), net.node(k)));
        }
        ip_batch(&self.ns, &vm)?;
        ip_batch(&c.topo.node(k), &here)?;
        ip_batch(&c.topo.node(from), &there)?;
        self.on = k;
        Ok(())
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        remove_namespaces(std::slice::from_ref(&self.ns));
    }
}

/// Node `k`'s address on its side of a pod's link (the pods' gateway).
fn gateways(k: usize) -> (IpAddr, IpAddr) {
    let (v4, v6) = (
        crate::nodes::cluster::ClusterNet { fam: Fam::V4 },
        crate::nodes::cluster::ClusterNet { fam: Fam::V6 },
    );
    (v4.gateway(k), v6.gateway(k))
}

/// An endpoint of a virt-launcher pod: its node and its conditions
/// `(ready, serving, terminating)`, as the EndpointSlice controller writes
/// them (KubeVirt's readiness gate holds a target's `ready` and `serving`
/// false until the VM runs there).
#[derive(Clone, Copy, Debug)]
pub struct Launcher {
    pub node: usize,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Launcher {
    pub const fn ready(node: usize) -> Launcher {
        Launcher {
            node,
            ready: true,
            serving: true,
            terminating: false,
        }
    }

    /// Created, its readiness gate not met yet.
    pub const fn starting(node: usize) -> Launcher {
        Launcher {
            node,
            ready: false,
            serving: false,
            terminating: false,
        }
    }

    /// Terminating, its VM gone.
    pub const fn ending(node: usize) -> Launcher {
        Launcher {
            node,
            ready: false,
            serving: false,
            terminating: true,
        }
    }
}

/// The Service `name`'s EndpointSlice: the VM's IP once per launcher pod.
pub fn launchers_slice(name: &str, fam: Fam, pods: &[Launcher]) -> String {
    let net = crate::nodes::cluster::ClusterNet { fam };
    let mut y = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-e\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\n\
         addressType: {}\nendpoints:\n",
        net.address_type()
    );
    for l in pods {
        y += &format!(
            "- addresses: [\"{}\"]\n  nodeName: node{}\n  targetRef: {{kind: Pod, namespace: default, name: virt-launcher-vm-n{}}}\n  conditions: {{ready: {}, serving: {}, terminating: {}}}\n",
            vm_ip(fam),
            l.node,
            l.node,
            l.ready,
            l.serving,
            l.terminating
        );
    }
    y
}

/// The name of the launcher pod on node `k`.
fn launcher_pod(k: usize) -> String {
    format!("virt-launcher-vm-n{k}")
}

/// The launcher pods of Service `service` through the API, as KubeVirt
/// creates them and kubelets report them: each on its node, the VM's IP
/// in its status, `Ready` as its launcher's; an ending one deleted
/// gracefully (no kubelet confirms it, so it stays terminating); a pod no
/// longer listed deleted at once. The real EndpointSlice controller makes
/// the slice from them.
pub fn put_launcher_pods(
    cp: &ControlPlane,
    service: &str,
    fam: Fam,
    pods: &[Launcher],
) -> Result<()> {
    let wanted: Vec<String> = pods.iter().map(|l| launcher_pod(l.node)).collect();
    for name in cp.pods_of(service)? {
        if !wanted.contains(&name) {
            cp.delete_pod(&name)?;
        }
    }
    for (l, name) in pods.iter().zip(&wanted) {
        cp.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    {SELECTOR_LABEL}: {service}\n\
             spec:\n  nodeName: node{}\n  containers:\n  - {{name: compute, image: registry.invalid/virt-launcher:1}}\n",
            l.node
        ))?;
        let ip = vm_ip(fam).to_string();
        let ready = if l.ready { "True" } else { "False" };
        cp.patch_status(
            "pod",
            name,
            Some("default"),
            &serde_json::json!({"status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": ready}],
            }}),
        )?;
        if l.terminating {
            cp.kubectl(&["delete", "pod", name, "-n", "default", "--wait=false"])?;
        }
    }
    // The EndpointSlice controller's slice: one endpoint per pod, with the
    // launcher's node and conditions.
    let mut want: Vec<String> = (pods.iter())
        .map(|l| {
            format!(
                "{} node{} {} {} {}",
                vm_ip(fam),
                l.node,
                l.ready,
                l.serving,
                l.terminating
            )
        })
        .collect();
    want.sort();
    eventually(SETTLE, || {
        let mut got = cp.endpoints_of(
            service,
            "{.addresses[0]} {.nodeName} {.conditions.ready} {.conditions.serving} {.conditions.terminating}",
        )?;
        got.sort();
        ensure!(got == want, "EndpointSlice {got:?}, expected {want:?}");
        Ok(())
    })
}
