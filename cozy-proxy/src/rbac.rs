//! The Kubernetes permissions the controller uses, next to nothing else:
//! the Helm chart's ClusterRole must equal these rules (its test compares
//! them with `cozy-proxy rbac`).
//!
//! - Services: list and watch (the reflector in `source::kube`); get for
//!   completeness of a cache refresh.
//! - EndpointSlices (discovery.k8s.io): list and watch (same).
//! - Nodes: get (this node's backend label, read at start), list and watch
//!   (their podCIDRs and addresses are in-cluster ranges, and never
//!   translated).
//! - ServiceCIDRs (networking.k8s.io): list and watch (service networks are
//!   in-cluster ranges); optional: without them, only `--cluster-cidrs`.
//! - Kube-OVN Subnets, Calico IPPools, Cilium CiliumPodIPPools: list and
//!   watch (`source/pools.rs`: the pod networks of CNIs that leave
//!   `spec.podCIDRs` empty are in-cluster ranges); optional: read where
//!   their CRDs are installed.
//! - Events (events.k8s.io): create and patch (`events.rs`; a repeated
//!   Event is patched into a series).
//! - In its own namespace, its own DaemonSet: get, list and watch (by name;
//!   `node.rs`: watched while running, read at shutdown; deleted means
//!   uninstall, so the datapath is removed; present means a restart or a
//!   rolling update, so it stays).

/// One PolicyRule: API group, resources, verbs.
pub struct Rule {
    pub api_group: &'static str,
    pub resources: &'static [&'static str],
    pub verbs: &'static [&'static str],
}

pub const RULES: &[Rule] = &[
    Rule {
        api_group: "",
        resources: &["services"],
        verbs: &["get", "list", "watch"],
    },
    Rule {
        api_group: "discovery.k8s.io",
        resources: &["endpointslices"],
        verbs: &["get", "list", "watch"],
    },
    Rule {
        api_group: "",
        resources: &["nodes"],
        verbs: &["get", "list", "watch"],
    },
    Rule {
        api_group: "networking.k8s.io",
        resources: &["servicecidrs"],
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "kubeovn.io",
        resources: &["subnets"],
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "crd.projectcalico.org",
        resources: &["ippools"],
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "cilium.io",
        resources: &["ciliumpodippools"],
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "events.k8s.io",
        resources: &["events"],
        verbs: &["create", "patch"],
    },
];

/// Namespaced (a Role in the release namespace), for the DaemonSet named
/// `resource_name`.
pub const NAMESPACED_RULES: &[Rule] = &[Rule {
    api_group: "apps",
    resources: &["daemonsets"],
    verbs: &["get", "list", "watch"],
}];

/// The rules as the `rules:` list of a ClusterRole.
pub fn cluster_role_rules_yaml() -> String {
    rules_yaml(RULES, None)
}

/// The rules as the `rules:` list of the Role for DaemonSet `daemonset`.
pub fn role_rules_yaml(daemonset: &str) -> String {
    rules_yaml(NAMESPACED_RULES, Some(daemonset))
}

fn rules_yaml(rules: &[Rule], resource_name: Option<&str>) -> String {
    let list = |items: &[&str]| {
        items
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    rules
        .iter()
        .map(|r| {
            let names = resource_name
                .map(|n| format!("  resourceNames: [\"{n}\"]\n"))
                .unwrap_or_default();
            format!(
                "- apiGroups: [\"{}\"]\n  resources: [{}]\n{names}  verbs: [{}]\n",
                r.api_group,
                list(r.resources),
                list(r.verbs)
            )
        })
        .collect()
}
