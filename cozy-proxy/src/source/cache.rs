//! What the Kubernetes source keeps of the cluster's Services and
//! EndpointSlices, and what changed since the last round. Every node
//! watches every Service and EndpointSlice of the cluster and most are not
//! ours, so only what the model reads is kept: our Services (as the model
//! reads them, [`ReadService`]), the names of the others, and the slices
//! (as the model reads them, [`ReadSlice`]) of every Service that is ours
//! or not known yet (two watches, no order between them). The slices of a
//! Service known not to be ours are not kept (in a cluster where other
//! Services have many endpoints they would be most of the cache): when one
//! becomes ours (a label or the annotation
//! added), the cache asks for that Service's slices
//! ([`Cache::take_wanted_slices`]), read by their `kubernetes.io/service-name`
//! label in its namespace; never a list of every slice of the cluster, which
//! one tenant toggling its Service's label would otherwise make every node
//! do again and again. Only when a watch restart finds many Services became
//! ours at once are all slices listed again ([`Cache::take_slice_relist`]).
//! The plan is built from these, shared, never copied.
use super::holds::Holds;
use super::Snapshot;
use crate::model::ServiceObjects;
use crate::model::{
    is_selected, read_service, service_ref, slice_owner, ReadService, ReadSlice, ServiceRef,
};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::runtime::watcher::Event;
use smallvec::SmallVec;
use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

type Services = HashMap<ServiceRef, Arc<ReadService>>;

/// Services found ours at once by a watch restart whose slices are read
/// one Service at a time; more, and every slice is listed again (one list
/// is cheaper than that many).
const WANTED_AT_MOST: usize = 64;
/// By Service; a Service has one slice or a few, found by name. The one
/// most have is held in place, without an allocation of its own.
type Slices = HashMap<ServiceRef, SmallVec<[Arc<ReadSlice>; 1]>>;

/// A cache a watch's lists replace whole: what is live, and the list in
/// progress (objects deleted meanwhile are not in it).
#[derive(Default)]
struct Listed<M> {
    live: M,
    relist: Option<M>,
    /// A first list is complete.
    done: bool,
}

impl<M: Default> Listed<M> {
    fn begin(&mut self) {
        self.relist = Some(M::default());
    }

    fn listing(&mut self) -> &mut M {
        self.relist.get_or_insert_with(M::default)
    }

    fn finish(&mut self) {
        if let Some(listed) = self.relist.take() {
            self.live = listed;
        }
        self.done = true;
    }
}

#[derive(Default)]
pub struct Cache {
    services: Listed<Services>,
    /// The Services that are not ours: their slices are dropped as they
    /// come. Listed with `services`.
    others: Listed<Others>,
    /// Many Services whose slices were dropped became ours at once: the
    /// slices are to be listed again.
    slice_relist: bool,
    /// Services whose slices were dropped that became ours: their slices
    /// are to be read ([`Cache::take_wanted_slices`]).
    wanted: HashSet<ServiceRef>,
    /// Those being read, with the names of their slices the watch brought
    /// since they were asked for: the watch's word on those is newer than
    /// the read's ([`Cache::fill_slices`]).
    asked: HashMap<ServiceRef, HashSet<String>>,
    /// By Service, then by slice name.
    slices: Listed<Slices>,
    /// Everything is read again at the next round: at the start, after a
    /// relist, after a change of a Node's addresses or pod networks or of
    /// a ServiceCIDR.
    pub full: bool,
    /// Services whose object or slices changed since the last round.
    touched: HashSet<ServiceRef>,
    /// Node -> what the model reads of it, to tell a change that matters
    /// from a status heartbeat.
    nodes: HashMap<String, String>,
    /// One copy of each namespace and node name (tens of thousands of
    /// objects name a few of them).
    strings: Interned,
    /// Endpoints held through a readiness flap.
    holds: Holds,
}

