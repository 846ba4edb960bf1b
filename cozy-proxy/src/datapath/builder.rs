//! A [`DatapathState`] built from many LB IPs' outcomes at once: their
//! elements gathered as lists, each sorted once into its collection, not
//! inserted one by one (a search from the root per element), and the trees
//! built packed.
use super::capacity::Entries;
use super::state::{AllowedPort, DatapathState, NodeView, StateDiff};
use crate::model::{merge_ranges, Cidr, IpRange, LbChange, LbResult, Mapping, Mode, Plan};
use std::{collections::BTreeSet, net::IpAddr};

#[derive(Default)]
pub struct StateBuilder {
    pod_svc: Vec<(IpAddr, IpAddr)>,
    svc_pod: Vec<(IpAddr, IpAddr)>,
    remote: Vec<(IpAddr, IpAddr)>,
    remote_hosts: Vec<(IpAddr, IpAddr)>,
    filtered_pods: Vec<IpAddr>,
    allowed_ports: Vec<AllowedPort>,
    icmp_allowed_pods: Vec<IpAddr>,
    unmapped_lbs: Vec<IpAddr>,
    ranged_lbs: Vec<IpAddr>,
    source_ranges: Vec<(IpAddr, IpRange)>,
}

impl StateBuilder {
    /// Adds what one owned LB IP puts in node `me`'s datapath. The elements
    /// of two LB IPs never share a key (a plan maps each LB IP and each pod
    /// IP once): a state is the sum of its LB IPs' parts.
    pub fn add_result(&mut self, lb_ip: &IpAddr, result: &LbResult, me: NodeView<'_>) {
        match result {
            LbResult::Mapped(m) => self.add_mapping(m, me),
            LbResult::Unmapped(_) => self.unmapped_lbs.push(*lb_ip),
        }
    }

    pub fn add_mapping(&mut self, m: &Mapping, me: NodeView<'_>) {
        if let Some(ranges) = &m.source_ranges {
            self.ranged_lbs.push(m.lb_ip);
            self.source_ranges.extend(
                merge_ranges(ranges.iter().copied())
                    .into_iter()
                    .map(|r| (m.lb_ip, r)),
            );
        }
        if !me.hosts(m) {
            self.remote.push((m.lb_ip, m.pod_ip));
            self.remote_hosts
                .extend(me.host_address_of(m).map(|h| (m.lb_ip, h)));
            return;
        }
        self.pod_svc.push((m.pod_ip, m.lb_ip));
        self.svc_pod.push((m.lb_ip, m.pod_ip));
        if let Mode::PortFilter { ports, allow_icmp } = &*m.mode {
            self.filtered_pods.push(m.pod_ip);
            if *allow_icmp {
                self.icmp_allowed_pods.push(m.pod_ip);
            }
            self.allowed_ports.extend(ports.iter().map(|p| AllowedPort {
                pod: m.pod_ip,
                proto: p.protocol.number(),
                port: p.port,
            }));
        }
    }

    /// What everything added needs of the kernel's tables (as
    /// [`Entries::of_state`] counts the state it builds).
    pub fn needs(&self) -> Entries {
        Entries::tally(
            self.pod_svc.len(),
            self.svc_pod.len(),
            self.remote.len(),
            self.unmapped_lbs.len(),
            self.allowed_ports.len(),
            super::capacity::prefixes(&self.source_ranges),
        )
    }

    /// The state of everything added, holding `cluster` as its in-cluster
    /// ranges (without `guard` and `routes`). A key added twice keeps its
    /// last value, as an insert would.
    pub fn build(self, cluster: &BTreeSet<Cidr>) -> DatapathState {
        DatapathState {
            pod_svc: self.pod_svc.into_iter().collect(),
            svc_pod: self.svc_pod.into_iter().collect(),
            remote: self.remote.into_iter().collect(),
            filtered_pods: self.filtered_pods.into_iter().collect(),
            allowed_ports: self.allowed_ports.into_iter().collect(),
            icmp_allowed_pods: self.icmp_allowed_pods.into_iter().collect(),
            unmapped_lbs: self.unmapped_lbs.into_iter().collect(),
            cluster: merge_ranges(cluster.iter().copied()),
            ranged_lbs: self.ranged_lbs.into_iter().collect(),
            source_ranges: self.source_ranges.into_iter().collect(),
            guard: Default::default(),
            routes: Default::default(),
            remote_hosts: self.remote_hosts.into_iter().collect(),
        }
    }
}

impl DatapathState {
    /// What node `me` holds for `plan` (without `guard` and `routes`, which
    /// [`DatapathState::resolve`] adds from the kernel's paths).
    pub fn for_node(plan: &Plan, cluster: &BTreeSet<Cidr>, me: NodeView<'_>) -> Self {
        let mut s = StateBuilder::default();
        for m in &plan.mappings {
            s.add_mapping(m, me);
        }
        let mut s = s.build(cluster);
        s.unmapped_lbs = plan.unmapped_lb_ips.keys().copied().collect();
        s
    }

    /// What turns the state of `changes`' old outcomes, as node `was` held
    /// them, into their new ones as node `me` holds them (without `guard`
    /// and `routes`): O(the changes), and exactly the difference of the
    /// two whole states, since the parts of two LB IPs never share a key.
    pub fn change_of(changes: &[LbChange], was: NodeView<'_>, me: NodeView<'_>) -> StateDiff {
        let (mut old, mut new) = (StateBuilder::default(), StateBuilder::default());
        for c in changes {
            if let Some(r) = &c.old {
                old.add_result(&c.lb_ip, r, was);
            }
            if let Some(r) = &c.new {
                new.add_result(&c.lb_ip, r, me);
            }
        }
        let none = BTreeSet::new();
        old.build(&none).diff(&new.build(&none))
    }
}
