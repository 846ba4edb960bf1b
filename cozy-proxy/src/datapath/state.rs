//! The tables every datapath holds on one node, derived from the plan (and,
//! for `guard` and `routes`, from the kernel's own paths toward the pods).
//! Both backends keep exactly these collections (per family in the
//! kernel), and `dump` reads them back into this same shape, so tests
//! compare one value. docs/traffic.md says what each is for.
use super::tables::{datapath_tables, Change, StateTable};
use crate::model::{cluster::NodeAddresses, Hosts, IpRange, Mapping};
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

/// How the kernel reaches a pod: the interface, and the gateway (none on the
/// pod's own link).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Path {
    pub oif: u32,
    pub gateway: Option<IpAddr>,
    /// RTNH_F_ONLINK: the gateway is on the link without a route to it.
    pub onlink: bool,
    /// Where frames from the pod (or its next hop) enter the node: `oif`,
    /// or, when `oif` is a bridge, the port behind which the next hop's
    /// link-layer address lives (`bridge_ports.rs`), once the kernel knows
    /// it.
    pub entry: u32,
    /// The source address the node's own sockets take on this path.
    #[serde(default)]
    pub src: Option<IpAddr>,
}

/// What the kernel's routes say of the pods' paths, by pod: `None`, no
/// specific route (looked up, and none found). A backend keeps it between
/// syncs and hands it out as it is, never copied.
pub type Paths = BTreeMap<IpAddr, Option<Path>>;

/// Where the path of a pod is read from: the kernel's [`Paths`], or (in
/// tests) a plain map of the pods that have one.
pub trait PathOf {
    fn path_of(&self, pod: &IpAddr) -> Option<&Path>;
}

impl PathOf for Paths {
    fn path_of(&self, pod: &IpAddr) -> Option<&Path> {
        self.get(pod).and_then(Option::as_ref)
    }
}

impl PathOf for BTreeMap<IpAddr, Path> {
    fn path_of(&self, pod: &IpAddr) -> Option<&Path> {
        self.get(pod)
    }
}

/// A host route's next hop: where an LB IP is steered. `oif` 0 (and no
/// gateway): an `unreachable` route, for an LB IP whose pod has no path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NextHop {
    pub gateway: Option<IpAddr>,
    pub oif: u32,
    pub onlink: bool,
    /// The route's `src`: the node's own sockets take it toward the LB IP.
    #[serde(default)]
    pub src: Option<IpAddr>,
}

impl NextHop {
    pub const UNREACHABLE: NextHop = NextHop {
        gateway: None,
        oif: 0,
        onlink: false,
        src: None,
    };

    /// The route of an LB IP whose pod is reached by `path`: on the pod's
    /// own link the pod itself is the next hop (the frame gets its MAC),
    /// marked `onlink`. The route that puts the pod on that link may be of
    /// scope host (the `ptp` CNI plugin's `<pod>/32 dev <veth> scope
    /// host`): a gateway resolved through it is not taken as one, and the
    /// kernel would ask the link for the LB IP itself instead of the pod.
    pub fn toward(pod: IpAddr, path: &Path) -> NextHop {
        NextHop {
            gateway: Some(path.gateway.unwrap_or(pod)),
            oif: path.oif,
            onlink: path.onlink || path.gateway.is_none(),
            src: None,
        }
    }
}

