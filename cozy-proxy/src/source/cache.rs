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

#[derive(Default)]
pub struct Cache {
    services: Services,
    /// By Service, then by slice name.
    slices: Slices,
    /// The lists of a (re)list in progress: they replace the caches when
    /// complete (objects deleted meanwhile are not in them).
    relist_services: Option<Services>,
    relist_slices: Option<Slices>,
    /// Both initial lists are complete.
    services_listed: bool,
    slices_listed: bool,
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

impl Cache {
    pub fn new() -> Self {
        Cache {
            full: true,
            ..Default::default()
        }
    }

    pub fn listed(&self) -> bool {
        self.services_listed && self.slices_listed
    }

    pub fn service_event(&mut self, e: &Event<Service>) {
        match e {
            Event::Init => self.relist_services = Some(HashMap::new()),
            Event::InitApply(s) => {
                let map = self.relist_services.get_or_insert_with(HashMap::new);
                if is_selected(s) {
                    map.insert(service_ref(s), Arc::new(read_service(s)));
                }
            }
            Event::InitDone => {
                if let Some(listed) = self.relist_services.take() {
                    self.services = listed;
                }
                self.services_listed = true;
                self.full = true;
            }
            Event::Apply(s) => {
                let key = service_ref(s);
                if is_selected(s) {
                    self.services.insert(key.clone(), Arc::new(read_service(s)));
                } else {
                    self.services.remove(&key);
                }
                self.touched.insert(key);
            }
            Event::Delete(s) => {
                let key = service_ref(s);
                self.services.remove(&key);
                self.touched.insert(key);
            }
        }
    }

    pub fn slice_event(&mut self, e: &Event<EndpointSlice>) {
        fn put(slices: &mut Slices, e: &EndpointSlice) -> Option<ServiceRef> {
            let owner = slice_owner(e)?;
            let name: Box<str> = e.metadata.name.as_deref().unwrap_or_default().into();
            let of_owner = slices.entry(owner.clone()).or_default();
            match CompactSlice::of(e) {
                Some(c) => of_owner.insert(name, c),
                None => of_owner.remove(&name),
            };
            Some(owner)
        }
        match e {
            Event::Init => self.relist_slices = Some(HashMap::new()),
            Event::InitApply(s) => {
                put(self.relist_slices.get_or_insert_with(HashMap::new), s);
            }
            Event::InitDone => {
                if let Some(listed) = self.relist_slices.take() {
                    self.slices = listed;
                }
                self.slices_listed = true;
                self.full = true;
            }
            Event::Apply(s) => {
                if let Some(owner) = put(&mut self.slices, s) {
                    self.touched.insert(owner);
                }
            }
            Event::Delete(s) => {
                if let Some(owner) = slice_owner(s) {
                    if let Some(of_owner) = self.slices.get_mut(&owner) {
                        of_owner.remove(s.metadata.name.as_deref().unwrap_or_default());
                        if of_owner.is_empty() {
                            self.slices.remove(&owner);
                        }
                    }
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
                read: self.services.get(&service).cloned(),
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
            read_services: self.services.values().cloned().collect(),
            endpoint_slices: self
                .services
                .keys()
                .flat_map(|s| self.slices_of(s))
                .collect(),
            ..Default::default()
        }
    }

    /// The uid of our Service `namespace/name` (Events name it).
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .get(&ServiceRef::new(namespace, name))
            .and_then(|s| s.uid.clone())
    }
}
