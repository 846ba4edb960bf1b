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
    /// Each namespace's mappings and what they need here.
    namespaces: BTreeMap<Arc<str>, Namespace>,
    /// The mappings over their namespace's share here.
    over: BTreeSet<IpAddr>,
}

/// One namespace's mappings on this node.
#[derive(Debug, Default)]
struct Namespace {
    /// Each mapping's LB IP and what it needs of the tables here.
    needs: BTreeMap<IpAddr, Entries>,
    /// Their sum: while it fits the share, nothing is over, and a change
    /// costs one mapping's needs, not a pass over the namespace.
    total: Entries,
    /// Its mappings over the share.
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
        self.namespaces.clear();
        self.over.clear();
        if self.limit.is_none() {
            return;
        }
        for (lb, result) in plan.results() {
            self.add(&lb, &result, me);
        }
        let names: Vec<Arc<str>> = self.namespaces.keys().cloned().collect();
        for ns in names {
            self.decide(&ns, plan);
        }
    }

    /// Follows the plan's `changes` (the plan already holds their new
    /// results) and turns them into this node's: each old result as this
    /// node applied it, each new one as it applies it now, and a change
    /// for each other LB IP whose namespace's decision flipped.
    pub fn gate_changes(
        &mut self,
        changes: &mut Vec<LbChange>,
        plan: &PlanState,
        me: NodeView<'_>,
    ) {
        let (flipped, before) = self.follow(changes, plan, me);
        for c in changes.iter_mut() {
            c.old = c.old.take().map(|r| gate_with(&before, &c.lb_ip, r));
            c.new = c.new.take().map(|r| self.gate(&c.lb_ip, r));
        }
        let touched: BTreeSet<IpAddr> = changes.iter().map(|c| c.lb_ip).collect();
        for lb in flipped.difference(&touched) {
            if let Some(r) = plan.result_of(lb) {
                changes.push(LbChange {
                    lb_ip: *lb,
                    old: Some(gate_with(&before, lb, r.clone())),
                    new: Some(self.gate(lb, r)),
                });
            }
        }
    }

    /// Decides the namespaces `changes` touch again. Returns the LB IPs
    /// whose decision flipped, and the mappings over their share before.
    fn follow(
        &mut self,
        changes: &[LbChange],
        plan: &PlanState,
        me: NodeView<'_>,
    ) -> (BTreeSet<IpAddr>, BTreeSet<IpAddr>) {
        if self.limit.is_none() {
            return (BTreeSet::new(), BTreeSet::new());
        }
        let before = self.over.clone();
        let mut touched = BTreeSet::new();
        for c in changes {
            if let Some(old) = &c.old {
                let name = &old.service().namespace;
                if let Some(ns) = self.namespaces.get_mut(name) {
                    if let Some(need) = ns.needs.remove(&c.lb_ip) {
                        ns.total = ns.total.minus(need);
                    }
                    ns.over.remove(&c.lb_ip);
                }
                touched.insert(Arc::clone(name));
            }
            self.over.remove(&c.lb_ip);
            if let Some(new) = &c.new {
                touched.insert(self.add(&c.lb_ip, new, me));
            }
        }
        for ns in touched {
            self.decide(&ns, plan);
        }
        let flipped = before.symmetric_difference(&self.over).copied().collect();
        (flipped, before)
    }

    /// Counts `result` of `lb` in its namespace (a mapping only); the
    /// namespace's name.
    fn add(&mut self, lb: &IpAddr, result: &LbResult, me: NodeView<'_>) -> Arc<str> {
        let name = Arc::clone(&result.service().namespace);
        if let LbResult::Mapped(_) = result {
            let mut part = StateBuilder::default();
            part.add_result(lb, result, me);
            let need = part.needs();
            let ns = self.namespaces.entry(Arc::clone(&name)).or_default();
            ns.total = ns.total.plus(need);
            ns.needs.insert(*lb, need);
        }
        name
    }

    /// Namespace `name` again: while its mappings fit the share together,
    /// none is over; else they are taken in rank order, each while it
    /// fits what the share has left.
    fn decide(&mut self, name: &Arc<str>, plan: &PlanState) {
        let Some(limit) = self.limit else { return };
        let Some(ns) = self.namespaces.get_mut(name) else {
            return;
        };
        for lb in std::mem::take(&mut ns.over) {
            self.over.remove(&lb);
        }
        if ns.needs.is_empty() {
            self.namespaces.remove(name);
            return;
        }
        if ns.total.fits(&limit) {
            return;
        }
        let mut ranked: Vec<(Option<&Rank>, IpAddr, Entries)> = (ns.needs.iter())
            .map(|(lb, need)| (plan.owner_rank(lb), *lb, *need))
            .collect();
        ranked.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let mut used = Entries::default();
        for (_, lb, need) in ranked {
            let after = used.plus(need);
            if after.fits(&limit) {
                used = after;
            } else {
                ns.over.insert(lb);
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
                let service = plan.result_of(lb)?.service().clone();
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
fn gate_with(over: &BTreeSet<IpAddr>, lb: &IpAddr, result: LbResult) -> LbResult {
    match result {
        LbResult::Mapped(m) if over.contains(lb) => LbResult::Unmapped(m.service),
        other => other,
    }
}
