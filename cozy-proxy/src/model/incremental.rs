//! The plan kept up to date one Service at a time: O(what an event
//! touches) per change instead of O(every Service). [`compute_plan`] stays
//! the reference (and the resync's safety net): after any sequence of
//! updates, [`PlanState::outcome`] equals it on the same objects (a property
//! test checks this).
//!
//! What couples Services is the conflict rules: an LB IP belongs to its
//! oldest claimant (whether or not it has a ready endpoint), and a pod IP to
//! the oldest LB owner whose endpoint it is. So a change of one Service can
//! change the outcome of its own LB IPs, and of the LB IPs that claim the
//! same pods (two steps, never further: pod ownership does not feed back
//! into LB ownership).
//!
//! [`compute_plan`]: super::compute_plan
use super::endpoints::{ReadSlice, SliceIndex};
use super::plan::{
    lb_conflict, pod_conflict, pod_is_an_lb_ip, read_chosen, wish_of, Forbidden, Outcome, Rank,
    Wish,
};
use super::service::ReadService;
use super::types::{LbResult, Mode, Plan, ServiceRef};
use super::warning::{Warning, WarningKind};
use super::{FastMap, FastSet};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use smallvec::SmallVec;
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

/// One Service's objects as they are now.
#[derive(Clone, Debug)]
pub struct ServiceObjects {
    pub service: ServiceRef,
    /// What the model reads of it; `None`: deleted, or not ours.
    pub read: Option<Arc<ReadService>>,
    /// The EndpointSlices labelled with its name, as the model reads them.
    pub slices: Vec<Arc<ReadSlice>>,
}

#[derive(Default)]
pub struct PlanState {
    /// The addresses never translated (the nodes' own, the reserved
    /// ranges). A change of them changes every wish: the state is built
    /// again ([`PlanState::build`]).
    forbidden: Forbidden,
    /// By Service (the name its wish holds).
    wishes: FastSet<Wished>,
    /// Every LB IP asked for: its claimants, the pod its owner claims, its
    /// outcome (one table, not three keyed alike).
    lbs: FastMap<IpAddr, LbState>,
    /// Pod IP -> the LB owners whose one endpoint it is (rank, LB IP); the
    /// first gets the pod.
    pod_claims: FastMap<IpAddr, Claims<(Rank, IpAddr)>>,
    /// The conflict warnings about one LB IP (its losers, its owner's pod).
    conflicts: FastMap<IpAddr, Vec<Warning>>,
    /// Every current warning, with how many places raise it (the plan's
    /// list holds each once).
    warnings: BTreeMap<Warning, u32>,
    /// LB IPs changed since the last [`PlanState::take_changes`], with the
    /// result they had then.
    changed: BTreeMap<IpAddr, Option<LbResult>>,
    /// Changes are not recorded: the state is being built whole
    /// ([`PlanState::build_with`]), and its first outcome is all new:
    /// recording it would hold a copy of the whole plan for nothing.
    building: bool,
    /// Warnings that came or went since the last
    /// [`PlanState::take_warning_changes`], with whether they were there.
    flipped: BTreeMap<Warning, bool>,
    summary: PlanSummary,
}

/// A Service's wish, found by the Service's name it holds (no second copy
/// of the name as a key).
struct Wished(Wish);

impl Wished {
    fn service(&self) -> &ServiceRef {
        &self.0.intent().service
    }
}

impl Borrow<ServiceRef> for Wished {
    fn borrow(&self) -> &ServiceRef {
        self.service()
    }
}

impl std::hash::Hash for Wished {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.service().hash(state)
    }
}

impl PartialEq for Wished {
    fn eq(&self, other: &Self) -> bool {
        self.service() == other.service()
    }
}

impl Eq for Wished {}

