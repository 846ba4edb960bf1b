//! The Kubernetes permissions the controller uses, next to nothing else:
//! the Helm chart's ClusterRole must equal these rules (its test compares
//! them with `cozy-proxy rbac`).
//!
//! - Services: list and watch (the reflector in `source::kube`); get for
//!   completeness of a cache refresh.
//! - EndpointSlices (discovery.k8s.io): list and watch (same).
//! - Nodes: get (this node's backend label, read at start in `main.rs`).
//! - Events (events.k8s.io): create and patch (`events.rs`; a repeated
//!   Event is patched into a series).

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
        verbs: &["get"],
    },
    Rule {
        api_group: "events.k8s.io",
        resources: &["events"],
        verbs: &["create", "patch"],
    },
];

/// The rules as the `rules:` list of a ClusterRole.
pub fn cluster_role_rules_yaml() -> String {
    let list = |items: &[&str]| {
        items
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    RULES
        .iter()
        .map(|r| {
            format!(
                "- apiGroups: [\"{}\"]\n  resources: [{}]\n  verbs: [{}]\n",
                r.api_group,
                list(r.resources),
                list(r.verbs)
            )
        })
        .collect()
}
