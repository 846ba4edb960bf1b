//! The cluster scenarios (21-28 of ../shared/reference/scenarios.md) on two
//! nodes in network namespaces, one real `cozy-proxy` per node, for both
//! backends and both families. Needs root.
#[path = "cases/cluster.rs"]
mod cases;

use cozy_proxy_testkit::{cluster::Cluster, net::Fam, Backend};

fn run(backend: Backend, fam: Fam, scenario: fn(&mut Cluster) -> anyhow::Result<()>) {
    let mut c = Cluster::new(backend, fam).expect("cluster");
    if let Err(e) = scenario(&mut c) {
        panic!("{e:#}\n{}", c.logs());
    }
}

macro_rules! suite {
    ($backend:expr) => {
        suite!(@family v4, $backend, Fam::V4);
        suite!(@family v6, $backend, Fam::V6);
    };
    (@family $fam_mod:ident, $backend:expr, $fam:expr) => {
        mod $fam_mod {
            use super::super::{cases as cluster, run, Backend, Fam};
            suite!(@tests $backend, $fam;
                s21_node_probes_the_pod, s22_pods_reach_a_mapped_pod_by_its_ip,
                s23_pods_reach_a_mapped_pod_by_its_lb_ip, s24_a_mapped_pods_destinations,
                s25_vm_to_vm, s26_entering_at_the_other_node, s27_icmp_errors_and_path_mtu,
                s28_endpoint_moves_across_nodes);
        }
    };
    (@tests $backend:expr, $fam:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                run($backend, $fam, cluster::$name);
            }
        )*
    };
}

mod nft {
    suite!(Backend::Nft);
}

mod ebpf {
    suite!(Backend::Ebpf);
}

mod ebpf_fast {
    suite!(Backend::EbpfFast);
}