datapath_tables! {
    held {
        /// Pods hosted here: pod IP -> LB IP (source rewrite toward the outside).
        pod_svc: BTreeMap<IpAddr, IpAddr>,
        /// LB IPs of pods hosted here: LB IP -> pod IP (destination rewrite).
        svc_pod: BTreeMap<IpAddr, IpAddr>,
        /// LB IPs of pods hosted on other nodes: LB IP -> pod IP. Steered there
        /// untranslated; translated here only for in-cluster clients.
        remote: BTreeMap<IpAddr, IpAddr>,
        /// Pods hosted here whose Service is in port-filter mode.
        filtered_pods: BTreeSet<IpAddr>,
        /// Keyed on the pod IP: the filter runs after the destination rewrite.
        allowed_ports: BTreeSet<AllowedPort>,
        /// Filtered pods that accept ICMP (allowICMP "true").
        icmp_allowed_pods: BTreeSet<IpAddr>,
        /// LB IPs of managed Services with no mapping: dropped, never routed on.
        unmapped_lbs: BTreeSet<IpAddr>,
        /// The in-cluster ranges, merged (disjoint, not adjacent).
        cluster: BTreeSet<IpRange>,
        /// LB IPs (of every mapping) restricted by loadBalancerSourceRanges.
        ranged_lbs: BTreeSet<IpAddr>,
        /// `(LB IP, source range)` allowed to reach the pod through the LB IP,
        /// merged per LB IP.
        source_ranges: BTreeSet<(IpAddr, IpRange)>,
    }
    resolved {
        /// Resolved from the kernel's paths: a source address we guard (mapped
        /// pods, managed LB IPs) -> the only interface it may arrive on (its
        /// path's `entry`: the route's interface, or the bridge port behind
        /// which it lives; 0: none; a local or unmapped LB IP is never a
        /// legitimate source).
        guard: BTreeMap<IpAddr, u32>,
        /// Resolved from the kernel's paths: LB IP -> where its host route
        /// (`proto 249`) sends it: along the path toward its pod, or to the
        /// node hosting it ([`DatapathState::route_of`]).
        routes: BTreeMap<IpAddr, NextHop>,
    }
    planned {
        /// LB IP of a remote mapping -> its hosting node's address (of the LB
        /// IP's family): where its host route steers it when that address is
        /// on one of this node's networks and the pod's path does not lead
        /// there ([`DatapathState::route_of`]). Planned, never held by the kernel:
        /// a state read back takes it from the plan.
        remote_hosts: BTreeMap<IpAddr, IpAddr>,
    }
}

/// What a kernel is asked to hold: the state, and the index of its remote
/// pods the sync layer keeps beside it (one copy, not one per backend).
#[derive(Clone, Copy, Debug)]
pub struct Desired<'a> {
    pub state: &'a DatapathState,
    pub remote_pods: &'a RemotePods,
}

/// The reverse of a state's `remote` (pod -> LB IP): a remote pod is
/// looked up by its address (its guard, its `addrs` entry). Kept beside
/// the state it mirrors, changed with it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemotePods(BTreeMap<IpAddr, IpAddr>);

impl RemotePods {
    pub fn of(s: &DatapathState) -> Self {
        RemotePods(s.remote.iter().map(|(lb, pod)| (*pod, *lb)).collect())
    }

    /// Follows a change of `remote`.
    pub fn apply(&mut self, change: &Change<(IpAddr, IpAddr)>) {
        for (lb, pod) in &change.remove {
            if self.0.get(pod) == Some(lb) {
                self.0.remove(pod);
            }
        }
        self.0
            .extend(change.add.iter().map(|(lb, pod)| (*pod, *lb)));
    }

    /// The LB IP of remote pod `pod`.
    pub fn lb_of(&self, pod: &IpAddr) -> Option<&IpAddr> {
        self.0.get(pod)
    }

    pub fn contains(&self, pod: &IpAddr) -> bool {
        self.0.contains_key(pod)
    }
}

/// Which node this is, for [`DatapathState::for_node`].
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    /// `None` (standalone, or `--node-name` unset): every mapping is local.
    pub name: Option<&'a str>,
    /// Every node's InternalIPs, by name.
    pub addresses: &'a NodeAddresses,
    /// Pods of mappings hosted on several nodes, this one among them, that
    /// the kernel's routes deliver at another of them ([`away`]): this
    /// node steers their LB IPs there rather than translating them.
    pub away: &'a BTreeSet<IpAddr>,
}

/// No node's addresses known.
pub static NO_ADDRESSES: NodeAddresses = BTreeMap::new();

/// No pod away.
pub static NONE_AWAY: BTreeSet<IpAddr> = BTreeSet::new();

impl<'a> NodeView<'a> {
    /// Node `name`, knowing no other node's addresses.
    pub fn named(name: Option<&'a str>) -> Self {
        NodeView {
            name,
            addresses: &NO_ADDRESSES,
            away: &NONE_AWAY,
        }
    }

    /// The address, in the family of its LB IP, of the node other nodes
    /// steer `m`'s LB IP to: the first of its hosts that is not this one.
    pub fn host_address_of(&self, m: &Mapping) -> Option<IpAddr> {
        let host = (m.hosts.nodes().iter()).find(|n| Some(&***n) != self.name)?;
        let addrs = self.addresses.get(&**host)?;
        addrs
            .iter()
            .find(|a| a.is_ipv4() == m.lb_ip.is_ipv4())
            .copied()
    }