/// Services by a fingerprint of their name: 64 bits, keyed at random
/// for each set, not the names themselves (most Services are not ours). Two names with one fingerprint (one chance in about
/// 10^9 with 200 000 names) cost nothing lasting: the slices of a Service
/// not seen yet would be dropped as the other's, and listed again once it
/// is found to be ours, as for any Service that becomes ours.
#[derive(Default)]
struct Others {
    keys: std::hash::RandomState,
    fingerprints: HashSet<u64>,
}

impl Others {
    fn fingerprint(&self, r: &ServiceRef) -> u64 {
        std::hash::BuildHasher::hash_one(&self.keys, r)
    }

    fn insert(&mut self, r: &ServiceRef) {
        self.fingerprints.insert(self.fingerprint(r));
    }

    fn remove(&mut self, r: &ServiceRef) -> bool {
        self.fingerprints.remove(&self.fingerprint(r))
    }

    fn contains(&self, r: &ServiceRef) -> bool {
        self.fingerprints.contains(&self.fingerprint(r))
    }
}

/// Strings many objects repeat, one shared copy each.
#[derive(Default)]
struct Interned(HashSet<Arc<str>>);

impl Interned {
    fn get(&mut self, s: &str) -> Arc<str> {
        match self.0.get(s) {
            Some(shared) => shared.clone(),
            None => {
                let shared: Arc<str> = s.into();
                self.0.insert(shared.clone());
                shared
            }
        }
    }

    /// Forgets the strings no object holds any more.
    fn prune(&mut self) {
        self.0.retain(|s| Arc::strong_count(s) > 1);
    }
}

/// Service `s` (named `key`) as it is now in `services` (kept if ours)
/// and `others` (its name, if not). Whether it is ours.
fn put_service(
    services: &mut Services,
    others: &mut Others,
    key: &ServiceRef,
    s: &Service,
) -> bool {
    if is_selected(s) {
        let mut read = read_service(s);
        // The model's name of it is the cache's: one copy.
        read.intent.service = key.clone();
        services.insert(key.clone(), Arc::new(read));
        others.remove(key);
        true
    } else {
        services.remove(key);
        others.insert(key);
        false
    }
}

/// Slice `e` of Service `owner` as it is now in `slices` (`present`: not
/// deleted), its node names from `strings`; with `holds`, what it held
/// through a readiness flap held on (the watch's changes to live slices).
fn put_slice(
    slices: &mut Slices,
    strings: &mut Interned,
    owner: &ServiceRef,
    e: &EndpointSlice,
    present: bool,
    holds: Option<&mut Holds>,
) {
    let name = e.metadata.name.as_deref().unwrap_or_default();
    let read = present
        .then(|| ReadSlice::of(e, &mut |n| strings.get(n)))
        .flatten();
    let of_owner = match slices.get_mut(owner) {
        Some(of_owner) => of_owner,
        None => slices.entry(owner.clone()).or_default(),
    };
    let at = of_owner.iter().position(|s| &*s.name == name);
    let read = match (read, holds) {
        (Some(r), Some(holds)) => {
            let previous = at.map(|i| &*of_owner[i]);
            Some(holds.through(owner, r, previous, Instant::now()))
        }
        (None, Some(holds)) => {
            holds.drop_slice(owner, name);
            None
        }
        (read, None) => read.map(Arc::new),
    };
    match (read, at) {
        (Some(r), Some(i)) => of_owner[i] = r,
        (Some(r), None) => of_owner.push(r),
        (None, Some(i)) => {
            of_owner.swap_remove(i);
        }
        (None, None) => {}
    }
    if of_owner.is_empty() {
        slices.remove(owner);
    }
}

impl Cache {
    pub fn new() -> Self {
        Cache {
            full: true,
            ..Default::default()
        }
    }

    /// A cache that holds a ready endpoint turned not ready (without
    /// terminating) for `hold` (`source::holds`).
    pub fn holding(hold: Duration) -> Self {
        Cache {
            holds: Holds::new(hold),
            ..Cache::new()
        }
    }

    /// When the next hold of a not-ready endpoint ends.
    pub fn next_hold_end(&self) -> Option<Instant> {
        self.holds.next_end()
    }

