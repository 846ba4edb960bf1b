//! The in-cluster ranges: destinations a mapped pod reaches with its own pod
//! IP, and sources that are in-cluster clients of an LB IP (docs/traffic.md).
//! From the operator (`--cluster-cidrs`) and, unless told not to, from what
//! the cluster publishes: Nodes' `spec.podCIDRs` and addresses, and
//! `ServiceCIDR` objects. Link-local ranges are always in.
use super::Cidr;
use k8s_openapi::api::{core::v1::Node, networking::v1::ServiceCIDR};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// Where the in-cluster ranges come from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Given by the operator.
    pub configured: Vec<Cidr>,
    /// Also take what the cluster publishes.
    pub derive: bool,
}

/// The in-cluster ranges, with what each came from (for the logs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterRanges {
    pub ranges: BTreeSet<Cidr>,
    /// Range -> where it came from ("--cluster-cidrs", "Node n1 podCIDRs", ...).
    pub origin: BTreeMap<Cidr, String>,
    /// What could not be known, said once per change.
    pub unknown: Vec<String>,
}

/// 169.254.0.0/16 and fe80::/10: node-local services (node-local DNS,
/// metadata endpoints) live there and must see the pod as itself.
pub fn link_local() -> [Cidr; 2] {
    [
        Cidr::new(IpAddr::from([169, 254, 0, 0]), 16).expect("constant"),
        Cidr::new(IpAddr::from([0xfe80, 0, 0, 0, 0, 0, 0, 0]), 10).expect("constant"),
    ]
}

/// Every address the Nodes publish (InternalIP, ExternalIP, ...).
pub fn node_addresses(nodes: &[Node]) -> BTreeSet<IpAddr> {
    nodes
        .iter()
        .filter_map(|n| n.status.as_ref()?.addresses.as_ref())
        .flatten()
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// Each Node's InternalIPs, by name: where a mapping hosted there is
/// steered from the other nodes (docs/traffic.md).
pub fn internal_addresses(nodes: &[Node]) -> NodeAddresses {
    let mut out = NodeAddresses::new();
    for n in nodes {
        let Some(addrs) = n.status.as_ref().and_then(|s| s.addresses.as_ref()) else {
            continue;
        };
        let internal = addrs
            .iter()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse::<IpAddr>().ok());
        out.entry(name(n).to_string()).or_default().extend(internal);
    }
    out
}

/// Addresses by node name.
pub type NodeAddresses = BTreeMap<String, Vec<IpAddr>>;

fn name(n: &Node) -> &str {
    n.metadata.name.as_deref().unwrap_or("?")
}

/// The in-cluster ranges of `cfg`, `nodes` and `service_cidrs`. Pure.
/// A CNI's pool of pod addresses, as its own object publishes it (a
/// Kube-OVN Subnet, a Calico IPPool, a Cilium CiliumPodIPPool): where
/// Nodes carry no `spec.podCIDRs`, these are the pod networks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPool {
    /// What it is, for the log: "Kube-OVN Subnet ovn-default".
    pub origin: String,
    pub cidrs: Vec<String>,
}