    /// Does this node translate `m` between the outside and its pod? Where
    /// its endpoints name this node, unless the kernel delivers the pod at
    /// another of its nodes.
    pub fn hosts(&self, m: &Mapping) -> bool {
        match self.name {
            None => true,
            Some(me) => m.hosts.include(me) && !self.away.contains(&m.pod_ip),
        }
    }
}

/// A VM's mapping while it migrates: its source pod ready on n1, its
/// target starting on n2 (for tests).
#[cfg(test)]
pub(crate) fn migrating_vm(lb: IpAddr, pod: IpAddr) -> Mapping {
    use crate::model::{Mode, ServiceRef};
    use std::sync::Arc;
    Mapping {
        service: ServiceRef::new("ns", "vm"),
        lb_ip: lb,
        pod_ip: pod,
        mode: Arc::new(Mode::Passthrough),
        hosts: Hosts::of(&[Arc::from("n1")], &[Arc::from("n2")]),
        source_ranges: None,
    }
}

/// Do `m`'s endpoints name node `me` and another node?
pub fn shared_with(m: &Mapping, me: &str) -> bool {
    matches!(m.hosts, Hosts::Several(_)) && m.hosts.include(me)
}

/// The pods of `mappings` shared with node `me` ([`shared_with`]), the
/// pods [`away`] decides on.
pub fn shared_pods<'m>(
    mappings: impl IntoIterator<Item = &'m Mapping>,
    me: &str,
) -> BTreeMap<IpAddr, &'m Mapping> {
    mappings
        .into_iter()
        .filter(|m| shared_with(m, me))
        .map(|m| (m.pod_ip, m))
        .collect()
}

/// Of the `shared` pods, those the kernel's `paths` deliver at another of
/// their nodes: the route to the pod goes via one of those nodes' addresses
/// or into a tunnel (an `onlink` next hop, as overlays route). A pod on
/// this node's own link, or behind a router that knows pods and not nodes
/// (Kube-OVN's), stays hosted here too: both nodes then translate it, and
/// the router delivers it wherever it is.
pub fn away(
    shared: &BTreeMap<IpAddr, &Mapping>,
    me: &str,
    addresses: &NodeAddresses,
    paths: &impl PathOf,
) -> BTreeSet<IpAddr> {
    away_via(shared, me, addresses, paths).into_keys().collect()
}

/// Where the kernel's route to a pod [`away`] leads: its next hop, and
/// the node that address belongs to (none for a tunnel's far end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elsewhere {
    pub via: IpAddr,
    pub node: Option<String>,
}

impl std::fmt::Display for Elsewhere {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.node {
            Some(node) => write!(f, "route via {} ({node})", self.via),
            None => write!(f, "route via {} (onlink tunnel)", self.via),
        }
    }
}

/// [`away`], with where each pod's route leads.
pub fn away_via(
    shared: &BTreeMap<IpAddr, &Mapping>,
    me: &str,
    addresses: &NodeAddresses,
    paths: &impl PathOf,
) -> BTreeMap<IpAddr, Elsewhere> {
    let node_of = |m: &Mapping, gateway: &IpAddr| {
        (m.hosts.nodes().iter())
            .filter(|n| &***n != me)
            .find(|n| addresses.get(&***n).is_some_and(|a| a.contains(gateway)))
            .map(|n| n.to_string())
    };
    shared
        .iter()
        .filter_map(|(pod, m)| {
            let path = paths.path_of(pod)?;
            let via = path.gateway?;
            let node = node_of(m, &via);
            (path.onlink || node.is_some()).then_some((*pod, Elsewhere { via, node }))
        })
        .collect()
}

impl DatapathState {
    /// Every mapped pod, local or remote, and the remote mappings' nodes:
    /// the addresses whose paths [`DatapathState::resolve`] needs.
    pub fn pods(&self) -> BTreeSet<IpAddr> {
        self.svc_pod
            .values()
            .chain(self.remote.values())
            .chain(self.remote_hosts.values())
            .copied()
            .collect()
    }