/// What the state keeps of one LB IP; it goes when it holds nothing.
#[derive(Default)]
struct LbState {
    /// Its claimants; the first is the owner.
    claims: Claims<Rank>,
    /// The pod its owner claims in `pod_claims`.
    claimed_pod: Option<IpAddr>,
    /// Its outcome, if owned, in short: the rest of it is read from its
    /// owner's wish when asked ([`PlanState::result_of`]).
    result: Option<Settled>,
}

impl LbState {
    fn is_empty(&self) -> bool {
        self.claims.is_empty() && self.claimed_pod.is_none() && self.result.is_none()
    }
}

/// What an owned LB IP came to, as the state keeps it: its pod only, not
/// a whole [`Mapping`] (the owner's name, mode, node and ranges are all in
/// its wish already).
///
/// [`Mapping`]: super::types::Mapping
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// Translated to `pod`; `filtered`: in port-filter mode (for the
    /// summary).
    Mapped {
        pod: IpAddr,
        filtered: bool,
    },
    Unmapped,
}

/// The claimants of one address, oldest first. Nearly always one, held in
/// place (a sorted Vec cost an allocation per address; a BTreeSet ~1 KiB
/// per address at 10 000 Services).
struct Claims<T>(SmallVec<[T; 1]>);

impl<T> Default for Claims<T> {
    fn default() -> Self {
        Claims(SmallVec::new())
    }
}

impl<T: Ord> Claims<T> {
    fn insert(&mut self, x: T) {
        if let Err(i) = self.0.binary_search(&x) {
            self.0.insert(i, x);
        }
    }

    fn remove(&mut self, x: &T) {
        if let Ok(i) = self.0.binary_search(x) {
            self.0.remove(i);
        }
    }

    /// Removes the claims `f` picks.
    fn remove_where(&mut self, f: impl Fn(&T) -> bool) {
        self.0.retain(|x| !f(x));
    }

    fn first(&self) -> Option<&T> {
        self.0.first()
    }

    fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The plan in numbers, kept as it changes (for the metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanSummary {
    pub passthrough: usize,
    pub port_filter: usize,
    pub unmapped: usize,
    /// Distinct warnings by kind.
    pub warnings: BTreeMap<WarningKind, usize>,
}

impl PlanSummary {
    fn count(&mut self, s: Settled, add: bool) {
        let n = match s {
            Settled::Mapped {
                filtered: false, ..
            } => &mut self.passthrough,
            Settled::Mapped { filtered: true, .. } => &mut self.port_filter,
            Settled::Unmapped => &mut self.unmapped,
        };
        if add {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
        }
    }

    fn count_warning(&mut self, kind: WarningKind, add: bool) {
        let n = self.warnings.entry(kind).or_default();
        if add {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
        }
    }
}

/// One LB IP whose outcome changed: what it was, what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LbChange {
    pub lb_ip: IpAddr,
    pub old: Option<LbResult>,
    pub new: Option<LbResult>,
}

impl PlanState {
    /// The state of every Service at once (as [`super::compute_plan`] reads
    /// them).
    pub fn build<S, E>(services: &[S], slices: &[E], nodes: &[Node]) -> Self
    where
        S: Borrow<Service>,
        E: Borrow<EndpointSlice>,
    {
        Self::build_with(services, slices, &[], nodes)
    }

    /// As [`PlanState::build`], with Services given as objects or as what
    /// the model reads of them and their slices (`read`).
    pub fn build_with<S, E>(
        services: &[S],
        slices: &[E],
        read: &[ServiceObjects],
        nodes: &[Node],
    ) -> Self
    where
        S: Borrow<Service>,
        E: Borrow<EndpointSlice>,
    {
        Self::build_forbidding(services, slices, read, Forbidden::new(nodes, &[]))
    }