pub fn cluster_ranges(
    cfg: &ClusterConfig,
    nodes: &[Node],
    service_cidrs: &[ServiceCIDR],
    pools: &[PodPool],
) -> ClusterRanges {
    let mut out = ClusterRanges::default();
    let add = |c: Cidr, from: String, out: &mut ClusterRanges| {
        out.ranges.insert(c);
        out.origin.entry(c).or_insert(from);
    };
    for c in link_local() {
        add(c, "link-local".into(), &mut out);
    }
    for c in &cfg.configured {
        add(*c, "--cluster-cidrs".into(), &mut out);
    }
    if !cfg.derive {
        return out;
    }
    let mut pod_cidrs = 0;
    for n in nodes {
        let cidrs = n.spec.as_ref().and_then(|s| s.pod_cidrs.as_ref());
        for text in cidrs.into_iter().flatten() {
            match text.parse::<Cidr>() {
                Ok(c) => {
                    pod_cidrs += 1;
                    add(c, format!("Node {} podCIDRs", name(n)), &mut out);
                }
                Err(e) => out.unknown.push(format!("Node {}: podCIDR {e}", name(n))),
            }
        }
        let addrs = n.status.as_ref().and_then(|s| s.addresses.as_ref());
        for a in addrs.into_iter().flatten() {
            if let Ok(ip) = a.address.parse::<IpAddr>() {
                add(
                    Cidr::host(ip),
                    format!("Node {} {}", name(n), a.type_),
                    &mut out,
                );
            }
        }
    }
    for pool in pools {
        for text in &pool.cidrs {
            match text.trim().parse::<Cidr>() {
                Ok(c) => {
                    pod_cidrs += 1;
                    add(c, pool.origin.clone(), &mut out);
                }
                Err(e) => out.unknown.push(format!("{}: CIDR {e}", pool.origin)),
            }
        }
    }
    for sc in service_cidrs {
        let cidrs = sc.spec.as_ref().and_then(|s| s.cidrs.as_ref());
        for text in cidrs.into_iter().flatten() {
            if let Ok(c) = text.parse::<Cidr>() {
                let from = format!("ServiceCIDR {}", sc.metadata.name.as_deref().unwrap_or("?"));
                add(c, from, &mut out);
            }
        }
    }
    if pod_cidrs == 0 && cfg.configured.is_empty() {
        out.unknown.push(
            "no Node publishes spec.podCIDRs, no Kube-OVN Subnet, Calico IPPool or Cilium CiliumPodIPPool \
             is readable, and --cluster-cidrs is empty: pod networks are not known as in-cluster; set \
             --cluster-cidrs (chart value clusterCIDRs)"
                .into(),
        );
    }
    if service_cidrs.is_empty() && cfg.configured.is_empty() {
        out.unknown.push(
            "no ServiceCIDR objects (Kubernetes < 1.33, or not readable) and --cluster-cidrs is empty: \
             service networks are not known as in-cluster"
                .into(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
    use k8s_openapi::api::networking::v1::ServiceCIDRSpec;

    fn node(name: &str, pod_cidrs: &[&str], addresses: &[&str]) -> Node {
        Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                pod_cidrs: Some(pod_cidrs.iter().map(|s| s.to_string()).collect()),
                ..Default::default()
            }),
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
        }
    }

    fn c(s: &str) -> Cidr {
        s.parse().expect("valid")
    }

    #[test]
    fn derives_pod_node_and_service_ranges_and_says_what_is_unknown() {
        let nodes = [
            node(
                "n1",
                &["192.0.2.0/26", "2001:db8:2::/120"],
                &["198.51.100.2"],
            ),
            node("n2", &["192.0.2.64/26", "bogus"], &["198.51.100.3"]),
        ];
        let svc = ServiceCIDR {
            metadata: Default::default(),
            spec: Some(ServiceCIDRSpec {
                cidrs: Some(vec!["203.0.113.128/25".into()]),
            }),
            status: None,
        };
        let cfg = ClusterConfig {
            configured: vec![c("198.51.100.64/26")],
            derive: true,
        };
        let r = cluster_ranges(&cfg, &nodes, &[svc], &[]);
        for want in [
            "192.0.2.0/26",
            "192.0.2.64/26",
            "2001:db8:2::/120",
            "198.51.100.2/32",
            "198.51.100.3/32",
            "203.0.113.128/25",
            "198.51.100.64/26",
            "169.254.0.0/16",
            "fe80::/10",
        ] {
            assert!(
                r.ranges.contains(&c(want)),
                "{want} missing: {:?}",
                r.ranges
            );
        }
        assert_eq!(r.origin[&c("192.0.2.64/26")], "Node n2 podCIDRs");
        assert_eq!(r.unknown.len(), 1, "{:?}", r.unknown);
        assert!(r.unknown[0].contains("bogus"));
        // Nothing published, nothing configured: said, not guessed.
        let bare = cluster_ranges(
            &ClusterConfig {
                configured: vec![],
                derive: true,
            },
            &[],
            &[],
            &[],
        );
        assert_eq!(bare.ranges.len(), 2);
        assert_eq!(bare.unknown.len(), 2, "{:?}", bare.unknown);
        // Not derived: only what is configured (and link-local).
        let only = cluster_ranges(
            &ClusterConfig {
                configured: vec![c("10.0.0.0/8")],
                derive: false,
            },
            &nodes,
            &[],
            &[],
        );
        assert_eq!(only.ranges.len(), 3);
    }

    #[test]
    fn a_cnis_pools_are_pod_networks() {
        let pools = [
            PodPool {
                origin: "Kube-OVN Subnet ovn-default".into(),
                cidrs: vec!["192.0.2.0/24".into(), " 2001:db8:2::/64".into()],
            },
            PodPool {
                origin: "Calico IPPool bad".into(),
                cidrs: vec!["not-a-cidr".into()],
            },
        ];
        let cfg = ClusterConfig {
            configured: vec![],
            derive: true,
        };
        let r = cluster_ranges(&cfg, &[], &[], &pools);
        for want in ["192.0.2.0/24", "2001:db8:2::/64"] {
            let want = c(want);
            assert!(r.ranges.contains(&want), "{want:?} missing: {:?}", r.ranges);
            assert_eq!(r.origin[&want], "Kube-OVN Subnet ovn-default");
        }
        // The bad one is said; the pods' networks are known, so only the
        // service networks are missing.
        assert!(r.unknown.iter().any(|u| u.contains("Calico IPPool bad")));
        assert!(!r.unknown.iter().any(|u| u.contains("no Node publishes")));
        // Not derived: not read.
        let off = ClusterConfig {
            configured: vec![],
            derive: false,
        };
        assert_eq!(cluster_ranges(&off, &[], &[], &pools).ranges.len(), 2);
    }
}