    /// The holds ended by `now`: each slice shown as it is (what it held
    /// taken out), its Service touched.
    pub fn end_holds(&mut self, now: Instant) {
        for (owner, name) in self.holds.take_ended(now) {
            let of_owner = self.slices.live.get_mut(&owner);
            let Some(shown) = of_owner.and_then(|s| s.iter_mut().find(|s| s.name == name)) else {
                continue;
            };
            if let Some(unheld) = shown.unheld() {
                *shown = Arc::new(unheld);
                self.touched.insert(owner);
            }
        }
    }

    pub fn listed(&self) -> bool {
        self.services.done && self.slices.done
    }

    /// `r` sharing the strings the cache already holds: the Service's own
    /// name if it is kept, its namespace in any case.
    fn shared(&mut self, r: ServiceRef) -> ServiceRef {
        let kept = [Some(&self.services.live), self.services.relist.as_ref()];
        for services in kept.into_iter().flatten() {
            if let Some((key, _)) = services.get_key_value(&r) {
                return key.clone();
            }
        }
        ServiceRef {
            namespace: self.strings.get(&r.namespace),
            name: r.name,
        }
    }

    pub fn service_event(&mut self, e: &Event<Service>) {
        match e {
            Event::Init => {
                self.services.begin();
                self.others.begin();
            }
            Event::InitApply(s) => {
                let key = self.shared(service_ref(s));
                put_service(self.services.listing(), self.others.listing(), &key, s);
            }
            Event::InitDone => {
                // Ours now, not ours before the list: its slices were
                // dropped (a change missed while the watch was down).
                let became_ours: Vec<ServiceRef> = (self.services.relist.iter())
                    .flat_map(|ours| ours.keys())
                    .filter(|k| self.others.live.contains(k))
                    .cloned()
                    .collect();
                if became_ours.len() > WANTED_AT_MOST {
                    self.slice_relist = true;
                } else {
                    self.wanted.extend(became_ours);
                }
                self.services.finish();
                self.others.finish();
                let others = &self.others.live;
                self.slices.live.retain(|owner, _| !others.contains(owner));
                self.strings.prune();
                self.full = true;
            }
            Event::Apply(s) => {
                let key = self.shared(service_ref(s));
                let was_other = self.others.live.contains(&key);
                let ours = put_service(&mut self.services.live, &mut self.others.live, &key, s);
                if ours && was_other {
                    self.wanted.insert(key.clone());
                } else if !ours {
                    self.slices.live.remove(&key);
                }
                self.touched.insert(key);
            }
            Event::Delete(s) => {
                let key = service_ref(s);
                self.services.live.remove(&key);
                self.others.live.remove(&key);
                self.touched.insert(key);
            }
        }
    }

    /// Whether the slices are to be listed again (a Service whose slices
    /// were dropped became ours), once: the watch of slices restarts, and
    /// its list replaces what is kept. Not while a list of them is under
    /// way: under a stream of such changes it would start again and again
    /// and never end; the requests made meanwhile are one list after it.
    pub fn take_slice_relist(&mut self) -> bool {
        if self.slices.relist.is_some() {
            return false;
        }
        std::mem::take(&mut self.slice_relist)
    }

    /// The Services whose slices are to be read, once each: their slices
    /// the watch brings from now on are marked as newer than the read.
    pub fn take_wanted_slices(&mut self) -> Vec<ServiceRef> {
        let wanted: Vec<ServiceRef> = self.wanted.drain().collect();
        for w in &wanted {
            self.asked.entry(w.clone()).or_default();
        }
        wanted
    }

    /// The slices read for `owner`: kept if it is still ours, but not
    /// those the watch brought since they were asked for (applied or
    /// deleted: the watch's word is newer).
    pub fn fill_slices(&mut self, owner: &ServiceRef, slices: &[EndpointSlice]) {
        let seen = self.asked.remove(owner).unwrap_or_default();
        let Some((owner, _)) = self.services.live.get_key_value(owner) else {
            return;
        };
        let owner = owner.clone();
        for e in slices {
            let name = e.metadata.name.as_deref().unwrap_or_default();
            if slice_owner(e).as_ref() == Some(&owner) && !seen.contains(name) {
                put_slice(
                    &mut self.slices.live,
                    &mut self.strings,
                    &owner,
                    e,
                    true,
                    None,
                );
            }
        }
        self.touched.insert(owner);
    }