    /// Adds `guard` and `routes` from the kernel's `paths` toward the pods.
    /// A pod without a path gets no route, and its addresses guard 0 (its
    /// traffic is dropped rather than translated from anywhere).
    pub fn resolve(&mut self, paths: &impl PathOf) {
        self.guard.clear();
        self.routes.clear();
        let remote_pods = RemotePods::of(self);
        // Collected, not inserted one by one: see [`repack`].
        let guard = (self.guarded().iter())
            .filter_map(|a| Some((*a, self.guard_of(a, remote_pods.contains(a), paths)?)))
            .collect();
        let routes = (self.svc_pod.keys().chain(self.remote.keys()))
            .filter_map(|lb| Some((*lb, self.route_of(lb, paths)?)))
            .collect();
        self.guard = guard;
        self.routes = routes;
    }

    /// Every LB IP it holds: mapped here or elsewhere, or dropped.
    pub fn lb_ips(&self) -> Vec<IpAddr> {
        let mut lbs: Vec<IpAddr> = (self.svc_pod.keys())
            .chain(self.remote.keys())
            .chain(&self.unmapped_lbs)
            .copied()
            .collect();
        lbs.sort_unstable();
        lbs.dedup();
        lbs
    }

    /// What LB IPs `lbs` bring into `self`: their mappings (local or
    /// remote) with their pods' policies, or their drop, and the guards of
    /// their addresses and their routes. `lbs` is a run of
    /// [`DatapathState::lb_ips`] (every LB IP of `self` between its first
    /// and its last): what is keyed by LB IP is taken as one range of each
    /// collection, and only what is keyed by pod is looked up, not each
    /// element of each collection. A state is the sum of its LB IPs' parts and its
    /// in-cluster ranges (the parts of two LB IPs never share an element;
    /// an address both an LB IP and another mapping's pod has its guard in
    /// its LB IP's part).
    pub fn part_of(&self, lbs: &[IpAddr]) -> DatapathState {
        let mut part = DatapathState::default();
        let (Some(&first), Some(&last)) = (lbs.first(), lbs.last()) else {
            return part;
        };
        let within = first..=last;
        part.svc_pod = self
            .svc_pod
            .range(within.clone())
            .map(|(l, p)| (*l, *p))
            .collect();
        part.remote = self
            .remote
            .range(within.clone())
            .map(|(l, p)| (*l, *p))
            .collect();
        part.remote_hosts = self
            .remote_hosts
            .range(within.clone())
            .map(|(l, h)| (*l, *h))
            .collect();
        part.unmapped_lbs = self.unmapped_lbs.range(within.clone()).copied().collect();
        part.routes = self
            .routes
            .range(within.clone())
            .map(|(l, h)| (*l, *h))
            .collect();
        part.ranged_lbs = self.ranged_lbs.range(within).copied().collect();
        let (lowest, highest) = (IpAddr::from([0u8; 4]), IpAddr::from([0xffu8; 16]));
        let ranges = (
            first,
            IpRange {
                first: lowest,
                last: lowest,
            },
        )
            ..=(
                last,
                IpRange {
                    first: highest,
                    last: highest,
                },
            );
        part.source_ranges = self.source_ranges.range(ranges).copied().collect();
        let is_lb = |a: &IpAddr| {
            self.svc_pod.contains_key(a)
                || self.remote.contains_key(a)
                || self.unmapped_lbs.contains(a)
        };
        let mut guards = Vec::with_capacity(2 * lbs.len());
        for (lb, pod) in &part.svc_pod {
            if self.pod_svc.get(pod) != Some(lb) {
                continue;
            }
            part.pod_svc.insert(*pod, *lb);
            if self.filtered_pods.contains(pod) {
                part.filtered_pods.insert(*pod);
            }
            let ports = AllowedPort {
                pod: *pod,
                proto: 0,
                port: 0,
            }..=AllowedPort {
                pod: *pod,
                proto: u8::MAX,
                port: u16::MAX,
            };
            part.allowed_ports
                .extend(self.allowed_ports.range(ports).copied());
            if self.icmp_allowed_pods.contains(pod) {
                part.icmp_allowed_pods.insert(*pod);
            }
        }
        for pod in part.svc_pod.values().chain(part.remote.values()) {
            if !is_lb(pod) {
                guards.extend(self.guard.get_key_value(pod));
            }
        }
        guards.extend(lbs.iter().filter_map(|lb| self.guard.get_key_value(lb)));
        part.guard = guards.into_iter().map(|(a, g)| (*a, *g)).collect();
        part
    }

