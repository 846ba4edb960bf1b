//! Unit and property tests of the desired-state model.
use super::*;
use crate::fixtures::{Slice, Svc};
use k8s_openapi::api::{
    core::v1::Service,
    discovery::v1::{Endpoint, EndpointConditions, EndpointSlice},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proptest::prelude::*;
/// No EndpointSlices (typed, for `compute_plan`).
const NO_SLICES: &[EndpointSlice] = &[];

use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

/// Service `name` of namespace `ns` on 203.0.113.10: labelled,
/// passthrough, no ports.
fn svc(name: &str) -> Svc {
    Svc::new(name, "203.0.113.10").in_namespace("ns")
}

/// [`svc`] `vm`.
fn vm() -> Svc {
    svc("vm")
}

/// A slice of `svc` in namespace `ns`, named after its family and size.
fn slice(svc: &str, family: &str, endpoints: &[(&str, Option<bool>)]) -> EndpointSlice {
    Slice::new(svc, family, endpoints)
        .named(&format!("{svc}-{family}-{}", endpoints.len()))
        .in_namespace("ns")
        .object()
}

/// A passthrough Service on 203.0.113.10 created at `secs`.
fn aged(name: &str, secs: i64) -> Service {
    svc(name).created_at(secs).object()
}

fn kinds(o: &Outcome) -> Vec<WarningKind> {
    o.warnings.iter().map(|w| w.kind).collect()
}

#[test]
fn selection_by_label_or_annotation_only() {
    let labelled = vm().object();
    let annotated = vm()
        .labelled(false)
        .annotate(WHOLE_IP_ANNOTATION, "true")
        .object();
    let neither = vm().labelled(false).object();
    assert!(is_selected(&labelled));
    assert!(is_selected(&annotated));
    assert!(!is_selected(&neither));
    let mut other_proxy = vm().object();
    other_proxy.metadata.labels = Some([(PROXY_NAME_LABEL.into(), "kube-proxy".into())].into());
    assert!(!is_selected(&other_proxy));
}

#[test]
fn passthrough_mapping_both_families() {
    let svc = vm().lb_ips(&["203.0.113.10", "2001:db8:203::10"]).object();
    let slices = [
        slice("vm", "IPv4", &[("192.0.2.11", None)]),
        slice("vm", "IPv6", &[("2001:db8:2::11", Some(true))]),
    ];
    let o = compute_plan(&[svc], &slices, &[]);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    let pairs: Vec<(IpAddr, IpAddr, Mode)> = o
        .plan
        .mappings
        .iter()
        .map(|m| (m.lb_ip, m.pod_ip, (*m.mode).clone()))
        .collect();
    assert_eq!(
        pairs,
        vec![
            (ip("203.0.113.10"), ip("192.0.2.11"), Mode::Passthrough),
            (
                ip("2001:db8:203::10"),
                ip("2001:db8:2::11"),
                Mode::Passthrough
            ),
        ]
    );
}

#[test]
fn port_filter_modes_and_fail_closed() {
    let ports: &[(&str, i32)] = &[
        ("TCP", 22),
        ("UDP", 53),
        ("SCTP", 9),
        ("QUIC", 443),
        ("TCP", 70000),
    ];
    let case = |whole: &'static str, icmp: &'static str| {
        let ann: Vec<(&str, &str)> = [(WHOLE_IP_ANNOTATION, whole), (ALLOW_ICMP_ANNOTATION, icmp)]
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .collect();
        let svc = ann
            .iter()
            .fold(vm(), |s, (k, v)| s.annotate(k, v))
            .ports(ports)
            .object();
        compute_plan(&[svc], &[slice("vm", "IPv4", &[("192.0.2.11", None)])], &[])
    };
    let want_ports = [
        PortRule {
            protocol: Protocol::Tcp,
            port: 22,
        },
        PortRule {
            protocol: Protocol::Udp,
            port: 53,
        },
        PortRule {
            protocol: Protocol::Sctp,
            port: 9,
        },
    ]
    .into_iter()
    .collect();
    let o = case("false", "true");
    assert_eq!(
        *o.plan.mappings[0].mode,
        Mode::PortFilter {
            ports: want_ports,
            allow_icmp: true
        }
    );
    assert_eq!(
        kinds(&o),
        vec![WarningKind::InvalidPort, WarningKind::InvalidPort]
    );
    assert_eq!(*case("true", "").plan.mappings[0].mode, Mode::Passthrough);
    assert_eq!(*case("", "").plan.mappings[0].mode, Mode::Passthrough);
    // Invalid values: warning, port filter, ICMP not allowed.
    let o = case("yes", "maybe");
    assert!(matches!(
        &*o.plan.mappings[0].mode,
        Mode::PortFilter { allow_icmp: false, ports } if ports.len() == 3
    ));
    let invalid: Vec<&Warning> = o
        .warnings
        .iter()
        .filter(|w| w.kind == WarningKind::InvalidAnnotation)
        .collect();
    assert_eq!(invalid.len(), 2, "{:?}", o.warnings);
    assert!(invalid
        .iter()
        .any(|w| w.message.contains("wholeIP=\"yes\"")));
    assert!(invalid
        .iter()
        .any(|w| w.message.contains("allowICMP=\"maybe\"")));
}

#[test]
fn endpoints_none_several_not_ready() {
    let svc = || vm().object();
    // Unset ready counts as ready; ready=false does not count.
    let o = compute_plan(
        &[svc()],
        &[slice(
            "vm",
            "IPv4",
            &[("192.0.2.11", None), ("192.0.2.12", Some(false))],
        )],
        &[],
    );
    assert_eq!(o.plan.mappings.len(), 1);
    assert_eq!(o.plan.mappings[0].pod_ip, ip("192.0.2.11"));
    // None ready: unmapped, reported, dropped.
    let o = compute_plan(
        &[svc()],
        &[slice("vm", "IPv4", &[("192.0.2.11", Some(false))])],
        &[],
    );
    assert!(o.plan.mappings.is_empty());
    assert_eq!(kinds(&o), vec![WarningKind::NoReadyEndpoint]);
    assert!(o.plan.unmapped_lb_ips.contains_key(&ip("203.0.113.10")));
    // Several distinct: not mapped, named. The same address in two slices
    // is one endpoint.
    let o = compute_plan(
        &[svc()],
        &[
            slice("vm", "IPv4", &[("192.0.2.11", None), ("192.0.2.12", None)]),
            slice("vm", "IPv4", &[("192.0.2.11", Some(true))]),
        ],
        &[],
    );
    assert!(o.plan.mappings.is_empty());
    assert_eq!(kinds(&o), vec![WarningKind::MultipleEndpoints]);
    assert!(o.warnings[0].message.contains("192.0.2.11, 192.0.2.12"));
    let o = compute_plan(
        &[svc()],
        &[
            slice("vm", "IPv4", &[("192.0.2.11", None)]),
            slice("vm", "IPv4", &[("192.0.2.11", None)]),
        ],
        &[],
    );
    assert_eq!(o.plan.mappings.len(), 1);
    // A slice of another Service or namespace does not count.
    let mut foreign = slice("vm", "IPv4", &[("192.0.2.99", None)]);
    foreign.metadata.namespace = Some("elsewhere".into());
    let o = compute_plan(
        &[svc()],
        &[foreign, slice("other", "IPv4", &[("192.0.2.98", None)])],
        &[],
    );
    assert_eq!(kinds(&o), vec![WarningKind::NoReadyEndpoint]);
}

/// A slice of one endpoint per `(address, ready, serving, terminating)`.
fn slice_with(svc: &str, endpoints: &[(&str, bool, bool, bool)]) -> EndpointSlice {
    let mut s = slice(svc, "IPv4", &[]);
    s.metadata.name = Some(format!("{svc}-conditions"));
    s.endpoints = endpoints
        .iter()
        .map(|(a, ready, serving, terminating)| Endpoint {
            addresses: vec![a.to_string()],
            conditions: Some(EndpointConditions {
                ready: Some(*ready),
                serving: Some(*serving),
                terminating: Some(*terminating),
            }),
            ..Default::default()
        })
        .collect();
    s
}

/// As kube-proxy: an endpoint serving while it terminates keeps the
/// Service while no endpoint is ready, and gives way to a ready one.
#[test]
fn a_serving_terminating_endpoint_serves_while_nothing_is_ready() {
    let svc = || vm().object();
    let plan = |e: &[(&str, bool, bool, bool)]| compute_plan(&[svc()], &[slice_with("vm", e)], &[]);
    let o = plan(&[("192.0.2.11", false, true, true)]);
    assert_eq!(o.plan.mappings.len(), 1, "{:?}", o.warnings);
    assert_eq!(o.plan.mappings[0].pod_ip, ip("192.0.2.11"));
    // A ready one replaces it: one backend, no conflict.
    let o = plan(&[
        ("192.0.2.11", false, true, true),
        ("192.0.2.12", true, true, false),
    ]);
    assert_eq!(o.plan.mappings.len(), 1, "{:?}", o.warnings);
    assert_eq!(o.plan.mappings[0].pod_ip, ip("192.0.2.12"));
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    // Terminating and no longer serving, or not ready and not terminating
    // (starting): nothing.
    for e in [
        ("192.0.2.11", false, false, true),
        ("192.0.2.11", false, true, false),
    ] {
        let o = plan(&[e]);
        assert!(o.plan.mappings.is_empty(), "{e:?}");
        assert_eq!(kinds(&o), vec![WarningKind::NoReadyEndpoint]);
    }
}

/// A live migration's endpoints (KubeVirt's virt-launcher pods): the
/// source S and the target T hold the VM's one IP. One backend on both
/// nodes, never `MultipleEndpoints`: the target's node is a host from the
/// moment its endpoint exists, even not ready; the source's once it
/// terminates and stops serving is not. Two different addresses remain
/// several endpoints.
#[test]
fn one_address_on_two_nodes_is_one_backend_hosted_on_both() {
    let svc = || vm().object();
    let vm = "192.0.2.20";
    // (ready, serving, terminating) of S on node-a and T on node-b.
    type Conds = (bool, bool, bool);
    let plan = |s: Option<Conds>, t: Option<Conds>| {
        let mut slice = slice_with("vm", &[]);
        for (node, conds) in [("node-a", s), ("node-b", t)] {
            let Some((ready, serving, terminating)) = conds else {
                continue;
            };
            slice.endpoints.push(Endpoint {
                addresses: vec![vm.into()],
                node_name: Some(node.into()),
                conditions: Some(EndpointConditions {
                    ready: Some(ready),
                    serving: Some(serving),
                    terminating: Some(terminating),
                }),
                ..Default::default()
            });
        }
        compute_plan(&[svc()], &[slice], &[])
    };
    let hosts = |o: &Outcome| -> Vec<String> {
        assert!(o.warnings.is_empty(), "{:?}", o.warnings);
        assert_eq!(o.plan.mappings.len(), 1);
        assert_eq!(o.plan.mappings[0].pod_ip, ip(vm));
        (o.plan.mappings[0].hosts.nodes().iter())
            .map(|n| n.to_string())
            .collect()
    };
    let (ready, starting, gone) = (
        (true, true, false),
        (false, false, false),
        (false, false, true),
    );
    // W0: S alone.
    assert_eq!(hosts(&plan(Some(ready), None)), ["node-a"]);
    // W1, W2: T exists, not ready; S's node is where others steer.
    assert_eq!(
        hosts(&plan(Some(ready), Some(starting))),
        ["node-a", "node-b"]
    );
    // W3: both ready.
    assert_eq!(hosts(&plan(Some(ready), Some(ready))), ["node-a", "node-b"]);
    // W4: S terminating, no longer serving; then gone.
    assert_eq!(hosts(&plan(Some(gone), Some(ready))), ["node-b"]);
    assert_eq!(hosts(&plan(None, Some(ready))), ["node-b"]);
    // A starting endpoint is never a backend by itself.
    let o = plan(None, Some(starting));
    assert!(o.plan.mappings.is_empty());
    assert_eq!(kinds(&o), vec![WarningKind::NoReadyEndpoint]);
    // Two addresses: several endpoints, as before.
    let mut two = slice_with(
        "vm",
        &[(vm, true, true, false), ("192.0.2.21", true, true, false)],
    );
    two.endpoints[1].node_name = Some("node-b".into());
    let o = compute_plan(&[svc()], &[two], &[]);
    assert_eq!(kinds(&o), vec![WarningKind::MultipleEndpoints]);
}

#[test]
fn conflicts_older_wins_and_hands_over() {
    let (a, b) = (aged("a", 1_000), aged("b", 2_000));
    let slices = [
        slice("a", "IPv4", &[("192.0.2.11", None)]),
        slice("b", "IPv4", &[("192.0.2.13", None)]),
    ];
    let o = compute_plan(&[b.clone(), a.clone()], &slices, &[]);
    assert_eq!(o.plan.mappings.len(), 1);
    assert_eq!(&*o.plan.mappings[0].service.name, "a");
    assert_eq!(kinds(&o), vec![WarningKind::LoadBalancerIpConflict]);
    assert_eq!(&*o.warnings[0].service.name, "b");
    // Deleting the older hands the IP over.
    let o = compute_plan(&[b], &slices, &[]);
    assert_eq!(&*o.plan.mappings[0].service.name, "b");
    // Same pod, different LB IPs: the newer's LB IP is unmapped (dropped).
    let c = svc("c")
        .created_at(1_000)
        .lb_ips(&["203.0.113.20"])
        .object();
    let d = svc("d")
        .created_at(2_000)
        .lb_ips(&["203.0.113.30"])
        .object();
    let slices = [
        slice("c", "IPv4", &[("192.0.2.12", None)]),
        slice("d", "IPv4", &[("192.0.2.12", None)]),
    ];
    let o = compute_plan(&[d, c], &slices, &[]);
    assert_eq!(o.plan.mappings.len(), 1);
    assert_eq!(&*o.plan.mappings[0].service.name, "c");
    assert_eq!(kinds(&o), vec![WarningKind::PodIpConflict]);
    assert!(o.plan.unmapped_lb_ips.contains_key(&ip("203.0.113.30")));
    // Equal age: namespace/name decides.
    let e = svc("e").object();
    let f = svc("f").object();
    let o = compute_plan(
        &[f, e],
        &[
            slice("e", "IPv4", &[("192.0.2.11", None)]),
            slice("f", "IPv4", &[("192.0.2.11", None)]),
        ],
        &[],
    );
    assert_eq!(&*o.plan.mappings[0].service.name, "e");
}

#[test]
fn the_older_owner_keeps_its_lb_ip_while_not_ready() {
    let (a, b) = (aged("a", 1_000), aged("b", 2_000));
    let slices = [
        slice("a", "IPv4", &[("192.0.2.11", Some(false))]),
        slice("b", "IPv4", &[("192.0.2.13", None)]),
    ];
    let o = compute_plan(&[a, b], &slices, &[]);
    assert!(o.plan.mappings.is_empty());
    assert!(o.plan.unmapped_lb_ips.contains_key(&ip("203.0.113.10")));
    assert_eq!(
        kinds(&o),
        vec![
            WarningKind::NoReadyEndpoint,
            WarningKind::LoadBalancerIpConflict
        ]
    );
}

#[test]
fn bad_addresses_hostnames_and_extra_ips() {
    let svc = vm()
        .lb_ips(&["203.0.113.300", "203.0.113.10", "203.0.113.11"])
        .hostname("lb.example.com")
        .object();
    let o = compute_plan(
        &[svc],
        &[slice(
            "vm",
            "IPv4",
            &[("not-an-ip", None), ("192.0.2.11", None)],
        )],
        &[],
    );
    assert_eq!(o.plan.mappings.len(), 1);
    assert_eq!(o.plan.mappings[0].lb_ip, ip("203.0.113.10"));
    assert_eq!(
        kinds(&o),
        vec![
            WarningKind::InvalidIp,
            WarningKind::InvalidIp,
            WarningKind::ExtraLoadBalancerIp
        ]
    );
    let only_host = vm().lb_ips(&[]).hostname("lb.example.com").object();
    assert_eq!(
        kinds(&compute_plan(&[only_host], NO_SLICES, &[])),
        vec![WarningKind::HostnameOnly]
    );
    let pending = vm().lb_ips(&[]).object();
    assert_eq!(
        kinds(&compute_plan(&[pending], NO_SLICES, &[])),
        vec![WarningKind::NoLoadBalancerIp]
    );
}

/// A Node named `name` with these addresses.
fn node(name: &str, addresses: &[&str]) -> k8s_openapi::api::core::v1::Node {
    use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        status: Some(NodeStatus {
            addresses: Some(
                addresses
                    .iter()
                    .map(|a| NodeAddress {
                        address: a.to_string(),
                        type_: "InternalIP".into(),
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn forbidden_addresses_are_refused_and_never_mapped() {
    let nodes = [node("node1", &["198.51.100.2", "2001:db8:100::2"])];
    // As an LB IP: each is refused, with the reason, and nothing is mapped.
    for (bad, why) in [
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("224.0.0.1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("ff02::1", "multicast"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("198.51.100.2", "node's own"),
        ("2001:db8:100::2", "node's own"),
    ] {
        let svc = vm().lb_ips(&[bad]).object();
        let family = if bad.contains(':') { "IPv6" } else { "IPv4" };
        let pod = if bad.contains(':') {
            "2001:db8:2::11"
        } else {
            "192.0.2.11"
        };
        let o = compute_plan(&[svc], &[slice("vm", family, &[(pod, None)])], &nodes);
        assert!(o.plan.mappings.is_empty(), "LB IP {bad} mapped");
        assert_eq!(
            kinds(&o),
            vec![WarningKind::ForbiddenAddress],
            "LB IP {bad}"
        );
        assert!(
            o.warnings[0].message.contains(why),
            "{bad}: {}",
            o.warnings[0].message
        );
    }
    // As an endpoint address: the same, and the LB IP stays unmapped.
    for bad in ["127.0.0.1", "169.254.1.1", "198.51.100.2", "0.0.0.0"] {
        let o = compute_plan(
            &[vm().object()],
            &[slice("vm", "IPv4", &[(bad, None)])],
            &nodes,
        );
        assert!(o.plan.mappings.is_empty(), "endpoint {bad} mapped");
        assert!(
            kinds(&o).contains(&WarningKind::ForbiddenAddress),
            "endpoint {bad}"
        );
    }
    // A valid neighbour is mapped: the refusal is not blanket.
    let o = compute_plan(
        &[vm().object()],
        &[slice("vm", "IPv4", &[("192.0.2.11", None)])],
        &nodes,
    );
    assert_eq!(o.plan.mappings.len(), 1);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
}

/// `--reserved-cidrs` (node VIPs): a Service on a reserved address is
/// refused as a node's own address is, by the full computation and the
/// incremental state alike; an address beside the range is mapped.
#[test]
fn reserved_ranges_are_refused_as_node_addresses_are() {
    let cidr = |s: &str| s.parse::<Cidr>().expect("test constant");
    let forbidden = Forbidden::new(&[], &[cidr("203.0.113.8/30"), cidr("2001:db8:203::10/128")]);
    for (lb, family, pod, refused) in [
        ("203.0.113.10", "IPv4", "192.0.2.11", true),
        ("203.0.113.12", "IPv4", "192.0.2.11", false),
        ("2001:db8:203::10", "IPv6", "2001:db8:2::11", true),
        ("2001:db8:203::11", "IPv6", "2001:db8:2::11", false),
    ] {
        let services = [vm().lb_ips(&[lb]).object()];
        let slices = [slice("vm", family, &[(pod, None)])];
        let full = compute_plan_with(&services, &slices, &forbidden);
        let incremental =
            PlanState::build_forbidding(&services, &slices, &[], forbidden.clone()).outcome();
        assert_eq!(full, incremental, "{lb}");
        if refused {
            assert!(full.plan.mappings.is_empty(), "{lb} mapped");
            assert_eq!(kinds(&full), vec![WarningKind::ForbiddenAddress], "{lb}");
            assert!(
                full.warnings[0].message.contains("reserved"),
                "{lb}: {:?}",
                full.warnings
            );
        } else {
            assert_eq!(full.plan.mappings.len(), 1, "{lb}");
        }
    }
    // As an endpoint address too.
    let o = compute_plan_with(
        &[vm().object()],
        &[slice("vm", "IPv4", &[("203.0.113.9", None)])],
        &forbidden,
    );
    assert!(o.plan.mappings.is_empty(), "a reserved endpoint mapped");
    assert!(kinds(&o).contains(&WarningKind::ForbiddenAddress));
}

/// A ClusterIP (an address of a ServiceCIDR) is never a Service's pod: an
/// endpoint on one is refused, an endpoint beside the range is mapped.
#[test]
fn an_endpoint_in_a_service_cidr_is_refused() {
    use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
    let cidrs = [ServiceCIDR {
        spec: Some(ServiceCIDRSpec {
            cidrs: Some(vec!["198.51.100.0/28".into(), "not a range".into()]),
        }),
        ..Default::default()
    }];
    let forbidden = Forbidden::new(&[], &[]).with_service_cidrs(&cidrs);
    for (pod, refused) in [("198.51.100.10", true), ("198.51.100.20", false)] {
        let services = [vm().object()];
        let slices = [slice("vm", "IPv4", &[(pod, None)])];
        let o = compute_plan_with(&services, &slices, &forbidden);
        assert_eq!(o.plan.mappings.is_empty(), refused, "{pod}: {:?}", o.plan);
        if refused {
            assert_eq!(kinds(&o), vec![WarningKind::ForbiddenAddress], "{pod}");
            assert!(
                o.warnings[0].message.contains("ServiceCIDR"),
                "{:?}",
                o.warnings
            );
        }
    }
}

#[test]
fn source_ranges_are_read_and_an_invalid_one_fails_closed() {
    let with_ranges = |ranges: &[&str]| {
        let svc = vm().source_ranges(ranges).object();
        compute_plan(&[svc], &[slice("vm", "IPv4", &[("192.0.2.11", None)])], &[])
    };
    let cidr = |s: &str| s.parse::<Cidr>().expect("test constant");
    let o = with_ranges(&["198.51.100.0/25", "2001:db8:100::/120"]);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    // Each family's mapping holds its family's ranges.
    assert_eq!(
        o.plan.mappings[0].source_ranges,
        Some([cidr("198.51.100.0/25")].into())
    );
    // A list of IPv6 ranges only lets no IPv4 client in (as Kubernetes
    // reads the list: it names who may connect).
    assert_eq!(
        with_ranges(&["2001:db8:100::/120"]).plan.mappings[0].source_ranges,
        Some(Default::default())
    );
    // A bare address is read as a single-host range (the API server
    // rejects it; a manifest source may not).
    assert_eq!(
        with_ranges(&["198.51.100.7"]).plan.mappings[0].source_ranges,
        Some([cidr("198.51.100.7/32")].into())
    );
    // An empty list means no restriction, as in Kubernetes.
    assert_eq!(with_ranges(&[]).plan.mappings[0].source_ranges, None);
    // One bad entry: a warning, and the mapping keeps an empty allow list
    // (nothing reaches the pod through the LB IP), not "no restriction".
    for bad in [
        "not-a-range",
        "198.51.100.0/33",
        "198.51.100.0/",
        "2001:db8::/129",
    ] {
        let o = with_ranges(&["198.51.100.0/25", bad]);
        assert_eq!(kinds(&o), vec![WarningKind::InvalidSourceRange], "{bad}");
        assert_eq!(
            o.plan.mappings[0].source_ranges,
            Some(Default::default()),
            "{bad}"
        );
    }
}

#[test]
fn a_service_with_thousands_of_entries_is_capped_and_warned_a_bounded_number_of_times() {
    use super::service::{MAX_PORTS_PER_SERVICE, MAX_SOURCE_RANGES_PER_SERVICE};
    use super::warning::MAX_WARNINGS_PER_KIND;
    // 3 000 bad ports then 6 000 good ones (TCP 1..=6000), 2 000 source
    // ranges, 3 000 LB IPs and 3 000 invalid ones.
    let mut ports: Vec<(&str, i32)> = (1..=3000).map(|p| ("FOO", p)).collect();
    ports.extend((1..=6000).map(|p| ("TCP", p)));
    let lbs: Vec<String> = (0..3000u32)
        .map(|i| format!("2001:db8:200::{i:x}"))
        .chain((0..3000).map(|i| format!("bad-{i}")))
        .collect();
    let lb_refs: Vec<&str> = std::iter::once("203.0.113.10")
        .chain(lbs.iter().map(String::as_str))
        .collect();
    let ranges: Vec<String> = (0..2000u32)
        .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
        .collect();
    let range_refs: Vec<&str> = ranges.iter().map(String::as_str).collect();
    let svc = vm()
        .annotate(WHOLE_IP_ANNOTATION, "false")
        .lb_ips(&lb_refs)
        .ports(&ports)
        .source_ranges(&range_refs)
        .object();
    let o = compute_plan(
        &[svc],
        &[
            slice("vm", "IPv4", &[("192.0.2.11", None)]),
            slice("vm", "IPv6", &[("2001:db8:1::11", None)]),
        ],
        &[],
    );
    let v4 = o
        .plan
        .mappings
        .iter()
        .find(|m| m.lb_ip == ip("203.0.113.10"))
        .expect("the IPv4 mapping");
    let Mode::PortFilter { ports, .. } = &*v4.mode else {
        panic!("port filter expected: {:?}", v4.mode);
    };
    // The first ports in spec order: 1..=4096.
    assert_eq!(ports.len(), MAX_PORTS_PER_SERVICE);
    assert_eq!(ports.iter().map(|p| p.port).max(), Some(4096));
    let ranges = v4.source_ranges.as_ref().expect("ranges");
    assert_eq!(ranges.len(), MAX_SOURCE_RANGES_PER_SERVICE);
    let count = |k: WarningKind| o.warnings.iter().filter(|w| w.kind == k).count();
    assert_eq!(count(WarningKind::TooManyEntries), 2, "{:?}", kinds(&o));
    // Thousands of bad entries: the first few listed, then one line.
    assert_eq!(count(WarningKind::InvalidPort), MAX_WARNINGS_PER_KIND + 1);
    assert_eq!(count(WarningKind::InvalidIp), MAX_WARNINGS_PER_KIND + 1);
    let extra: Vec<&Warning> = o
        .warnings
        .iter()
        .filter(|w| w.kind == WarningKind::ExtraLoadBalancerIp)
        .collect();
    assert_eq!(extra.len(), 1);
    assert!(
        extra[0].message.contains("and 2991 more"),
        "{}",
        extra[0].message
    );
    assert!(extra[0].message.len() < 1000);
}

#[test]
fn a_broken_object_without_name_or_status_does_not_panic() {
    let empty = Service {
        metadata: ObjectMeta {
            labels: Some([(PROXY_NAME_LABEL.into(), PROXY_NAME.into())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let o = compute_plan(&[empty], &[EndpointSlice::default()], &[]);
    assert!(o.plan.mappings.is_empty());
    assert_eq!(kinds(&o), vec![WarningKind::NoLoadBalancerIp]);
}

// ---- property tests ----

const LBS: [&str; 4] = ["203.0.113.1", "203.0.113.2", "2001:db8:203::1", "bogus"];
/// The last but one is an LB IP too: never a pod.
const PODS: [&str; 6] = [
    "192.0.2.1",
    "192.0.2.2",
    "2001:db8:2::1",
    "2001:db8:2::2",
    "203.0.113.2",
    "x",
];
const WHOLE: [&str; 4] = ["", "true", "false", "garbage"];
const ICMP: [&str; 3] = ["", "true", "false"];
/// loadBalancerSourceRanges: none, one range per family, several (one of
/// them invalid: the Service fails closed).
const RANGES: [&[&str]; 4] = [
    &[],
    &["198.51.100.0/24", "2001:db8:100::/120"],
    &["198.51.100.7", "198.51.100.64/26", "2001:db8:100::1"],
    &["198.51.100.0/24", "not-a-range"],
];

pub(crate) fn arb_world() -> impl Strategy<Value = (Vec<Service>, Vec<EndpointSlice>)> {
    let spec = (
        0usize..6,                                  // name
        any::<bool>(),                              // label
        0usize..4,                                  // wholeIP
        proptest::collection::vec(0usize..4, 0..3), // LB IPs
        proptest::option::of(0i64..4),              // creation time
        proptest::collection::vec(
            (0usize..PODS.len(), proptest::option::of(any::<bool>())),
            0..3,
        ), // endpoints
        (0usize..3, 0usize..4),                     // allowICMP, source ranges
    );
    proptest::collection::vec(spec, 0..8).prop_map(|specs| {
        let mut services = Vec::new();
        let mut slices = Vec::new();
        for (name, label, whole, lbs, created, eps, (icmp, ranges)) in specs {
            let name = format!("s{name}");
            let lb: Vec<&str> = lbs.iter().map(|i| LBS[*i]).collect();
            let ann: Vec<(&str, &str)> = [
                (WHOLE_IP_ANNOTATION, WHOLE[whole]),
                (ALLOW_ICMP_ANNOTATION, ICMP[icmp]),
            ]
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .collect();
            let s = (ann.iter())
                .fold(svc(&name), |s, (k, v)| s.annotate(k, v))
                .labelled(label)
                .lb_ips(&lb)
                .ports(&[("TCP", 22)])
                .source_ranges(RANGES[ranges]);
            let s = match created {
                Some(secs) => s.created_at(secs),
                None => s,
            };
            services.push(s.object());
            let eps: Vec<(&str, Option<bool>)> = eps.iter().map(|(p, r)| (PODS[*p], *r)).collect();
            for family in ["IPv4", "IPv6"] {
                let mut s = slice(&name, family, &eps);
                // Every other not-ready endpoint serving while it
                // terminates: used while none is ready.
                for (i, e) in s.endpoints.iter_mut().enumerate() {
                    // Some on one node, some on another, some on none:
                    // an address may be held on two nodes (a migration).
                    e.node_name = ["a", "b", ""][(i + name.len()) % 3]
                        .parse::<String>()
                        .ok()
                        .filter(|n| !n.is_empty());
                    if let Some(c) = e.conditions.as_mut().filter(|c| c.ready == Some(false)) {
                        if i % 2 == 0 {
                            c.serving = Some(true);
                            c.terminating = Some(true);
                        }
                    }
                }
                slices.push(s);
            }
        }
        (services, slices)
    })
}

proptest! {
    #[test]
    fn plan_is_independent_of_input_order(
        (services, slices) in arb_world(),
        seed in any::<u64>(),
    ) {
        let a = compute_plan(&services, &slices, &[]);
        let mut s2 = services.clone();
        let mut e2 = slices.clone();
        // A deterministic shuffle from the seed.
        let n = s2.len().max(1) as u64;
        s2.rotate_left((seed % n) as usize);
        s2.reverse();
        let m = e2.len().max(1) as u64;
        e2.rotate_left(((seed >> 8) % m) as usize);
        e2.reverse();
        let b = compute_plan(&s2, &e2, &[]);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn plan_is_one_to_one((services, slices) in arb_world()) {
        let o = compute_plan(&services, &slices, &[]);
        let mut lbs = std::collections::HashSet::new();
        let mut pods = std::collections::HashSet::new();
        for m in &o.plan.mappings {
            prop_assert!(lbs.insert(m.lb_ip), "LB IP {} twice", m.lb_ip);
            prop_assert!(pods.insert(m.pod_ip), "pod IP {} twice", m.pod_ip);
            prop_assert_eq!(m.lb_ip.is_ipv4(), m.pod_ip.is_ipv4());
            prop_assert!(!o.plan.unmapped_lb_ips.contains_key(&m.lb_ip));
        }
    }

    #[test]
    fn arbitrary_strings_never_panic(
        whole in ".{0,12}",
        icmp in ".{0,12}",
        lb in ".{0,40}",
        addr in ".{0,40}",
        port in any::<i32>(),
        proto in ".{0,6}",
    ) {
        let svc = vm()
            .annotate(WHOLE_IP_ANNOTATION, &whole)
            .annotate(ALLOW_ICMP_ANNOTATION, &icmp)
            .lb_ips(&[&lb])
            .ports(&[(&proto, port)])
            .object();
        let _ = compute_plan(&[svc], &[slice("vm", "IPv4", &[(&addr, None)])], &[]);
    }
}

/// The objects of Service `name` in a world: its Service objects and the
/// slices labelled with its name.
pub(crate) fn objects_of<'a, S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    name: &str,
    services: &'a [S],
    slices: &'a [E],
) -> (Vec<&'a Service>, Vec<&'a EndpointSlice>) {
    let svcs = services
        .iter()
        .map(Borrow::borrow)
        .filter(|s| s.metadata.name.as_deref() == Some(name))
        .collect();
    let owned = slices
        .iter()
        .map(Borrow::borrow)
        .filter(|e| {
            e.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .map(String::as_str)
                == Some(name)
        })
        .collect();
    (svcs, owned)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// After any sequence of worlds, each given to the incremental state
    /// only for the Services whose objects changed, it holds what the full
    /// computation gives, and the changes it reported turn the previous
    /// outcome into the new one (results and warnings alike).
    #[test]
    fn incremental_plan_equals_the_full_computation(
        worlds in proptest::collection::vec(arb_world(), 1..8),
    ) {
        let mut state = PlanState::default();
        let mut results: BTreeMap<std::net::IpAddr, LbResult> = BTreeMap::new();
        let mut warnings: BTreeSet<Warning> = BTreeSet::new();
        let (mut before_s, mut before_e): (Vec<Service>, Vec<EndpointSlice>) = (vec![], vec![]);
        for (services, slices) in worlds {
            for i in 0..6 {
                let name = format!("s{i}");
                let now = objects_of(&name, &services, &slices);
                if now != objects_of(&name, &before_s, &before_e) {
                    state.update(&ServiceRef::new("ns", name.as_str()), &now.0, &now.1);
                }
            }
            let full = compute_plan(&services, &slices, &[]);
            prop_assert_eq!(&state.outcome(), &full);
            for c in state.take_changes() {
                prop_assert_eq!(results.get(&c.lb_ip), c.old.as_ref());
                match c.new {
                    Some(r) => results.insert(c.lb_ip, r),
                    None => results.remove(&c.lb_ip),
                };
            }
            let rebuilt: BTreeMap<_, _> = state.results().collect();
            prop_assert_eq!(&results, &rebuilt);
            let (appeared, gone) = state.take_warning_changes();
            for w in gone {
                prop_assert!(warnings.remove(&w));
            }
            for w in appeared {
                prop_assert!(warnings.insert(w));
            }
            prop_assert_eq!(warnings.iter().cloned().collect::<Vec<_>>(), full.warnings.clone());
            let s = state.summary();
            let filtered = full
                .plan
                .mappings
                .iter()
                .filter(|m| matches!(*m.mode, Mode::PortFilter { .. }))
                .count();
            prop_assert_eq!(s.port_filter, filtered);
            prop_assert_eq!(s.passthrough, full.plan.mappings.len() - filtered);
            prop_assert_eq!(s.unmapped, full.plan.unmapped_lb_ips.len());
            let mut kinds: BTreeMap<WarningKind, usize> = BTreeMap::new();
            for w in &full.warnings {
                *kinds.entry(w.kind).or_default() += 1;
            }
            let counted: BTreeMap<WarningKind, usize> =
                s.warnings.iter().filter(|(_, n)| **n > 0).map(|(k, n)| (*k, *n)).collect();
            prop_assert_eq!(counted, kinds);
            prop_assert_eq!(
                &PlanState::build(&services, &slices, &[]).outcome(),
                &full
            );
            (before_s, before_e) = (services, slices);
        }
    }
}

proptest! {
    /// Trimmed as they arrive from the API, the objects give the same plan.
    #[test]
    fn trimmed_objects_give_the_same_plan((services, slices) in arb_world()) {
        let full = compute_plan(&services, &slices, &[]);
        let mut s2 = services.clone();
        s2.iter_mut().for_each(trim::trim_service);
        let mut e2 = slices.clone();
        e2.iter_mut().for_each(trim::trim_slice);
        prop_assert_eq!(compute_plan(&s2, &e2, &[]), full);
    }
}

#[test]
fn a_trimmed_node_keeps_its_addresses_and_pod_networks() {
    use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus};
    let node = Node {
        metadata: ObjectMeta {
            name: Some("n1".into()),
            annotations: Some([("big".to_string(), "x".repeat(4096))].into()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidrs: Some(vec!["192.0.2.0/25".into(), "2001:db8:42::/64".into()]),
            provider_id: Some("metal://1".into()),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                address: "198.51.100.7".into(),
                type_: "InternalIP".into(),
            }]),
            ..Default::default()
        }),
    };
    let mut trimmed = node.clone();
    trim::trim_node(&mut trimmed);
    assert!(trimmed.metadata.annotations.is_none());
    assert_eq!(
        cluster::cluster_ranges(&Default::default(), &[trimmed], &[], &[]),
        cluster::cluster_ranges(&Default::default(), &[node], &[], &[])
    );
}