    /// `owner`'s slices could not be read: asked for again.
    pub fn want_again(&mut self, owner: ServiceRef) {
        self.asked.remove(&owner);
        self.wanted.insert(owner);
    }

    /// The Service of slice `s`, if its slices are kept (it is ours or not
    /// seen yet), sharing the cache's strings.
    fn kept_owner(&mut self, s: &EndpointSlice) -> Option<ServiceRef> {
        let owner = slice_owner(s).filter(|o| !self.others.live.contains(o))?;
        Some(self.shared(owner))
    }

    /// Whether the first list of Services is complete (the slices are
    /// listed after it: until then every slice would be kept).
    pub fn services_listed(&self) -> bool {
        self.services.done
    }

    pub fn slice_event(&mut self, e: &Event<EndpointSlice>) {
        match e {
            Event::Init => self.slices.begin(),
            Event::InitApply(s) => {
                if let Some(owner) = self.kept_owner(s) {
                    put_slice(
                        self.slices.listing(),
                        &mut self.strings,
                        &owner,
                        s,
                        true,
                        None,
                    );
                }
            }
            Event::InitDone => {
                self.slices.finish();
                self.holds.clear();
                self.strings.prune();
                self.full = true;
            }
            Event::Apply(s) | Event::Delete(s) => {
                let present = matches!(e, Event::Apply(_));
                if !self.asked.is_empty() {
                    if let Some(seen) = slice_owner(s).and_then(|o| self.asked.get_mut(&o)) {
                        seen.insert(s.metadata.name.clone().unwrap_or_default());
                    }
                }
                if let Some(owner) = self.kept_owner(s) {
                    let holds = Some(&mut self.holds);
                    put_slice(
                        &mut self.slices.live,
                        &mut self.strings,
                        &owner,
                        s,
                        present,
                        holds,
                    );
                    self.touched.insert(owner);
                }
            }
        }
    }

    pub fn node_event(&mut self, e: &Event<Node>) {
        match e {
            Event::Apply(n) | Event::InitApply(n) => self.node(n, true),
            Event::Delete(n) => self.node(n, false),
            Event::Init => {}
            Event::InitDone => self.full = true,
        }
    }