    /// The addresses [`DatapathState::guard_of`] guards: every mapping's
    /// LB IP and pod, local or remote, and the unmapped LB IPs.
    pub fn guarded(&self) -> BTreeSet<IpAddr> {
        let mut guarded: BTreeSet<IpAddr> = self.unmapped_lbs.clone();
        for (lb, pod) in self.svc_pod.iter().chain(&self.remote) {
            guarded.extend([*lb, *pod]);
        }
        guarded
    }

    /// The only interface address `a` may arrive on (0: none), if it is
    /// guarded. An LB IP's role comes first (should an address be both a
    /// Service's LB IP and another's pod): an unmapped LB IP is never a
    /// legitimate source; a local one comes from its pod's path, as the
    /// pod's packets become once translated (so that a packet the other
    /// backend translated passes this one untouched while both act, in a
    /// backend switch); a pod comes from its own path. A remote LB IP
    /// arrives the way its route leaves ([`DatapathState::route_of`]):
    /// from its node, or from its pod's path. `remote_pod`: `a` is the pod
    /// of a remote mapping.
    pub fn guard_of(&self, a: &IpAddr, remote_pod: bool, paths: &impl PathOf) -> Option<u32> {
        let oif = |pod: &IpAddr| paths.path_of(pod).map_or(0, |p| p.entry);
        if self.unmapped_lbs.contains(a) {
            Some(0)
        } else if let Some(pod) = self.svc_pod.get(a) {
            Some(oif(pod))
        } else if let Some(pod) = self.remote.get(a) {
            match self.host_on_link(a, paths) {
                Some((_, path)) => Some(path.entry),
                None => Some(oif(pod)),
            }
        } else if self.pod_svc.contains_key(a) || remote_pod {
            Some(oif(a))
        } else {
            None
        }
    }

    /// Where the host route of LB IP `lb` sends it, if it is mapped:
    /// toward its pod, or, where the pod's path does not lead to the node
    /// hosting it (a router that knows pods, not LB IPs: Kube-OVN's), to
    /// that node ([`DatapathState::host_on_link`]); or nowhere (an
    /// unreachable route: traffic to the LB IP is refused here rather
    /// than sent back out the default route).
    pub fn route_of(&self, lb: &IpAddr, paths: &impl PathOf) -> Option<NextHop> {
        let pod = self.svc_pod.get(lb).or_else(|| self.remote.get(lb))?;
        if let Some((host, path)) = self.host_on_link(lb, paths) {
            // The node's own sockets keep the source they take toward the
            // pod: the pod's answers come back by the pod's path (its
            // guard's), not over the link to its node.
            let src = paths.path_of(pod).and_then(|p| p.src);
            return Some(NextHop {
                src,
                ..NextHop::toward(*host, path)
            });
        }
        Some(
            paths
                .path_of(pod)
                .map_or(NextHop::UNREACHABLE, |path| NextHop::toward(*pod, path)),
        )
    }

