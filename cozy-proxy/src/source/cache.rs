//! What the Kubernetes source keeps of the cluster's Services and
//! EndpointSlices, and what changed since the last round. Every node
//! watches every Service and EndpointSlice of the cluster and most are not
//! ours, so only what the model reads is kept: our Services (as the model
//! reads them, [`ReadService`]), and
//! every slice in compact form (a Service may become ours later, and its
//! slices must be at hand then). Other Services are not kept at all: the
//! update that makes one ours carries the whole object.
use super::{ServiceObjects, Snapshot};
use crate::model::trim::CompactSlice;
use crate::model::{is_selected, read_service, service_ref, slice_owner, ReadService, ServiceRef};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::runtime::watcher::Event;
use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

type Services = HashMap<ServiceRef, Arc<ReadService>>;
type Slices = HashMap<ServiceRef, HashMap<Box<str>, CompactSlice>>;

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
}

/// Service `s` as it is now in `services`: kept if ours, else not at all.
fn put_service(services: &mut Services, s: &Service) -> ServiceRef {
    let key = service_ref(s);
    if is_selected(s) {
        services.insert(key.clone(), Arc::new(read_service(s)));
    } else {
        services.remove(&key);
    }
    key
}

/// Slice `e` as it is now in `slices` (`present`: not deleted); its
/// Service, if it names one.
fn put_slice(slices: &mut Slices, e: &EndpointSlice, present: bool) -> Option<ServiceRef> {
    let owner = slice_owner(e)?;
    let name = e.metadata.name.as_deref().unwrap_or_default();
    match CompactSlice::of(e).filter(|_| present) {
        Some(c) => {
            slices
                .entry(owner.clone())
                .or_default()
                .insert(name.into(), c);
        }
        None => {
            if let Some(of_owner) = slices.get_mut(&owner) {
                of_owner.remove(name);
                if of_owner.is_empty() {
                    slices.remove(&owner);
                }
            }
        }
    }
    Some(owner)
}

impl Cache {
    pub fn new() -> Self {
        Cache {
            full: true,
            ..Default::default()
        }
    }

    pub fn listed(&self) -> bool {
        self.services.done && self.slices.done
    }

    pub fn service_event(&mut self, e: &Event<Service>) {
        match e {
            Event::Init => self.services.begin(),
            Event::InitApply(s) => {
                put_service(self.services.listing(), s);
            }
            Event::InitDone => {
                self.services.finish();
                self.full = true;
            }
            Event::Apply(s) => {
                let key = put_service(&mut self.services.live, s);
                self.touched.insert(key);
            }
            Event::Delete(s) => {
                let key = service_ref(s);
                self.services.live.remove(&key);
                self.touched.insert(key);
            }
        }
    }

    pub fn slice_event(&mut self, e: &Event<EndpointSlice>) {
        match e {
            Event::Init => self.slices.begin(),
            Event::InitApply(s) => {
                put_slice(self.slices.listing(), s, true);
            }
            Event::InitDone => {
                self.slices.finish();
                self.full = true;
            }
            Event::Apply(s) | Event::Delete(s) => {
                let present = matches!(e, Event::Apply(_));
                if let Some(owner) = put_slice(&mut self.slices.live, s, present) {
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

    /// The slices of `service`, as the model reads them.
    fn slices_of(&self, service: &ServiceRef) -> Vec<Arc<EndpointSlice>> {
        self.slices
            .live
            .get(service)
            .into_iter()
            .flatten()
            .map(|(name, c)| Arc::new(c.to_slice(name, service)))
            .collect()
    }

    /// The Services touched since the last call, with their objects now.
    pub fn take_touched(&mut self) -> Vec<ServiceObjects> {
        std::mem::take(&mut self.touched)
            .into_iter()
            .map(|service| ServiceObjects {
                read: self.services.live.get(&service).cloned(),
                slices: self.slices_of(&service),
                service,
            })
            .collect()
    }

    /// Our Services and their slices (the others' slices are not part of
    /// any plan); Nodes and ServiceCIDRs are the caller's.
    pub fn snapshot(&mut self) -> Snapshot {
        self.full = false;
        self.touched.clear();
        Snapshot {
            read_services: self.services.live.values().cloned().collect(),
            endpoint_slices: self
                .services
                .live
                .keys()
                .flat_map(|s| self.slices_of(s))
                .collect(),
            ..Default::default()
        }
    }

    /// The uid of our Service `namespace/name` (Events name it).
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .live
            .get(&ServiceRef::new(namespace, name))
            .and_then(|s| s.uid.clone())
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
            Event::InitApply(ours_slice),
            Event::InitApply(other_slice),
            Event::InitDone,
        ] {
            c.slice_event(&e);
        }
        assert!(c.listed() && c.full);
        let full = c.snapshot();
        assert_eq!(
            full.read_services.len(),
            1,
            "the unlabelled Service is not kept"
        );
        assert_eq!(
            full.endpoint_slices.len(),
            1,
            "only our Services' slices are handed out"
        );
        assert!(!c.full && c.take_touched().is_empty());

        // The other Service gets the label: it is touched, with its slice.
        let mut labelled = other.clone();
        labelled.metadata.labels = ours.metadata.labels.clone();
        c.service_event(&Event::Apply(labelled));
        let touched = c.take_touched();
        assert_eq!(touched.len(), 1);
        assert_eq!(touched[0].service, ServiceRef::new("t", "b"));
        assert!(touched[0].read.is_some());
        assert_eq!(touched[0].slices.len(), 1);

        // Deleted: touched, with nothing.
        c.service_event(&Event::Delete(ours));
        let touched = c.take_touched();
        assert_eq!(touched[0].service, ServiceRef::new("t", "a"));
        assert!(touched[0].read.is_none());
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
            .read_services
            .iter()
            .map(|r| r.intent.service.name.to_string())
            .collect();
        assert_eq!(names, vec!["b".to_string()]);
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
}