    fn node(&mut self, node: &Node, present: bool) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let read = present.then(|| {
            let pod_cidrs = node.spec.as_ref().map(|s| (&s.pod_cidr, &s.pod_cidrs));
            let addresses = node.status.as_ref().map(|s| &s.addresses);
            serde_json::to_string(&(pod_cidrs, addresses)).unwrap_or_default()
        });
        let changed = match read {
            Some(r) => self.nodes.insert(name, r.clone()) != Some(r),
            None => self.nodes.remove(&name).is_some(),
        };
        self.full |= changed;
    }

    /// Service `service` as it is now: what the model reads of it (if
    /// ours) and of its slices.
    fn objects_of(&self, service: ServiceRef) -> ServiceObjects {
        ServiceObjects {
            read: self.services.live.get(&service).cloned(),
            slices: self
                .slices
                .live
                .get(&service)
                .map(|s| s.to_vec())
                .unwrap_or_default(),
            service,
        }
    }

    /// The Services touched since the last call, with their objects now.
    pub fn take_touched(&mut self) -> Vec<ServiceObjects> {
        std::mem::take(&mut self.touched)
            .into_iter()
            .map(|service| self.objects_of(service))
            .collect()
    }

    /// Our Services and their slices (the others' slices are not part of
    /// any plan); Nodes and ServiceCIDRs are the caller's.
    pub fn snapshot(&mut self) -> Snapshot {
        self.full = false;
        self.touched.clear();
        Snapshot {
            read: self
                .services
                .live
                .keys()
                .map(|s| self.objects_of(s.clone()))
                .collect(),
            ..Default::default()
        }
    }

    /// The uid of our Service `namespace/name` (Events name it).
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .live
            .get(&ServiceRef::new(namespace, name))
            .and_then(|s| s.uid.as_ref().map(ToString::to_string))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::tests::{service, snapshot};

    fn objects(name: &str, lb: &str, pod: &str) -> (Service, EndpointSlice) {
        let s = snapshot(&service(name, lb, pod, "true"));
        ((*s.services[0]).clone(), (*s.endpoint_slices[0]).clone())
    }

    #[test]
    fn only_our_services_are_kept_and_a_service_that_becomes_ours_finds_its_slices() {
        let mut c = Cache::new();
        let (ours, ours_slice) = objects("a", "203.0.113.10", "192.0.2.11");
        let (mut other, other_slice) = objects("b", "203.0.113.20", "192.0.2.12");
        let other_slice_later = other_slice.clone();
        other.metadata.labels = None;
        other.metadata.annotations = None;
        for e in [
            Event::Init,
            Event::InitApply(ours.clone()),
            Event::InitApply(other.clone()),
            Event::InitDone,
        ] {
            c.service_event(&e);
        }
        assert!(!c.listed(), "the slices are not listed yet");
        for e in [
            Event::Init,
            Event::InitApply(ours_slice.clone()),
            Event::InitApply(other_slice),
            Event::InitDone,
        ] {
            c.slice_event(&e);
        }
        assert_eq!(
            c.slices.live.len(),
            1,
            "the slice of a Service known not to be ours is not kept"
        );
        assert!(c.listed() && c.full);
        let full = c.snapshot();
        assert_eq!(full.read.len(), 1, "the unlabelled Service is not kept");
        assert_eq!(
            full.read[0].slices.len(),
            1,
            "only our Services' slices are handed out"
        );
        assert!(!c.full && c.take_touched().is_empty());

        assert!(!c.take_slice_relist());

        // The other Service gets the label: it is touched, and its slices
        // (not kept) are to be read, its own only: no list of every slice.
        let mut labelled = other.clone();
        labelled.metadata.labels = ours.metadata.labels.clone();
        c.service_event(&Event::Apply(labelled.clone()));
        let touched = c.take_touched();
        assert_eq!(touched.len(), 1);
        assert_eq!(touched[0].service, ServiceRef::new("t", "b"));
        assert!(touched[0].read.is_some());
        assert!(!c.take_slice_relist(), "no list of every slice");
        let b = ServiceRef::new("t", "b");
        assert_eq!(c.take_wanted_slices(), vec![b.clone()]);
        assert!(c.take_wanted_slices().is_empty(), "asked once");
        c.fill_slices(&b, std::slice::from_ref(&other_slice_later));
        let touched = c.take_touched();
        assert_eq!(touched.len(), 1);
        assert_eq!(touched[0].slices.len(), 1, "the read brings its slice");
        let full = c.snapshot();
        assert_eq!(full.read.len(), 2);
        assert!(full.read.iter().all(|o| o.slices.len() == 1));

        // Not ours any more: its slices go, and a later version of them is
        // not kept either.
        c.service_event(&Event::Apply(other.clone()));
        c.slice_event(&Event::Apply(other_slice_later.clone()));
        assert_eq!(c.slices.live.len(), 1);
        // Ours again, its slice deleted while the read is under way: the
        // watch's word is newer, the read's copy is not kept.
        c.service_event(&Event::Apply(labelled));
        assert_eq!(c.take_wanted_slices(), vec![b.clone()]);
        c.slice_event(&Event::Delete(other_slice_later.clone()));
        c.fill_slices(&b, std::slice::from_ref(&other_slice_later));
        assert_eq!(c.slices.live.len(), 1, "the deleted slice stays deleted");
        // A read that failed is asked for again.
        c.want_again(b.clone());
        assert_eq!(c.take_wanted_slices(), vec![b]);
        let _ = c.take_touched();

        // Deleted: touched, with nothing.
        c.service_event(&Event::Delete(ours));
        let touched = c.take_touched();
        assert_eq!(touched[0].service, ServiceRef::new("t", "a"));
        assert!(touched[0].read.is_none());
    }

    /// The objects of `world` as the API would hold them: one per name
    /// (the first), their endpoints on two nodes, trimmed as they arrive.
    fn as_in_the_api(
        (services, slices): (Vec<Service>, Vec<EndpointSlice>),
    ) -> (Vec<Service>, Vec<EndpointSlice>) {
        let mut names = HashSet::new();
        let services: Vec<Service> = services
            .into_iter()
            .filter(|s| names.insert(s.metadata.name.clone()))
            .collect();
        let mut names = HashSet::new();
        let mut slices: Vec<EndpointSlice> = slices
            .into_iter()
            .filter(|e| names.insert(e.metadata.name.clone()))
            .collect();
        for (i, e) in slices.iter_mut().flat_map(|e| &mut e.endpoints).enumerate() {
            e.node_name = Some(format!("n{}", i % 2));
        }
        (services, slices)
    }

    proptest::proptest! {
        /// What the cache keeps of the objects gives the plan the whole
        /// objects give, whether they were listed or arrived one by one
        /// after the list (incremental rounds).
        #[test]
        fn the_cache_gives_the_plan_of_the_objects(
            world in crate::model::tests::arb_world(),
            listed in 0usize..10,
        ) {
            use crate::model::{compute_plan, trim, PlanState, ReadSlice};
            let (services, slices) = as_in_the_api(world);
            let mut c = Cache::new();
            c.service_event(&Event::Init);
            c.slice_event(&Event::Init);
            let mut later = Vec::new();
            for (i, s) in services.iter().enumerate() {
                let mut t = s.clone();
                trim::trim_service(&mut t);
                match i < listed {
                    true => c.service_event(&Event::InitApply(t)),
                    false => later.push(Event::Apply(t)),
                }
            }
            let mut later_slices = Vec::new();
            for (i, e) in slices.iter().enumerate() {
                let mut t = e.clone();
                trim::trim_slice(&mut t);
                if i < listed {
                    c.slice_event(&Event::InitApply(t));
                    continue;
                }
                // A stale version first (replaced), and a slice that comes
                // and goes, each with an address of its own.
                let mut stale = t.clone();
                let elsewhere = match stale.address_type.as_str() {
                    "IPv4" => "192.0.2.99",
                    _ => "2001:db8:2::99",
                };
                stale.endpoints = vec![k8s_openapi::api::discovery::v1::Endpoint {
                    addresses: vec![elsewhere.into()],
                    ..Default::default()
                }];
                let mut gone = stale.clone();
                gone.metadata.name = Some(format!("gone-{i}"));
                later_slices.extend([
                    Event::Apply(stale),
                    Event::Apply(gone.clone()),
                    Event::Apply(t),
                    Event::Delete(gone),
                ]);
            }
            c.service_event(&Event::InitDone);
            c.slice_event(&Event::InitDone);
            let snap = c.snapshot();
            let no_objects: [&Service; 0] = [];
            let no_slices: [&EndpointSlice; 0] = [];
            let mut state = PlanState::build_with(&no_objects, &no_slices, &snap.read, &[]);
            later.iter().for_each(|e| c.service_event(e));
            later_slices.iter().for_each(|e| c.slice_event(e));
            for o in c.take_touched() {
                let read: Vec<&ReadSlice> = o.slices.iter().map(AsRef::as_ref).collect();
                state.update_read(&o.service, o.read.clone(), &read);
            }
            proptest::prop_assert_eq!(state.outcome(), compute_plan(&services, &slices, &[]));
        }
    }

    #[test]
    fn namespaces_and_node_names_are_shared() {
        let mut c = Cache::new();
        for name in ["a", "b"] {
            let (_, mut slice) = objects(name, "203.0.113.10", "192.0.2.11");
            slice.endpoints[0].node_name = Some("n1".into());
            c.slice_event(&Event::Apply(slice));
        }
        let _ = c.take_touched();
        let node = c.strings.0.get("n1").expect("interned");
        // The set's copy and one per slice.
        assert_eq!(Arc::strong_count(node), 3);
        let ns = c.strings.0.get("t").expect("interned");
        // The set's copy and one per slice's Service.
        assert_eq!(Arc::strong_count(ns), 3);
    }

    #[test]
    fn a_relist_replaces_the_cache_and_asks_for_a_full_round() {
        let mut c = Cache::new();
        let (a, _) = objects("a", "203.0.113.10", "192.0.2.11");
        let (b, _) = objects("b", "203.0.113.20", "192.0.2.12");
        for e in [Event::Init, Event::InitApply(a.clone()), Event::InitDone] {
            c.service_event(&e);
        }
        c.snapshot();
        // `a` was deleted while the watch was down: the relist has only `b`.
        for e in [Event::Init, Event::InitApply(b), Event::InitDone] {
            c.service_event(&e);
        }
        assert!(c.full);
        let names: Vec<String> = c
            .snapshot()
            .read
            .iter()
            .map(|o| o.service.name.to_string())
            .collect();
        assert_eq!(names, vec!["b".to_string()]);
    }

    #[test]
    fn services_found_ours_by_a_relist_have_their_slices_read() {
        let mut c = Cache::new();
        let (ours, _) = objects("b", "203.0.113.20", "192.0.2.12");
        let mut other = ours.clone();
        other.metadata.labels = None;
        other.metadata.annotations = None;
        for e in [
            Event::Init,
            Event::InitApply(other.clone()),
            Event::InitDone,
        ] {
            c.service_event(&e);
        }
        assert!(!c.take_slice_relist());
        // Labelled while the watch was down: the relist finds it ours.
        for e in [Event::Init, Event::InitApply(ours.clone()), Event::InitDone] {
            c.service_event(&e);
        }
        assert!(!c.take_slice_relist());
        assert_eq!(c.take_wanted_slices(), vec![ServiceRef::new("t", "b")]);

        // Many at once: one list of every slice instead.
        let named = |s: &Service, i: usize| {
            let mut s = s.clone();
            s.metadata.name = Some(format!("s{i}"));
            s
        };
        let many = WANTED_AT_MOST + 1;
        let mut events = vec![Event::Init];
        events.extend((0..many).map(|i| Event::InitApply(named(&other, i))));
        events.push(Event::InitDone);
        events.iter().for_each(|e| c.service_event(e));
        let mut events = vec![Event::Init];
        events.extend((0..many).map(|i| Event::InitApply(named(&ours, i))));
        events.push(Event::InitDone);
        events.iter().for_each(|e| c.service_event(e));
        assert!(c.take_slice_relist());
        assert!(c.take_wanted_slices().is_empty());
    }

    #[test]
    fn a_node_heartbeat_is_not_a_change_but_new_addresses_are() {
        use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
        let mut c = Cache::new();
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        c.node_event(&Event::Apply(n.clone()));
        c.snapshot();
        // The same addresses again (a status heartbeat, trimmed): nothing.
        c.node_event(&Event::Apply(n.clone()));
        assert!(!c.full);
        n.status = Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                address: "198.51.100.7".into(),
                type_: "InternalIP".into(),
            }]),
            ..Default::default()
        });
        c.node_event(&Event::Apply(n));
        assert!(c.full);
    }

    /// The mappings a plan built from the cache's Services holds (pod IPs).
    fn mapped_pods(c: &mut Cache) -> Vec<std::net::IpAddr> {
        let read = c.snapshot().read;
        let none: [&Service; 0] = [];
        let slices: [&EndpointSlice; 0] = [];
        let state = crate::model::PlanState::build_with(&none, &slices, &read, &[]);
        state
            .outcome()
            .plan
            .mappings
            .iter()
            .map(|m| m.pod_ip)
            .collect()
    }

    /// `slice` with its endpoints' conditions `(ready, serving, terminating)`.
    fn conditioned(slice: &EndpointSlice, c: (bool, bool, bool)) -> EndpointSlice {
        use k8s_openapi::api::discovery::v1::EndpointConditions;
        let mut s = slice.clone();
        for e in &mut s.endpoints {
            e.conditions = Some(EndpointConditions {
                ready: Some(c.0),
                serving: Some(c.1),
                terminating: Some(c.2),
            });
        }
        s
    }

    /// `source::holds`: a ready endpoint turned not ready, not terminating,
    /// keeps its LB IP for the hold (from the first not-ready version on),
    /// or until ready again; a terminating one, or any without a hold
    /// time, does not; a ready address elsewhere wins over a held one.
    #[test]
    fn a_ready_endpoint_turned_not_ready_is_held_for_the_hold_time() {
        let hold = Duration::from_secs(10);
        let (svc, slice) = objects("a", "203.0.113.10", "192.0.2.11");
        let pod: std::net::IpAddr = "192.0.2.11".parse().expect("ip");
        let (ready, flapped) = (
            conditioned(&slice, (true, true, false)),
            conditioned(&slice, (false, false, false)),
        );
        let start = |hold: Duration| {
            let mut c = Cache::holding(hold);
            c.service_event(&Event::Apply(svc.clone()));
            c.slice_event(&Event::Apply(ready.clone()));
            c
        };
        let mut c = start(hold);
        assert_eq!(mapped_pods(&mut c), vec![pod]);
        let before = Instant::now();
        c.slice_event(&Event::Apply(flapped.clone()));
        let ends = c.next_hold_end().expect("held");
        assert!(ends >= before + hold && ends <= Instant::now() + hold);
        assert_eq!(c.take_touched().len(), 1, "the Service is touched");
        assert_eq!(mapped_pods(&mut c), vec![pod], "held");
        // Not ready again: the hold keeps its end.
        c.slice_event(&Event::Apply(flapped.clone()));
        assert_eq!(c.next_hold_end(), Some(ends));
        c.take_touched();
        c.end_holds(ends - Duration::from_millis(1));
        assert!(c.take_touched().is_empty(), "not ended yet");
        c.end_holds(ends);
        assert_eq!(c.take_touched().len(), 1, "the hold's end touches it");
        assert_eq!(mapped_pods(&mut c), Vec::<std::net::IpAddr>::new());
        assert_eq!(c.next_hold_end(), None);
        // Still not ready after the hold: no new hold.
        c.slice_event(&Event::Apply(flapped.clone()));
        assert_eq!(c.next_hold_end(), None);

        // Ready again within the hold: the hold is over.
        let mut c = start(hold);
        c.slice_event(&Event::Apply(flapped.clone()));
        c.slice_event(&Event::Apply(ready.clone()));
        assert_eq!(c.next_hold_end(), None);
        assert_eq!(mapped_pods(&mut c), vec![pod]);

        // Terminating (deleted): never held; nor without a hold time.
        let mut c = start(hold);
        c.slice_event(&Event::Apply(conditioned(&slice, (false, false, true))));
        assert_eq!(c.next_hold_end(), None);
        assert_eq!(mapped_pods(&mut c), Vec::<std::net::IpAddr>::new());
        let mut c = start(Duration::ZERO);
        c.slice_event(&Event::Apply(flapped.clone()));
        assert_eq!(mapped_pods(&mut c), Vec::<std::net::IpAddr>::new());

        // A ready address in another slice of the Service backs it, not
        // the held one.
        let mut c = start(hold);
        let (_, other) = objects("a", "203.0.113.10", "192.0.2.12");
        let mut other = conditioned(&other, (true, true, false));
        other.metadata.name = Some("a-other".into());
        c.slice_event(&Event::Apply(other));
        c.slice_event(&Event::Apply(flapped.clone()));
        assert!(c.next_hold_end().is_some());
        let other_pod: std::net::IpAddr = "192.0.2.12".parse().expect("ip");
        assert_eq!(mapped_pods(&mut c), vec![other_pod]);
    }
}