    /// The node hosting remote LB IP `lb` and the path to it, if the LB
    /// IP goes there rather than along its pod's path: the node is on one
    /// of this node's networks, and the pod's path does not lead to it
    /// (its next hop is neither the node itself nor a tunnel's far end,
    /// an `onlink` next hop as overlays route: a router that knows pods
    /// and not LB IPs, or none at all).
    fn host_on_link<'p>(
        &'p self,
        lb: &IpAddr,
        paths: &'p impl PathOf,
    ) -> Option<(&'p IpAddr, &'p Path)> {
        let host = self.remote_hosts.get(lb)?;
        let path = paths.path_of(host)?;
        let pod_path = self.remote.get(lb).and_then(|pod| paths.path_of(pod));
        let leads_there = pod_path.is_some_and(|p| p.onlink || p.gateway == Some(*host));
        (!leads_there && path.gateway.is_none() && path.oif != 0).then_some((host, path))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Holds nothing but what any node holds with no Service at all (the
    /// in-cluster ranges): nothing to adopt.
    pub fn has_mappings(&self) -> bool {
        self.len() > self.cluster.len()
    }
}

/// `c` built again from its elements in order, its nodes full: a B-tree
/// filled in any order keeps room in its nodes, in key order half of it
/// (each split leaves the left half behind), where one collected from a
/// sorted run has none (`FromIterator` sorts, then fills): half the memory.
/// The elements are moved, one collection at a time.
pub fn repack<C: Default + IntoIterator + FromIterator<C::Item>>(c: &mut C) {
    *c = std::mem::take(c).into_iter().collect();
}

impl StateDiff {
    /// The addresses of the mappings and unmapped LB IPs it changes (LB
    /// IPs and pods, local and remote): those whose guard, route or
    /// `addrs` entry may follow.
    pub fn mapping_addresses(&self) -> BTreeSet<IpAddr> {
        let mut out: BTreeSet<IpAddr> = self.unmapped_lbs.elements().copied().collect();
        for c in [&self.pod_svc, &self.svc_pod, &self.remote] {
            for (a, b) in c.elements() {
                out.extend([*a, *b]);
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.size() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Plan;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn path(oif: u32, gateway: Option<&str>) -> Path {
        Path {
            oif,
            gateway: gateway.map(ip),
            onlink: false,
            entry: oif,
            src: None,
        }
    }

    /// A pod two nodes' endpoints name (a VM migrating): each of them
    /// translates it unless the kernel delivers it at the other (via that
    /// node, or into a tunnel); any other node steers to the first named.
    #[test]
    fn a_pod_on_two_nodes_is_translated_where_the_kernel_delivers_it() {
        let (lb, pod) = (ip("203.0.113.10"), ip("192.0.2.20"));
        let plan = Plan {
            mappings: vec![migrating_vm(lb, pod)],
            ..Default::default()
        };
        let addresses: NodeAddresses = (1..=3)
            .map(|k| (format!("n{k}"), vec![ip(&format!("198.51.100.{}", 1 + k))]))
            .collect();
        // What node `me` holds with the pod's path `to_pod`: translated
        // (`None`), or steered to a node's address.
        let held = |me: &str, to_pod: Path| {
            let paths = BTreeMap::from([(pod, to_pod)]);
            let shared = shared_pods(&plan.mappings, me);
            let away = away(&shared, me, &addresses, &paths);
            let view = NodeView {
                name: Some(me),
                addresses: &addresses,
                away: &away,
            };
            let s = DatapathState::for_node(&plan, &BTreeSet::new(), view);
            match (s.svc_pod.get(&lb), s.remote.get(&lb)) {
                (Some(p), None) if *p == pod && s.pod_svc.get(&pod) == Some(&lb) => None,
                (None, Some(p)) if *p == pod => Some(s.remote_hosts[&lb]),
                _ => panic!("{me}: neither translated nor steered: {s:?}"),
            }
        };
        let (n1, n2) = (ip("198.51.100.2"), ip("198.51.100.3"));
        let local = path(5, None);
        let via = |node: &str| path(2, Some(node));
        let tunnel = Path {
            onlink: true,
            ..path(9, Some("192.0.2.64"))
        };
        // On the pod's own link: translated, on both nodes.
        assert_eq!(held("n1", local), None);
        assert_eq!(held("n2", local), None);
        // Delivered at the other: steered there.
        assert_eq!(held("n1", via("198.51.100.3")), Some(n2));
        assert_eq!(held("n2", via("198.51.100.2")), Some(n1));
        assert_eq!(held("n2", tunnel), Some(n1));
        // Behind a router that knows pods, not nodes (Kube-OVN's ovn0):
        // translated here too.
        assert_eq!(held("n2", via("192.0.2.193")), None);
        // Any other node: steered to the first named, whatever its path.
        assert_eq!(held("n3", local), Some(n1));
        assert_eq!(held("n3", via("198.51.100.3")), Some(n1));
        // Why, as logs and metrics say it: the next hop and its node.
        let why = |me: &str, to_pod: Path| {
            let paths = BTreeMap::from([(pod, to_pod)]);
            let shared = shared_pods(&plan.mappings, me);
            let routes = away_via(&shared, me, &addresses, &paths);
            routes.get(&pod).map(ToString::to_string)
        };
        assert_eq!(
            why("n1", via("198.51.100.3")).as_deref(),
            Some("route via 198.51.100.3 (n2)")
        );
        assert_eq!(
            why("n2", tunnel).as_deref(),
            Some("route via 192.0.2.64 (onlink tunnel)")
        );
        assert_eq!(why("n2", via("192.0.2.193")), None);
    }

    /// A remote mapping's LB IP goes along the path to its pod where that
    /// path leads to its node (via the node, or a tunnel's onlink far
    /// end); else to its node where that node is on a network of ours.
    /// A pod on its own link is the route's next hop, marked onlink (the
    /// route to the pod may be of scope host, as `ptp` writes it); a
    /// gateway on the path keeps the path's flag.
    #[test]
    fn a_pod_on_its_link_is_an_onlink_next_hop() {
        let pod = ip("192.0.2.20");
        let on_link = NextHop::toward(pod, &path(3, None));
        assert_eq!(
            (on_link.gateway, on_link.oif, on_link.onlink),
            (Some(pod), 3, true)
        );
        let routed = NextHop::toward(pod, &path(2, Some("198.51.100.3")));
        assert_eq!(
            (routed.gateway, routed.onlink),
            (Some(ip("198.51.100.3")), false)
        );
    }

    #[test]
    fn a_remote_lb_ip_is_steered_to_its_node_when_on_link() {
        let (lb, pod, host) = (ip("203.0.113.10"), ip("192.0.2.11"), ip("198.51.100.2"));
        let mut s = DatapathState::default();
        s.remote.insert(lb, pod);
        s.remote_hosts.insert(lb, host);
        // The pod behind a CNI's router (Kube-OVN's ovn0, ifindex 7).
        let join = ip("192.0.2.195");
        let to_pod = Path {
            src: Some(join),
            ..path(7, Some("192.0.2.193"))
        };
        let mut paths = BTreeMap::from([(pod, to_pod)]);
        let via_pod = NextHop::toward(pod, &paths[&pod]);
        assert_eq!(s.route_of(&lb, &paths), Some(via_pod));
        paths.insert(host, path(2, None));
        // The node's own sockets keep the source they take toward the pod.
        let to_host = NextHop {
            gateway: Some(host),
            oif: 2,
            onlink: true,
            src: Some(join),
        };
        assert_eq!(s.route_of(&lb, &paths), Some(to_host));
        assert_eq!(s.guard_of(&lb, false, &paths), Some(2));
        // A node reached through a router: the pod's path.
        paths.insert(host, path(2, Some("198.51.100.1")));
        assert_eq!(s.route_of(&lb, &paths), Some(via_pod));
        assert_eq!(s.guard_of(&lb, false, &paths), Some(7));
        // A pod's path that leads to its node (routed via the node, or a
        // tunnel's onlink far end): that path.
        paths.insert(host, path(2, None));
        for to_pod in [
            path(2, Some("198.51.100.2")),
            Path {
                onlink: true,
                ..path(9, Some("192.0.2.64"))
            },
        ] {
            paths.insert(pod, to_pod);
            assert_eq!(s.route_of(&lb, &paths), Some(NextHop::toward(pod, &to_pod)));
            assert_eq!(s.guard_of(&lb, false, &paths), Some(to_pod.entry));
        }
        assert_eq!(s.pods(), BTreeSet::from([pod, host]));
    }

    /// Two families' states read apart make one: every table of each,
    /// the planned-only ones included.
    #[test]
    fn merge_takes_in_every_table() {
        let v4 = DatapathState {
            svc_pod: BTreeMap::from([(ip("203.0.113.10"), ip("192.0.2.10"))]),
            filtered_pods: BTreeSet::from([ip("192.0.2.10")]),
            guard: BTreeMap::from([(ip("192.0.2.10"), 3)]),
            ..Default::default()
        };
        let v6 = DatapathState {
            svc_pod: BTreeMap::from([(ip("2001:db8::10"), ip("2001:db8:1::10"))]),
            remote_hosts: BTreeMap::from([(ip("2001:db8::11"), ip("2001:db8:2::1"))]),
            ..Default::default()
        };
        let mut merged = v4.clone();
        merged.merge(v6.clone());
        assert_eq!(merged.svc_pod.len(), 2);
        assert_eq!(merged.filtered_pods, v4.filtered_pods);
        assert_eq!(merged.guard, v4.guard);
        assert_eq!(merged.remote_hosts, v6.remote_hosts);
        assert_eq!(merged.len(), v4.len() + v6.len());
    }
}