    /// As [`PlanState::build_with`], with the addresses never translated
    /// given whole.
    pub fn build_forbidding<S, E>(
        services: &[S],
        slices: &[E],
        read: &[ServiceObjects],
        forbidden: Forbidden,
    ) -> Self
    where
        S: Borrow<Service>,
        E: Borrow<EndpointSlice>,
    {
        let mut state = PlanState {
            forbidden,
            building: true,
            ..Default::default()
        };
        // Room for every Service at once: a table grown by doubling
        // rehashes it about 16 times on the way to 50 000 (time, and the
        // old and new tables held together).
        let n = services.len() + read.len();
        state.wishes.reserve(n);
        state.lbs.reserve(n);
        state.pod_claims.reserve(n);
        let index = SliceIndex::new(slices);
        let mut by_name: BTreeMap<ServiceRef, Vec<&Service>> = BTreeMap::new();
        for svc in services.iter().map(Borrow::borrow) {
            by_name
                .entry(super::service::service_ref(svc))
                .or_default()
                .push(svc);
        }
        for (service, objects) in by_name {
            let read = read_chosen(&objects).map(Arc::new);
            state.update_read(&service, read, &index.slices_of(&service));
        }
        for o in read {
            let slices: Vec<&ReadSlice> = o.slices.iter().map(AsRef::as_ref).collect();
            state.update_read(&o.service, o.read.clone(), &slices);
        }
        state.building = false;
        state
    }

    /// Service `service` is now `objects` (none: deleted; several: a broken
    /// input, settled as the full computation does) with `slices`.
    pub fn update(
        &mut self,
        service: &ServiceRef,
        objects: &[&Service],
        slices: &[&EndpointSlice],
    ) {
        let read: Vec<ReadSlice> = slices
            .iter()
            .filter_map(|e| ReadSlice::of_alone(e))
            .collect();
        let read_slices: Vec<&ReadSlice> = read.iter().collect();
        self.update_read(service, read_chosen(objects).map(Arc::new), &read_slices);
    }

    /// As [`PlanState::update`], from what the model reads of the Service
    /// and its slices.
    pub fn update_read(
        &mut self,
        service: &ServiceRef,
        read: Option<Arc<ReadService>>,
        slices: &[&ReadSlice],
    ) {
        // Kept by the name it holds: the one it is updated by.
        debug_assert!(read.as_ref().is_none_or(|r| r.intent.service == *service));
        let new = read.map(|r| wish_of(r, slices, &self.forbidden));
        // The results of this Service's LB IPs as they are, before its
        // wish (which they are read from) is replaced.
        let lbs_before: Vec<IpAddr> = (self.wishes.get(service).map(|w| &w.0).into_iter())
            .chain(&new)
            .flat_map(|w| w.candidates.iter().map(|c| c.lb_ip))
            .collect();
        for lb in lbs_before {
            self.record_before_change(lb);
        }
        let mut lbs = BTreeSet::new();
        if let Some(Wished(old)) = self.wishes.take(service) {
            let rank = old.rank();
            for c in &old.candidates {
                lbs.insert(c.lb_ip);
                self.change_lb(c.lb_ip, |s| s.claims.remove(&rank));
            }
            for w in old.warnings() {
                self.count(w, false);
            }
        }
        if let Some(new) = new {
            let rank = new.rank();
            for c in &new.candidates {
                lbs.insert(c.lb_ip);
                self.change_lb(c.lb_ip, |s| s.claims.insert(rank.clone()));
            }
            for w in new.warnings() {
                self.count(w, true);
            }
            self.wishes.replace(Wished(new));
        }
        self.settle(lbs);
    }

