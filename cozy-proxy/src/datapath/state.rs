//! The tables every datapath holds, derived from a plan. Both backends keep
//! exactly these collections (per family in the kernel), and `dump` reads
//! them back into this same shape, so tests compare one value.
use crate::model::{Mode, Plan};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// `(pod IP, IP protocol number, destination port)` the port filter lets in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AllowedPort {
    pub pod: IpAddr,
    pub proto: u8,
    pub port: u16,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathState {
    /// pod IP -> LoadBalancer IP (egress source rewrite).
    pub pod_svc: BTreeMap<IpAddr, IpAddr>,
    /// LoadBalancer IP -> pod IP (ingress destination rewrite).
    pub svc_pod: BTreeMap<IpAddr, IpAddr>,
    /// Pods whose Service is in port-filter mode.
    pub filtered_pods: BTreeSet<IpAddr>,
    /// Keyed on the pod IP: the filter runs after the destination rewrite.
    pub allowed_ports: BTreeSet<AllowedPort>,
    /// Filtered pods that accept ICMP (allowICMP "true").
    pub icmp_allowed_pods: BTreeSet<IpAddr>,
    /// LB IPs of managed Services with no mapping: dropped, never routed on.
    pub unmapped_lbs: BTreeSet<IpAddr>,
}

impl DatapathState {
    pub fn from_plan(plan: &Plan) -> Self {
        let mut s = DatapathState::default();
        for m in &plan.mappings {
            s.pod_svc.insert(m.pod_ip, m.lb_ip);
            s.svc_pod.insert(m.lb_ip, m.pod_ip);
            if let Mode::PortFilter { ports, allow_icmp } = &m.mode {
                s.filtered_pods.insert(m.pod_ip);
                if *allow_icmp {
                    s.icmp_allowed_pods.insert(m.pod_ip);
                }
                s.allowed_ports.extend(ports.iter().map(|p| AllowedPort {
                    pod: m.pod_ip,
                    proto: p.protocol.number(),
                    port: p.port,
                }));
            }
        }
        s.unmapped_lbs = plan.unmapped_lb_ips.keys().copied().collect();
        s
    }

    /// Number of elements over all collections.
    pub fn len(&self) -> usize {
        self.pod_svc.len()
            + self.svc_pod.len()
            + self.filtered_pods.len()
            + self.allowed_ports.len()
            + self.icmp_allowed_pods.len()
            + self.unmapped_lbs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What turns `self` into `target`.
    pub fn diff(&self, target: &DatapathState) -> StateDiff {
        StateDiff {
            pod_svc: Change::of_maps(&self.pod_svc, &target.pod_svc),
            svc_pod: Change::of_maps(&self.svc_pod, &target.svc_pod),
            filtered_pods: Change::of_sets(&self.filtered_pods, &target.filtered_pods),
            allowed_ports: Change::of_sets(&self.allowed_ports, &target.allowed_ports),
            icmp_allowed_pods: Change::of_sets(&self.icmp_allowed_pods, &target.icmp_allowed_pods),
            unmapped_lbs: Change::of_sets(&self.unmapped_lbs, &target.unmapped_lbs),
        }
    }
}

/// Elements to remove and to add in one collection. A map entry whose value
/// changes is removed and added again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change<T> {
    pub remove: Vec<T>,
    pub add: Vec<T>,
}

impl<T: Ord + Clone> Change<T> {
    pub fn of_sets(old: &BTreeSet<T>, new: &BTreeSet<T>) -> Self {
        Change {
            remove: old.difference(new).cloned().collect(),
            add: new.difference(old).cloned().collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }
}

impl<K: Ord + Clone, V: Ord + Clone> Change<(K, V)> {
    pub fn of_maps(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> Self {
        let changed = |a: &BTreeMap<K, V>, b: &BTreeMap<K, V>| -> Vec<(K, V)> {
            a.iter()
                .filter(|(k, v)| b.get(k) != Some(v))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        Change {
            remove: changed(old, new),
            add: changed(new, old),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDiff {
    pub pod_svc: Change<(IpAddr, IpAddr)>,
    pub svc_pod: Change<(IpAddr, IpAddr)>,
    pub filtered_pods: Change<IpAddr>,
    pub allowed_ports: Change<AllowedPort>,
    pub icmp_allowed_pods: Change<IpAddr>,
    pub unmapped_lbs: Change<IpAddr>,
}

impl StateDiff {
    pub fn is_empty(&self) -> bool {
        self.pod_svc.is_empty()
            && self.svc_pod.is_empty()
            && self.filtered_pods.is_empty()
            && self.allowed_ports.is_empty()
            && self.icmp_allowed_pods.is_empty()
            && self.unmapped_lbs.is_empty()
    }

    /// Elements removed plus elements added.
    pub fn size(&self) -> usize {
        fn n<T>(c: &Change<T>) -> usize {
            c.remove.len() + c.add.len()
        }
        n(&self.pod_svc)
            + n(&self.svc_pod)
            + n(&self.filtered_pods)
            + n(&self.allowed_ports)
            + n(&self.icmp_allowed_pods)
            + n(&self.unmapped_lbs)
    }
}
