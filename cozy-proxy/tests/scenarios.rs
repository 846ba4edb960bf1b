//! The datapath scenario suite (tests/cases/README.md, 1-20, 38-43 and
//! 29-31, and 32: fuzzed frames; 21-28 are in cluster.rs): real
//! packets through the real kernel in network namespaces, with the real
//! `cozy-proxy` binary as controller. One list of scenarios; each backend
//! runs it for IPv4 and IPv6, on each node shape (routed veths, a bridge,
//! Kube-OVN's gateway, Kube-OVN's with its segment in the node), each
//! cell the scenarios whose code path it changes (tests/cases/README.md).
//! Needs root and the tools `cargo xtask setup` installs.
mod cases;
use cozy_proxy_testkit as harness;

use cases::*;
use harness::{nodes::net::Fam, nodes::topology::Shape, Backend, Env, SourceKind};

fn run(
    backend: Backend,
    source: SourceKind,
    shape: Shape,
    fam: Fam,
    scenario: fn(&mut Env) -> anyhow::Result<()>,
) {
    let mut env = match source {
        SourceKind::Manifests => Env::with_shape(backend, fam, shape),
        _ => Env::with_source(backend, source, fam),
    }
    .expect("topology");
    if let Err(e) = scenario(&mut env) {
        panic!("{e:#}\n--- controller log ---\n{}", env.ctl.log_text());
    }
}

/// The scenarios whose packets take a path the node's shape changes: all
/// but 15, 17, 19, 20, 41, 42 and 44 (given as `extra` where a cell runs
/// them). The first four and 44 end with an LB IP left unmapped or kept
/// by one Service, a decision of the model: their packets are dropped (or
/// translated as in the first scenario) where they enter the node, at its
/// uplink, before any pod-side interface, on every shape, and a warning is
/// said;
/// what the shape changes (the pod's port, the bridge, the router) they
/// never reach. 41's errors take the path of 11's, which every shape
/// runs; what it adds is the filter's and the ranges' decision about
/// them, which no shape changes. 42's forged sources are decided at the
/// uplink's hook, its quota where a translation is recorded; the in-cluster
/// clients' path on each shape is the cluster scenarios' (23, 25).
macro_rules! shaped_scenarios {
    (@with [$($extra:tt)*] $($head:tt)*) => {
        harness::datapath_suite!($($head)*;
            passthrough::s01_ping, passthrough::s02_any_port, passthrough::s03_other_protocol,
            passthrough::s04_egress_source, passthrough::s05_unmanaged_pod,
            passthrough::s06_conntrack_one_entry,
            filter::s07_listed_ports_pass, filter::s08_unlisted_ports_dropped,
            filter::s09_icmp_needs_allow, filter::s10_replies_to_own_flows,
            filter::s11_icmp_errors_reach_pod,
            changes::s12_mode_change, changes::s13_endpoint_moves,
            changes::s14_removal_restores_plain,
            changes::s16_restart_loses_nothing, changes::s40_pod_recreated_on_another_port,
            bad_input::s18_several_endpoints,
            security::s29_forged_sources_open_nothing, security::s30_source_ranges,
            security::s31_fail_closed_and_neighbour_discovery,
            security::s38_node_errors_quote_the_lb_ip,
            security::s39_reserved_addresses_stay_the_nodes,
            fuzzed::s32_fuzzed_frames $($extra)*);
    };
    ($($head:tt)*) => { shaped_scenarios!(@with [] $($head)*); };
}

/// Every scenario of the list: the routed shape runs them all, for each
/// datapath.
macro_rules! every_scenario {
    ($($head:tt)*) => {
        shaped_scenarios!(@with [
            , changes::s15_no_ready_endpoint, bad_input::s17_invalid_annotation,
            bad_input::s19_conflicts, bad_input::s20_hostname_and_invalid_ip,
            filter::s41_path_mtu_errors_reach_pod, security::s42_forged_cluster_clients_plant_nothing,
            bad_input::s44_endpoints_on_lb_ips
        ] $($head)*);
    };
}

/// The scenarios in which what the source reads changes or is wrong: the
/// Kubernetes source (watches, relists, its parsing of the objects) is on
/// their path; the others read one list at start, as from manifests.
macro_rules! source_scenarios {
    ($($head:tt)*) => {
        harness::datapath_suite!($($head)*;
            passthrough::s01_ping,
            changes::s12_mode_change, changes::s13_endpoint_moves,
            changes::s14_removal_restores_plain, changes::s15_no_ready_endpoint,
            changes::s16_restart_loses_nothing, changes::s40_pod_recreated_on_another_port,
            bad_input::s17_invalid_annotation, bad_input::s18_several_endpoints,
            bad_input::s19_conflicts, bad_input::s20_hostname_and_invalid_ip);
    };
}

mod nft {
    use super::*;
    every_scenario!(run(Backend::Nft, SourceKind::Manifests, Shape::Routed));
}

mod ebpf {
    use super::*;
    every_scenario!(run(Backend::Ebpf, SourceKind::Manifests, Shape::Routed));
}

/// The eBPF backend with its fast path on: the same scenarios, the same
/// outcomes (LB traffic from and to the outside then skips the stack).
mod ebpf_fast {
    use super::*;
    every_scenario!(run(Backend::EbpfFast, SourceKind::Manifests, Shape::Routed));
}

/// The XDP path: the fast path from the XDP program on the uplink into
/// pods whose interfaces take XDP frames; the same outcomes.
mod ebpf_xdp {
    use super::*;
    every_scenario!(run(Backend::EbpfXdp, SourceKind::Manifests, Shape::Routed));
}

/// The same scenarios through the Kubernetes source: the real kube-rs
/// client against the API stand-in.
mod kube_nft {
    use super::*;
    source_scenarios!(run(Backend::Nft, SourceKind::Kube, Shape::Routed));
}

/// Pods as ports of a Linux bridge that holds their gateway, br_netfilter
/// on (the bridge plugin, Flannel, kindnet).
mod bridge {
    use super::*;
    shaped_scenarios!(@with [, security::s43_forged_neighbour_claims_move_no_guard]
        @datapaths run(SourceKind::Manifests, Shape::Bridge));
}

/// Kube-OVN's shape: the pods behind a router the node reaches through
/// its `ovn0` on a join network.
mod gateway {
    use super::*;
    shaped_scenarios!(@datapaths run(SourceKind::Manifests, Shape::Gateway));
}

/// Kube-OVN's shape with the pods' segment a Linux bridge in the node's
/// own namespace (their ports the node's, as Kube-OVN's are), the router's
/// leg one of its ports, bridge-nf-call-iptables off.
mod node_segment {
    use super::*;
    shaped_scenarios!(@datapaths run(SourceKind::Manifests, Shape::NodeSegment));
}
