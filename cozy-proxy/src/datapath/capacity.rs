//! What a backend's kernel tables can hold, and fitting a state into it.
//!
//! The eBPF maps have fixed sizes; a hash map that is full refuses a new
//! key (E2BIG), which would fail the whole sync and leave every other
//! change unapplied. Instead the sync layer fits the desired state into
//! the backend's capacity before the diff: LB IPs are taken whole (a
//! mapping is never half in the kernel), those the kernel already holds
//! first, at no more than it holds for them (a new Service, or one that
//! grew, never pushes out a working one), the rest in address order while
//! they fit. An LB IP left out becomes an unmapped
//! one where an address is still free (its traffic is dropped rather than
//! routed back out), and is reported.
use super::{DatapathState, StateDiff};
use crate::model::IpRange;
use serde::Serialize;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

/// A kind of kernel table entry a backend may run out of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Table {
    /// Mapped pods, LB IPs (local and remote) and unmapped LB IPs.
    Addresses,
    /// Mappings translated on this node (each has its counters).
    LocalMappings,
    /// `(pod, protocol, port)` of filtered pods hosted here.
    AllowedPorts,
    /// Source-range prefixes, over all LB IPs.
    SourcePrefixes,
}

impl Table {
    pub const ALL: [Table; 4] = [
        Table::Addresses,
        Table::LocalMappings,
        Table::AllowedPorts,
        Table::SourcePrefixes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Table::Addresses => "addresses",
            Table::LocalMappings => "local_mappings",
            Table::AllowedPorts => "allowed_ports",
            Table::SourcePrefixes => "source_prefixes",
        }
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Entries of each [`Table`]: what a state needs, or what a backend holds
/// at most.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entries([usize; 4]);

/// What a backend's tables hold at most.
pub type Capacity = Entries;

impl Entries {
    /// No limit (nf_tables sets grow as needed).
    pub const UNLIMITED: Entries = Entries([usize::MAX; 4]);

    pub const fn new(
        addresses: usize,
        local_mappings: usize,
        allowed_ports: usize,
        source_prefixes: usize,
    ) -> Self {
        Entries([addresses, local_mappings, allowed_ports, source_prefixes])
    }

    pub fn get(&self, t: Table) -> usize {
        self.0[t as usize]
    }

    /// What `s` needs (an upper bound: an address that is both a pod and
    /// another Service's LB IP takes one entry, counted twice).
    pub fn of_state(s: &DatapathState) -> Self {
        Entries::tally(
            s.pod_svc.len(),
            s.svc_pod.len(),
            s.remote.len(),
            s.unmapped_lbs.len(),
            s.allowed_ports.len(),
            prefixes(&s.source_ranges),
        )
    }

    /// What elements of a state need, by collection: a remote mapping's
    /// LB IP and pod both have an address entry.
    pub(super) fn tally(
        pod_svc: usize,
        svc_pod: usize,
        remote: usize,
        unmapped_lbs: usize,
        allowed_ports: usize,
        source_prefixes: usize,
    ) -> Self {
        Entries([
            pod_svc + svc_pod + 2 * remote + unmapped_lbs,
            // A local mapping is in both (one pod per LB IP); the larger
            // count bounds either table (eBPF counter slots, nft maps).
            svc_pod.max(pod_svc),
            allowed_ports,
            source_prefixes,
        ])
    }

    pub fn plus(self, other: Entries) -> Self {
        Entries(std::array::from_fn(|i| {
            self.0[i].saturating_add(other.0[i])
        }))
    }

    pub fn minus(self, other: Entries) -> Self {
        Entries(std::array::from_fn(|i| {
            self.0[i].saturating_sub(other.0[i])
        }))
    }

    /// The tables where `self` exceeds `cap`.
    pub fn over(&self, cap: &Capacity) -> Vec<Table> {
        Table::ALL
            .into_iter()
            .filter(|t| self.get(*t) > cap.get(*t))
            .collect()
    }

    pub fn fits(&self, cap: &Capacity) -> bool {
        self.over(cap).is_empty()
    }

    /// `percent` of each table (an unlimited one stays unlimited).
    pub fn share(self, percent: u8) -> Self {
        Entries(self.0.map(|n| {
            if n == usize::MAX {
                n
            } else {
                n / 100 * percent as usize + n % 100 * percent as usize / 100
            }
        }))
    }
}

/// The prefixes `ranges` take (the eBPF trie holds each range as prefixes).
pub(super) fn prefixes<'a>(ranges: impl IntoIterator<Item = &'a (IpAddr, IpRange)>) -> usize {
    ranges.into_iter().map(|(_, r)| r.cidrs().len()).sum()
}