    /// Settles the owners of `lbs` (their claimants changed), then the
    /// pods they claim, then every LB IP whose outcome may follow.
    fn settle(&mut self, lbs: BTreeSet<IpAddr>) {
        let mut pods = BTreeSet::new();
        for lb in &lbs {
            if let Some(pod) = self.change_lb(*lb, |s| s.claimed_pod.take()) {
                if let Some(claims) = self.pod_claims.get_mut(&pod) {
                    claims.remove_where(|(_, claimed)| claimed == lb);
                    if claims.is_empty() {
                        self.pod_claims.remove(&pod);
                    }
                }
                pods.insert(pod);
            }
            let Some(owner) = self.lbs.get(lb).and_then(|s| s.claims.first()) else {
                continue;
            };
            let pod = self
                .wishes
                .get(owner.service())
                .and_then(|w| w.0.candidate(lb))
                .and_then(|c| c.pod_ip);
            if let Some(pod) = pod {
                self.pod_claims
                    .entry(pod)
                    .or_default()
                    .insert((owner.clone(), *lb));
                self.change_lb(*lb, |s| s.claimed_pod = Some(pod));
                pods.insert(pod);
            }
        }
        // An LB IP claimed or given up changes the outcome of those whose
        // pod it is (an LB IP is never a pod).
        let mut affected = BTreeSet::new();
        for lb in &lbs {
            if let Some(claims) = self.pod_claims.get(lb) {
                affected.extend(claims.iter().map(|(_, claimer)| *claimer));
            }
        }
        affected.extend(lbs);
        for pod in &pods {
            if let Some(claims) = self.pod_claims.get(pod) {
                affected.extend(claims.iter().map(|(_, lb)| *lb));
            }
        }
        for lb in affected {
            self.refresh(lb);
        }
    }

    /// Recomputes the outcome of `lb` and its conflict warnings.
    fn refresh(&mut self, lb: IpAddr) {
        let mut warnings = Vec::new();
        let result = self.lbs.get(&lb).and_then(|s| {
            let claims = &s.claims;
            let owner = claims.first()?.service();
            for loser in claims.iter().skip(1) {
                warnings.push(lb_conflict(loser.service(), &lb, owner));
            }
            let wish = &self.wishes.get(owner)?.0;
            let c = wish.candidate(&lb)?;
            let Some(pod) = c.pod_ip else {
                return Some(Settled::Unmapped);
            };
            if let Some(holder) = self.lbs.get(&pod).and_then(|s| s.claims.first()) {
                warnings.push(pod_is_an_lb_ip(owner, &lb, &pod, holder.service()));
                return Some(Settled::Unmapped);
            }
            let pod_owner = self.pod_claims.get(&pod).and_then(|p| p.first());
            match pod_owner {
                Some((_, winner)) if *winner == lb => Some(Settled::Mapped {
                    pod,
                    filtered: matches!(*wish.intent().mode, Mode::PortFilter { .. }),
                }),
                Some((other, _)) => {
                    warnings.push(pod_conflict(owner, &lb, &pod, other.service()));
                    Some(Settled::Unmapped)
                }
                None => Some(Settled::Unmapped),
            }
        });
        let old_warnings = if warnings.is_empty() {
            self.conflicts.remove(&lb)
        } else {
            self.conflicts.insert(lb, warnings.clone())
        };
        for w in old_warnings.iter().flatten() {
            self.count(w, false);
        }
        for w in &warnings {
            self.count(w, true);
        }
        // Not one of the LB IPs of the Service updated (recorded before its
        // wish changed): its owner's wish is the same, so its result as it
        // was is read from it still.
        self.record_before_change(lb);
        let old = self.change_lb(lb, |s| std::mem::replace(&mut s.result, result));
        if old != result {
            if let Some(r) = old {
                self.summary.count(r, false);
            }
            if let Some(r) = result {
                self.summary.count(r, true);
            }
        }
    }

    /// Applies `f` to what the state keeps of `lb` (kept only while it
    /// holds something).
    fn change_lb<R>(&mut self, lb: IpAddr, f: impl FnOnce(&mut LbState) -> R) -> R {
        match self.lbs.get_mut(&lb) {
            Some(s) => {
                let out = f(s);
                if s.is_empty() {
                    self.lbs.remove(&lb);
                }
                out
            }
            None => {
                let mut s = LbState::default();
                let out = f(&mut s);
                if !s.is_empty() {
                    self.lbs.insert(lb, s);
                }
                out
            }
        }
    }

