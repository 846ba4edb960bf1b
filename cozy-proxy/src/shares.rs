//! Each namespace's share of a node's datapath tables
//! (`--namespace-share`, a percentage of each table): one tenant's Services
//! take at most that much of this node's tables, so that however many it
//! creates, the other tenants' Services keep room.
//!
//! Within a namespace the older Services come first (the plan's rank:
//! creation, then name), each LB IP taken whole or not at all; a mapping
//! beyond the share is not translated on this node: its LB IP is dropped
//! (fails closed, as an unmapped one) and reported on its Service
//! (`NamespaceShare`). A newer Service never pushes out an older one of
//! its namespace, and no namespace's Services ever push out another's.
//! Only mappings count: an unmapped LB IP takes one address, and the
//! capacity fitting bounds those with the whole table.
use crate::datapath::{Capacity, Entries, NodeView, StateBuilder};
use crate::model::{LbChange, LbResult, PlanState, Rank, Warning, WarningKind};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

#[derive(Debug, Default)]
pub struct Shares {
    /// What one namespace may hold here; `None`: no bound (100%).
    limit: Option<Entries>,
    /// The LB IPs of each namespace (of the Service owning each).
    members: BTreeMap<Arc<str>, BTreeSet<IpAddr>>,
    /// The mappings over their namespace's share here.
    over: BTreeSet<IpAddr>,
}

impl Shares {
    /// `percent` of each table of `capacity` per namespace.
    pub fn new(percent: u8, capacity: Capacity) -> Self {
        Shares {
            limit: (percent < 100).then(|| capacity.share(percent)),
            ..Default::default()
        }
    }

    /// Decides every namespace again from the whole plan.
    pub fn rebuild(&mut self, plan: &PlanState, me: NodeView<'_>) {
        self.members.clear();
        self.over.clear();
        if self.limit.is_none() {
            return;
        }
        for (lb, result) in plan.results() {
            let ns = Arc::clone(&service_of(&result).namespace);
            self.members.entry(ns).or_default().insert(lb);
        }
        let namespaces: Vec<Arc<str>> = self.members.keys().cloned().collect();
        for ns in namespaces {
            self.decide(&ns, plan, me);
        }
    }

    /// Follows the plan's `changes` (the plan already holds their new
    /// results): decides the namespaces they touch again. Returns the LB
    /// IPs whose decision flipped, and the mappings over their share
    /// before (to gate the changes' old results with).
    pub fn follow(
        &mut self,
        changes: &[LbChange],
        plan: &PlanState,
        me: NodeView<'_>,
    ) -> (BTreeSet<IpAddr>, BTreeSet<IpAddr>) {
        let before = self.over.clone();
        if self.limit.is_none() {
            return (BTreeSet::new(), before);
        }
        let mut touched = BTreeSet::new();
        for c in changes {
            if let Some(old) = &c.old {
                let ns = &service_of(old).namespace;
                if let Some(m) = self.members.get_mut(ns) {
                    m.remove(&c.lb_ip);
                }
                touched.insert(Arc::clone(ns));
            }
            if let Some(new) = &c.new {
                let ns = Arc::clone(&service_of(new).namespace);
                self.members
                    .entry(Arc::clone(&ns))
                    .or_default()
                    .insert(c.lb_ip);
                touched.insert(ns);
            }
            self.over.remove(&c.lb_ip);
        }
        for ns in touched {
            self.decide(&ns, plan, me);
        }
        let flipped = before.symmetric_difference(&self.over).copied().collect();
        (flipped, before)
    }

    /// Namespace `ns` again: its mappings in rank order, each while it fits
    /// what the share has left.
    fn decide(&mut self, ns: &Arc<str>, plan: &PlanState, me: NodeView<'_>) {
        let Some(limit) = self.limit else { return };
        let Some(lbs) = self.members.get(ns) else {
            return;
        };
        if lbs.is_empty() {
            self.members.remove(ns);
            return;
        }
        let mut ranked: Vec<(&Rank, IpAddr, Entries)> = Vec::with_capacity(lbs.len());
        for lb in lbs {
            self.over.remove(lb);
            let Some(result @ LbResult::Mapped(_)) = plan.result_of(lb) else {
                continue;
            };
            let Some(rank) = plan.owner_rank(lb) else {
                continue;
            };
            let mut part = StateBuilder::default();
            part.add_result(lb, &result, me);
            ranked.push((rank, *lb, part.needs()));
        }
        ranked.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let mut used = Entries::default();
        for (_, lb, need) in ranked {
            let after = used.plus(need);
            if after.fits(&limit) {
                used = after;
            } else {
                self.over.insert(lb);
            }
        }
    }

    /// `result` of `lb` as this node applies it: unmapped where it is over
    /// its namespace's share.
    pub fn gate(&self, lb: &IpAddr, result: LbResult) -> LbResult {
        gate_with(&self.over, lb, result)
    }

    /// One warning per mapping over its namespace's share, on its Service.
    pub fn warnings(&self, plan: &PlanState, node: &str) -> BTreeSet<Warning> {
        self.over
            .iter()
            .filter_map(|lb| {
                let service = service_of(&plan.result_of(lb)?).clone();
                Some(Warning {
                    message: format!(
                        "{lb} is not translated on {node}: namespace {} holds its share of \
                         the datapath's tables here (--namespace-share); its older Services \
                         come first",
                        service.namespace
                    ),
                    service,
                    kind: WarningKind::NamespaceShare,
                })
            })
            .collect()
    }
}

/// `result` of `lb`, unmapped if `lb` is in `over`.
pub fn gate_with(over: &BTreeSet<IpAddr>, lb: &IpAddr, result: LbResult) -> LbResult {
    match result {
        LbResult::Mapped(m) if over.contains(lb) => LbResult::Unmapped(m.service),
        other => other,
    }
}

fn service_of(r: &LbResult) -> &crate::model::ServiceRef {
    match r {
        LbResult::Mapped(m) => &m.service,
        LbResult::Unmapped(s) => s,
    }
}