impl StateDiff {
    /// What its additions and its removals need (as [`Entries::of_state`]
    /// counts): O(the change).
    pub fn needs(&self) -> (Entries, Entries) {
        let side = |add: bool| {
            Entries::tally(
                self.pod_svc.side(add).len(),
                self.svc_pod.side(add).len(),
                self.remote.side(add).len(),
                self.unmapped_lbs.side(add).len(),
                self.allowed_ports.side(add).len(),
                prefixes(self.source_ranges.side(add)),
            )
        };
        (side(true), side(false))
    }
}

/// What did not fit: LB IPs left out of the kernel, and the tables that
/// were full.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Overflow {
    /// LB IPs (mapped or not in the plan) whose mapping is not in the
    /// kernel; each is dropped as an unmapped LB IP where an address was
    /// still free.
    pub left_out: Vec<IpAddr>,
    /// The tables that could not take them.
    pub full: Vec<Table>,
}

impl Overflow {
    pub fn is_empty(&self) -> bool {
        self.left_out.is_empty()
    }
}

impl DatapathState {
    /// Fits `self` (before its paths are resolved: it holds no guards or
    /// routes yet) into `cap`, keeping first the LB IPs `kept` holds (what
    /// the kernel has now). Returns what was left out and what `self`
    /// needs now; `self` is unchanged when everything fits.
    pub fn fit(&mut self, cap: &Capacity, kept: Option<&DatapathState>) -> (Overflow, Entries) {
        let needs = Entries::of_state(self);
        if needs.fits(cap) {
            return (Overflow::default(), needs);
        }
        let needs = self.needs_by_lb();
        // Held: mapped there and here, or unmapped in both. An LB IP left
        // out before (held unmapped, now mapped) is not ahead of the others.
        let mapped = |s: &DatapathState, lb: &IpAddr| {
            s.svc_pod.contains_key(lb) || s.remote.contains_key(lb)
        };
        let holds = |lb: &IpAddr| {
            kept.is_some_and(|k| {
                if mapped(self, lb) {
                    mapped(k, lb)
                } else {
                    k.unmapped_lbs.contains(lb) && !mapped(k, lb)
                }
            })
        };
        // Held and needing no more than the kernel holds for them first,
        // then held LB IPs that grew, then the rest; each group in address
        // order (the map's order, kept by the stable sort). So one
        // Service's growth never pushes out another that works: the one
        // that grew is left out itself when there is no room.
        let held_needs = kept.map(DatapathState::needs_by_lb).unwrap_or_default();
        let rank = |lb: &IpAddr, need: &Entries| match held_needs.get(lb) {
            Some(was) if holds(lb) && need.fits(was) => 0,
            _ if holds(lb) => 1,
            _ => 2,
        };
        let mut order: Vec<(&IpAddr, &Entries)> = needs.iter().collect();
        order.sort_by_key(|(lb, need)| rank(lb, need));
        let mut used = Entries::default();
        let mut full = BTreeSet::new();
        let mut left_out = Vec::new();
        for (lb, need) in order {
            let after = used.plus(*need);
            match after.over(cap).as_slice() {
                [] => used = after,
                over => {
                    full.extend(over.iter().copied());
                    left_out.push(*lb);
                }
            }
        }
        self.leave_out(&left_out);
        // Dropped rather than routed on, where an address is free.
        let mut free = cap
            .get(Table::Addresses)
            .saturating_sub(used.get(Table::Addresses));
        for lb in &left_out {
            if free == 0 {
                break;
            }
            self.unmapped_lbs.insert(*lb);
            free -= 1;
        }
        left_out.sort();
        let overflow = Overflow {
            left_out,
            full: full.into_iter().collect(),
        };
        (overflow, Entries::of_state(self))
    }

    /// What each LB IP's part of the state needs.
    fn needs_by_lb(&self) -> BTreeMap<IpAddr, Entries> {
        let mut ports: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for p in &self.allowed_ports {
            *ports.entry(p.pod).or_default() += 1;
        }
        let mut prefixes: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for range in &self.source_ranges {
            *prefixes.entry(range.0).or_default() += self::prefixes([range]);
        }
        let prefixes_of = |lb: &IpAddr| prefixes.get(lb).copied().unwrap_or(0);
        let mut needs = BTreeMap::new();
        for (lb, pod) in &self.svc_pod {
            let ports = ports.get(pod).copied().unwrap_or(0);
            needs.insert(*lb, Entries::new(2, 1, ports, prefixes_of(lb)));
        }
        for lb in self.remote.keys() {
            needs.insert(*lb, Entries::new(2, 0, 0, prefixes_of(lb)));
        }
        for lb in &self.unmapped_lbs {
            needs.insert(*lb, Entries::new(1, 0, 0, 0));
        }
        needs
    }