    /// Records the result `lb` has now as the one it had before the
    /// changes since the last [`PlanState::take_changes`], if none is
    /// recorded yet (and not while the state is built whole).
    fn record_before_change(&mut self, lb: IpAddr) {
        if !self.building && !self.changed.contains_key(&lb) {
            let was = self.result_of(&lb);
            self.changed.insert(lb, was);
        }
    }

    fn count(&mut self, w: &Warning, add: bool) {
        let before = self.warnings.contains_key(w);
        if add {
            *self.warnings.entry(w.clone()).or_default() += 1;
        } else if let Some(n) = self.warnings.get_mut(w) {
            *n -= 1;
            if *n == 0 {
                self.warnings.remove(w);
            }
        }
        if before != self.warnings.contains_key(w) {
            self.summary.count_warning(w.kind, !before);
            self.flipped.entry(w.clone()).or_insert(before);
        }
    }

    /// The LB IPs whose outcome changed since the last call.
    pub fn take_changes(&mut self) -> Vec<LbChange> {
        std::mem::take(&mut self.changed)
            .into_iter()
            .filter_map(|(lb_ip, old)| {
                let new = self.result_of(&lb_ip);
                (old != new).then_some(LbChange { lb_ip, old, new })
            })
            .collect()
    }

    /// The warnings that appeared and those that went away since the last
    /// call.
    pub fn take_warning_changes(&mut self) -> (Vec<Warning>, Vec<Warning>) {
        let mut appeared = Vec::new();
        let mut gone = Vec::new();
        for (w, was) in std::mem::take(&mut self.flipped) {
            match (was, self.warnings.contains_key(&w)) {
                (false, true) => appeared.push(w),
                (true, false) => gone.push(w),
                _ => {}
            }
        }
        (appeared, gone)
    }

    /// Every owned LB IP's outcome.
    pub fn results(&self) -> impl Iterator<Item = (IpAddr, LbResult)> + '_ {
        self.lbs
            .iter()
            .filter_map(|(lb, s)| Some((*lb, self.expand(lb, s.result?)?)))
    }

    /// The rank of LB IP `lb`'s owner (older Services first), if owned.
    pub(crate) fn owner_rank(&self, lb: &IpAddr) -> Option<&Rank> {
        self.lbs.get(lb)?.claims.first()
    }

    /// What became of LB IP `lb`, if a Service owns it.
    pub fn result_of(&self, lb: &IpAddr) -> Option<LbResult> {
        self.expand(lb, self.lbs.get(lb)?.result?)
    }

    /// The whole outcome of owned LB IP `lb`, settled as `s`: read from
    /// its owner's wish (`None` only if the state lost track of it, which
    /// the property tests rule out).
    fn expand(&self, lb: &IpAddr, s: Settled) -> Option<LbResult> {
        let owner = self.lbs.get(lb)?.claims.first()?.service();
        Some(match s {
            Settled::Mapped { pod, .. } => {
                let wish = &self.wishes.get(owner)?.0;
                LbResult::Mapped(wish.mapping(wish.candidate(lb)?, pod))
            }
            Settled::Unmapped => LbResult::Unmapped(owner.clone()),
        })
    }

    /// Every current warning, sorted.
    pub fn warnings(&self) -> impl Iterator<Item = &Warning> {
        self.warnings.keys()
    }

    pub fn summary(&self) -> &PlanSummary {
        &self.summary
    }

    /// The whole plan, as [`super::compute_plan`] gives it (O(every
    /// Service): for tests and reports, not for each change).
    pub fn outcome(&self) -> Outcome {
        let mut plan = Plan::default();
        for (lb, r) in self.results() {
            match r {
                LbResult::Mapped(m) => plan.mappings.push(m),
                LbResult::Unmapped(s) => {
                    plan.unmapped_lb_ips.insert(lb, s);
                }
            }
        }
        plan.mappings.sort_by_key(|m| m.lb_ip);
        Outcome {
            plan,
            warnings: self.warnings.keys().cloned().collect(),
        }
    }
}
