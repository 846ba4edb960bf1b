//! The cluster scenarios (21-28 of tests/cases/README.md) on two
//! nodes in network namespaces, one real `cozy-proxy` per node, for both
//! backends and both families, on routed nodes, bridged nodes and a VXLAN
//! overlay. Needs root.
#[path = "cases/cluster.rs"]
mod cases;

use cozy_proxy_testkit::{
    nodes::cluster::{Cluster, ClusterShape},
    nodes::net::Fam,
    Backend,
};

fn run(
    backend: Backend,
    shape: ClusterShape,
    fam: Fam,
    scenario: fn(&mut Cluster) -> anyhow::Result<()>,
) {
    let mut c = Cluster::with_shape(backend, fam, shape).expect("cluster");
    if let Err(e) = scenario(&mut c) {
        panic!(
            "{e:#}\n{}{}{}",
            c.logs(),
            c.kernel_state(1),
            c.kernel_state(2)
        );
    }
}

/// Every cluster scenario, for one runner's arguments.
macro_rules! every_scenario {
    ($($head:tt)*) => {
        cozy_proxy_testkit::datapath_suite!($($head)*;
            cases::s21_node_probes_the_pod, cases::s22_pods_reach_a_mapped_pod_by_its_ip,
            cases::s23_pods_reach_a_mapped_pod_by_its_lb_ip,
            cases::s24_a_mapped_pods_destinations, cases::s25_vm_to_vm,
            cases::s26_entering_at_the_other_node, cases::s27_icmp_errors_and_path_mtu,
            cases::s28_endpoint_moves_across_nodes);
    };
}

mod nft {
    use super::*;
    every_scenario!(run(Backend::Nft, ClusterShape::Routed));
}

mod ebpf {
    use super::*;
    every_scenario!(run(Backend::Ebpf, ClusterShape::Routed));
}

mod ebpf_fast {
    use super::*;
    every_scenario!(run(Backend::EbpfFast, ClusterShape::Routed));
}

mod ebpf_xdp {
    use super::*;
    every_scenario!(run(Backend::EbpfXdp, ClusterShape::Routed));
}

/// A bridge per node, the nodes routing each other's pod networks (Flannel
/// host-gw, kindnet).
mod bridge {
    use super::*;
    every_scenario!(@datapaths run(ClusterShape::Bridge));
}

/// A bridge per node, the pod networks joined by VXLAN (Flannel VXLAN).
mod overlay {
    use super::*;
    every_scenario!(@datapaths run(ClusterShape::Overlay));
}

/// Kube-OVN's shape: one pod segment behind a router, each node's `ovn0`
/// on the join network.
mod gateway {
    use super::*;
    every_scenario!(@datapaths run(ClusterShape::Gateway));
}