    /// Removes every element of the LB IPs `lbs` (and of their pods).
    fn leave_out(&mut self, lbs: &[IpAddr]) {
        let lbs: BTreeSet<IpAddr> = lbs.iter().copied().collect();
        let mut pods = BTreeSet::new();
        for lb in &lbs {
            if let Some(pod) = self.svc_pod.remove(lb) {
                self.pod_svc.remove(&pod);
                self.filtered_pods.remove(&pod);
                self.icmp_allowed_pods.remove(&pod);
                pods.insert(pod);
            }
            self.remote.remove(lb);
            self.unmapped_lbs.remove(lb);
            self.ranged_lbs.remove(lb);
        }
        self.allowed_ports.retain(|p| !pods.contains(&p.pod));
        self.source_ranges.retain(|(lb, _)| !lbs.contains(lb));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::AllowedPort;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    /// Three local filtered mappings with `ports` ports each, and one
    /// unmapped LB IP.
    fn state(ports: u16) -> DatapathState {
        let mut s = DatapathState::default();
        for i in 1..=3u8 {
            let (lb, pod) = (ip(&format!("203.0.113.{i}")), ip(&format!("192.0.2.{i}")));
            s.svc_pod.insert(lb, pod);
            s.pod_svc.insert(pod, lb);
            s.filtered_pods.insert(pod);
            s.allowed_ports.extend((1..=ports).map(|port| AllowedPort {
                pod,
                proto: 6,
                port,
            }));
        }
        s.unmapped_lbs.insert(ip("203.0.113.99"));
        s
    }

    #[test]
    fn a_state_that_fits_is_unchanged() {
        let mut s = state(10);
        let before = s.clone();
        assert!(s.fit(&Entries::new(7, 3, 30, 0), None).0.is_empty());
        assert_eq!(s, before);
    }

    #[test]
    fn whole_lb_ips_are_left_out_the_held_ones_kept_and_the_rest_dropped_as_unmapped() {
        let mut s = state(10);
        // Room for two mappings' ports; .1 is new, .2 and .3 are held.
        let mut held = state(10);
        held.svc_pod.remove(&ip("203.0.113.1"));
        let (over, needs) = s.fit(&Entries::new(100, 3, 25, 0), Some(&held));
        assert_eq!(needs, Entries::of_state(&s));
        assert_eq!(over.left_out, vec![ip("203.0.113.1")]);
        assert_eq!(over.full, vec![Table::AllowedPorts]);
        assert!(!s.svc_pod.contains_key(&ip("203.0.113.1")));
        assert!(!s.pod_svc.contains_key(&ip("192.0.2.1")));
        assert!(!s.filtered_pods.contains(&ip("192.0.2.1")));
        assert!(s.allowed_ports.iter().all(|p| p.pod != ip("192.0.2.1")));
        assert_eq!(s.allowed_ports.len(), 20);
        assert!(s.unmapped_lbs.contains(&ip("203.0.113.1")));
        assert!(Entries::of_state(&s)
            .over(&Entries::new(100, 3, 25, 0))
            .is_empty());

        // Without a kernel state to keep, address order decides; a smaller
        // LB IP later in the order still takes the room left.
        let mut s = state(10);
        let (over, _) = s.fit(&Entries::new(100, 2, 100, 0), None);
        assert_eq!(over.left_out, vec![ip("203.0.113.3")]);
        assert_eq!(over.full, vec![Table::LocalMappings]);
        assert!(s.unmapped_lbs.contains(&ip("203.0.113.99")));
    }

    /// A held Service that grows (more ports) comes after the held ones
    /// that did not: it is left out itself rather than push out another
    /// tenant's working Service at a higher address.
    #[test]
    fn a_service_that_grows_never_pushes_out_another_that_works() {
        let held = state(10);
        let mut s = state(10);
        let grown = ip("192.0.2.1");
        s.allowed_ports.extend((11..=20).map(|port| AllowedPort {
            pod: grown,
            proto: 6,
            port,
        }));
        let (over, _) = s.fit(&Entries::new(100, 3, 35, 0), Some(&held));
        assert_eq!(over.left_out, vec![ip("203.0.113.1")]);
        assert!(s.svc_pod.contains_key(&ip("203.0.113.2")));
        assert!(s.svc_pod.contains_key(&ip("203.0.113.3")));
        // A held one that shrank or stayed keeps its place.
        let mut s = state(5);
        let (over, _) = s.fit(&Entries::new(100, 2, 100, 0), Some(&held));
        assert_eq!(over.left_out, vec![ip("203.0.113.3")]);
    }

    #[test]
    fn with_no_address_free_a_left_out_lb_ip_is_not_in_the_state_at_all() {
        let mut s = state(1);
        let (over, _) = s.fit(&Entries::new(5, 3, 100, 0), None);
        // 2 + 2 addresses for .1 and .2, the unmapped .99 takes the last;
        // .3 is left out entirely.
        assert_eq!(over.left_out, vec![ip("203.0.113.3")]);
        assert!(!s.unmapped_lbs.contains(&ip("203.0.113.3")));
        assert!(!s.svc_pod.contains_key(&ip("203.0.113.3")));
        assert_eq!(Entries::of_state(&s).get(Table::Addresses), 5);
    }
}
