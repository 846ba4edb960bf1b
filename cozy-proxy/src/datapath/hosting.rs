//! Which node translates a mapping whose pod IP two nodes' endpoints hold
//! (a VM live-migrating: the source and the target pod share its IP).
//! Each of them translates it, unless the kernel's route to the pod IP
//! delivers it at the other: then it steers the LB IP there, untranslated,
//! so that one node (the one the VM's traffic passes) holds its flows.
use super::state::{away_via, shared_pods, shared_with, Elsewhere, NodeView};
use super::PathOf;
use crate::model::{cluster::NodeAddresses, LbChange, LbResult, Mapping};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// A mapping several nodes' endpoints hold, this node among them, and
/// whether this node translates it: where the kernel's route to its pod
/// does not lead to another of those nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedMapping {
    pub lb_ip: IpAddr,
    /// The nodes its endpoints name, comma-separated.
    pub nodes: String,
    pub translated_here: bool,
    /// Why: where the kernel's route to the pod leads.
    pub why: String,
}

/// The mappings this node shares with another node, and which of their
/// pods the kernel delivers elsewhere. A few at a time (the VMs migrating
/// now): decided again at every round, from the kernel's paths.
#[derive(Debug, Default)]
pub struct Sharing {
    /// By LB IP: the mappings whose endpoints name this node and another.
    shared: BTreeMap<IpAddr, Mapping>,
    /// Their pods delivered at another of their nodes ([`away_via`]).
    away: BTreeSet<IpAddr>,
    /// Where the routes to those pods lead.
    routes: BTreeMap<IpAddr, Elsewhere>,
}

impl Sharing {
    /// The mappings of `results` shared by node `me` (`None`: a standalone
    /// node shares nothing).
    pub fn of(results: impl Iterator<Item = (IpAddr, LbResult)>, me: Option<&str>) -> Self {
        let mut s = Sharing::default();
        if let Some(me) = me {
            for (lb, result) in results {
                s.follow(lb, Some(&result), me);
            }
        }
        s
    }

    /// The same, keeping `previous`'s decision: the next
    /// [`Sharing::decide`] reports only what moved since it (a full round
    /// rebuilds the shared mappings, not where their pods are).
    pub fn carrying(mut self, previous: Sharing) -> Self {
        self.away = previous.away;
        self.routes = previous.routes;
        self
    }

    /// Follows the plan's `changes`.
    pub fn follow_changes(&mut self, changes: &[LbChange], me: Option<&str>) {
        if let Some(me) = me {
            for c in changes {
                self.follow(c.lb_ip, c.new.as_ref(), me);
            }
        }
    }

    fn follow(&mut self, lb: IpAddr, result: Option<&LbResult>, me: &str) {
        self.shared.remove(&lb);
        match result {
            Some(LbResult::Mapped(m)) if shared_with(m, me) => {
                self.shared.insert(lb, m.clone());
            }
            _ => {}
        }
    }

    /// The pods the kernel's routes will be asked about.
    pub fn pods(&self) -> BTreeSet<IpAddr> {
        self.shared.values().map(|m| m.pod_ip).collect()
    }

    pub fn away(&self) -> &BTreeSet<IpAddr> {
        &self.away
    }

    /// Decides again from `paths` (toward [`Sharing::pods`]): the changes
    /// of the LB IPs whose node changed, their result as it is (what this
    /// node holds of them moves between translated and steered). The
    /// previous decision is returned with them: the caller's old parts
    /// are of it.
    pub fn decide(
        &mut self,
        me: Option<&str>,
        addresses: &NodeAddresses,
        paths: &impl PathOf,
    ) -> (BTreeSet<IpAddr>, Vec<LbChange>) {
        let Some(me) = me else {
            return (BTreeSet::new(), Vec::new());
        };
        let by_pod = shared_pods(self.shared.values(), me);
        self.routes = away_via(&by_pod, me, addresses, paths);
        let now: BTreeSet<IpAddr> = self.routes.keys().copied().collect();
        let moved: Vec<LbChange> = (now.symmetric_difference(&self.away))
            .filter_map(|pod| by_pod.get(pod))
            .map(|m| LbChange {
                lb_ip: m.lb_ip,
                old: Some(LbResult::Mapped((*m).clone())),
                new: Some(LbResult::Mapped((*m).clone())),
            })
            .collect();
        (std::mem::replace(&mut self.away, now), moved)
    }

    /// What was decided, per shared mapping (for metrics).
    pub fn report(&self) -> Vec<SharedMapping> {
        self.shared
            .values()
            .map(|m| SharedMapping {
                lb_ip: m.lb_ip,
                nodes: (m.hosts.nodes().iter().map(|n| &**n))
                    .collect::<Vec<_>>()
                    .join(","),
                translated_here: !self.away.contains(&m.pod_ip),
                why: self.why(m.pod_ip),
            })
            .collect()
    }

    /// Why `pod` is translated here, or steered (for logs and metrics).
    pub fn why(&self, pod: IpAddr) -> String {
        match self.routes.get(&pod) {
            Some(elsewhere) => elsewhere.to_string(),
            None => "endpoint here; no route to the pod leads to another of its nodes".into(),
        }
    }

    /// Node `me`'s view with the current decision.
    pub fn view<'a>(&'a self, me: NodeView<'a>) -> NodeView<'a> {
        NodeView {
            away: &self.away,
            ..me
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::state::migrating_vm;
    use crate::datapath::Path;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    /// A full round rebuilds the shared mappings: a decision that did not
    /// change is not reported as a move again.
    #[test]
    fn a_full_round_reports_only_what_moved() {
        let (lb, pod) = (ip("203.0.113.10"), ip("192.0.2.20"));
        let m = migrating_vm(lb, pod);
        let results = || [(lb, LbResult::Mapped(m.clone()))].into_iter();
        let addresses: NodeAddresses = (1..=2)
            .map(|k| (format!("n{k}"), vec![ip(&format!("198.51.100.{}", 1 + k))]))
            .collect();
        // n2's route to the pod leads to n1.
        let paths = BTreeMap::from([(
            pod,
            Path {
                oif: 2,
                gateway: Some(ip("198.51.100.2")),
                onlink: false,
                entry: 2,
                src: None,
            },
        )]);
        let mut first = Sharing::of(results(), Some("n2"));
        let (_, moved) = first.decide(Some("n2"), &addresses, &paths);
        assert_eq!(moved.len(), 1, "the first decision is a move");
        assert_eq!(first.why(pod), "route via 198.51.100.2 (n1)");
        let mut rebuilt = Sharing::of(results(), Some("n2")).carrying(first);
        let (was, moved) = rebuilt.decide(Some("n2"), &addresses, &paths);
        assert!(moved.is_empty(), "nothing moved: {moved:?}");
        assert_eq!(was, BTreeSet::from([pod]));
        let mut forgetful = Sharing::of(results(), Some("n2"));
        let (_, moved) = forgetful.decide(Some("n2"), &addresses, &paths);
        assert_eq!(
            moved.len(),
            1,
            "without the previous decision, a move again"
        );
    }
}
