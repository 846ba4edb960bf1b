//! Which pod backs a Service: the ready addresses of its EndpointSlices, or,
//! while it has none, those serving while they terminate (as kube-proxy
//! reads the conditions: `ready` and `serving` unset count as true,
//! `terminating` unset as false); and on which nodes that address lives:
//! those of its serving endpoints and of its endpoints still starting (a
//! live migration's target pod holds the VM's IP before it is ready).
use super::types::{Family, ServiceRef, Uid};
use super::warning::{WarningKind, Warnings};
use super::FastMap;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Who wrote a slice, as the writer labels it.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// The EndpointSlice controller's value of [`MANAGED_BY_LABEL`]: it writes
/// the slices of a Service with a selector, from the Pods the selector
/// picks in the Service's namespace.
pub const SLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";

/// Who wrote an EndpointSlice, as far as the slice tells (see
/// `model/trust.rs` for what is trusted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Writer {
    /// Labelled as the EndpointSlice controller's, every endpoint naming a
    /// Pod of the slice's namespace (`targetRef`), with the Service it
    /// names as its owner (name, uid; none when it has no such owner).
    Controller { owner: Option<(Box<str>, Uid)> },
    /// Anything else: its `managed-by` label as written (none: unset), or
    /// the controller's label on a slice with an endpoint that names no
    /// Pod of its namespace.
    Other { manager: Option<Box<str>> },
}

/// An EndpointSlice as the model reads it: the addresses of its ready
/// endpoints, each with its endpoint's node. Every node keeps one per
/// EndpointSlice of the cluster, ours or not (a Service may become ours
/// later), and the plan reads them as kept: a small fraction of the object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadSlice {
    pub name: Box<str>,
    pub writer: Writer,
    /// The endpoints' addresses the model uses, each with its endpoint's
    /// `nodeName` and its [`Use`]; one list for the four (at 50 000
    /// slices, four boxed lists each were 2.3 MiB more).
    addresses: Box<[Address]>,
    /// Ready endpoints' addresses that are not IP addresses (reported).
    invalid: Box<[Box<str>]>,
}

/// An endpoint's address, its endpoint's `nodeName`, and its use.
type Address = (IpAddr, Option<Arc<str>>, Use);

/// What an endpoint's address is to the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// A ready endpoint's.
    Ready,
    /// Not ready, but serving and terminating: used while a family of the
    /// Service has no ready address (a pod draining its connections).
    Draining,
    /// Neither ready nor serving, not terminating: a pod starting. Never a
    /// backend by itself; its node is one more host of an address that
    /// backs the Service (a migration's target).
    Starting,
    /// A starting endpoint that was ready (or held) in the slice's previous
    /// version, while the source holds it through a readiness flap
    /// ([`ReadSlice::held_from`]): used while a family of the Service has
    /// neither ready nor draining addresses. Listed beside its `Starting`
    /// copy.
    Held,
}

impl ReadSlice {
    /// `None` for a slice the model never reads (not IPv4 or IPv6).
    /// `node` gives the shared copy of a node's name (thousands of
    /// endpoints name the same few nodes).
    pub fn of(slice: &EndpointSlice, node: &mut impl FnMut(&str) -> Arc<str>) -> Option<Self> {
        if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
            return None;
        }
        let mut addresses = Vec::new();
        let mut invalid = Vec::new();
        for endpoint in &slice.endpoints {
            let used = match Condition::of(endpoint.conditions.as_ref()) {
                Condition::Ready => Use::Ready,
                Condition::Draining => Use::Draining,
                Condition::Starting => Use::Starting,
                Condition::Unused => continue,
            };
            let node_name = endpoint.node_name.as_deref().map(&mut *node);
            for text in &endpoint.addresses {
                match text.parse::<IpAddr>() {
                    Ok(ip) => addresses.push((ip, node_name.clone(), used)),
                    Err(_) => invalid.push(text.as_str().into()),
                }
            }
        }
        Some(ReadSlice {
            name: slice.metadata.name.as_deref().unwrap_or_default().into(),
            writer: Writer::of(slice),
            addresses: addresses.into(),
            invalid: invalid.into(),
        })
    }

    /// Its addresses of one use, each with its endpoint's node.
    fn used(&self, used: Use) -> impl Iterator<Item = (&IpAddr, &Option<Arc<str>>)> {
        (self.addresses.iter())
            .filter(move |(_, _, u)| *u == used)
            .map(|(ip, node, _)| (ip, node))
    }

    /// This version with its starting endpoints that `previous` had ready
    /// or held kept as held: a ready pod whose readiness turns false
    /// without terminating (a kubelet restart resets every readiness
    /// probe until it runs again) keeps backing its LB IP while nothing
    /// else can. A deleted pod's endpoint is gone or terminating, never
    /// held: its address may go to another pod.
    /// `None` when it holds nothing.
    pub fn held_from(&self, previous: &ReadSlice) -> Option<ReadSlice> {
        let was = |(ip, node): &(&IpAddr, &Option<Arc<str>>)| {
            (previous.addresses.iter()).any(|(p_ip, p_node, u)| {
                matches!(u, Use::Ready | Use::Held) && p_ip == *ip && p_node == *node
            })
        };
        let held: Vec<Address> = (self.used(Use::Starting).filter(was))
            .map(|(ip, node)| (*ip, node.clone(), Use::Held))
            .collect();
        (!held.is_empty()).then(|| {
            let unheld = self.addresses.iter().filter(|(_, _, u)| *u != Use::Held);
            ReadSlice {
                addresses: unheld.cloned().chain(held).collect(),
                ..self.clone()
            }
        })
    }

    /// The addresses held through a readiness flap.
    pub fn held(&self) -> impl Iterator<Item = &IpAddr> {
        self.used(Use::Held).map(|(ip, _)| ip)
    }

    /// This version as its slice is, without what it holds (a hold's end);
    /// `None` when it holds nothing.
    pub fn unheld(&self) -> Option<ReadSlice> {
        (self.held().next().is_some()).then(|| ReadSlice {
            addresses: (self.addresses.iter())
                .filter(|(_, _, u)| *u != Use::Held)
                .cloned()
                .collect(),
            ..self.clone()
        })
    }

    /// Its name as a warning shows it.
    pub fn shown_name(&self) -> &str {
        if self.name.is_empty() {
            "?"
        } else {
            &self.name
        }
    }

    /// As [`ReadSlice::of`], each node name a copy of its own.
    pub fn of_alone(slice: &EndpointSlice) -> Option<Self> {
        Self::of(slice, &mut |n| n.into())
    }
}

impl Writer {
    fn of(slice: &EndpointSlice) -> Writer {
        let manager = (slice.metadata.labels.as_ref()).and_then(|l| l.get(MANAGED_BY_LABEL));
        let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
        // The controller names each endpoint's Pod, in the slice's
        // namespace: one that names anything else is not its work.
        let names_own_pods = slice.endpoints.iter().all(|e| {
            e.target_ref.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("Pod")
                    && r.namespace.as_deref().unwrap_or(namespace) == namespace
            })
        });
        if manager.map(String::as_str) != Some(SLICE_CONTROLLER) || !names_own_pods {
            return Writer::Other {
                manager: manager.map(|m| m.as_str().into()),
            };
        }
        let owner = (slice.metadata.owner_references.iter().flatten())
            .find(|o| is_a_service(o))
            .map(|o| (o.name.as_str().into(), Uid::new(&o.uid)));
        Writer::Controller { owner }
    }
}

/// Does `owner` name a Service (the only owner of a slice the model reads)?
pub(crate) fn is_a_service(owner: &OwnerReference) -> bool {
    owner.kind == "Service" && owner.api_version == "v1"
}

/// What an endpoint's conditions make of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Condition {
    Ready,
    /// Serving while terminating, not ready.
    Draining,
    /// Neither ready nor serving, not terminating.
    Starting,
    /// Terminating and no longer serving.
    Unused,
}

impl Condition {
    /// As kube-proxy reads them: `ready` and `serving` unset count as
    /// true, `terminating` unset as false.
    fn of(c: Option<&k8s_openapi::api::discovery::v1::EndpointConditions>) -> Self {
        let ready = c.and_then(|c| c.ready).unwrap_or(true);
        let serving = c.and_then(|c| c.serving).unwrap_or(ready);
        let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
        match (ready, serving, terminating) {
            (true, _, _) => Condition::Ready,
            (false, true, true) => Condition::Draining,
            (false, _, false) => Condition::Starting,
            (false, false, true) => Condition::Unused,
        }
    }
}

/// EndpointSlice objects read, grouped by the Service they belong to.
pub struct SliceIndex {
    by_service: FastMap<ServiceRef, Vec<ReadSlice>>,
}

impl SliceIndex {
    pub fn new<E: Borrow<EndpointSlice>>(slices: &[E]) -> Self {
        let mut by_service: FastMap<ServiceRef, Vec<ReadSlice>> = FastMap::default();
        for slice in slices.iter().map(Borrow::borrow) {
            if let (Some(owner), Some(read)) = (slice_owner(slice), ReadSlice::of_alone(slice)) {
                by_service.entry(owner).or_default().push(read);
            }
        }
        SliceIndex { by_service }
    }

    /// The slices of `service`, as [`ready_addresses`] reads them.
    pub fn slices_of(&self, service: &ServiceRef) -> Vec<&ReadSlice> {
        self.by_service.get(service).into_iter().flatten().collect()
    }
}

/// The Service an EndpointSlice belongs to (its `kubernetes.io/service-name`
/// label, in its namespace).
pub fn slice_owner(slice: &EndpointSlice) -> Option<ServiceRef> {
    let owner = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
    Some(ServiceRef::new(namespace, owner.as_str()))
}

/// A ready endpoint address, with the nodes its endpoints name.
pub(crate) type Backends = BTreeMap<Family, BTreeMap<IpAddr, EndpointNodes>>;

/// The nodes the endpoints of one address name (none when no endpoint
/// says).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct EndpointNodes {
    /// Of its ready (or serving) endpoints.
    pub serving: BTreeSet<Arc<str>>,
    /// Of its endpoints starting, on other nodes.
    pub starting: BTreeSet<Arc<str>>,
}

/// The distinct ready endpoint addresses of a Service, per family, with
/// their `nodeName`s; a family without any takes its serving terminating
/// ones (kube-proxy's rule: a pod draining its connections keeps them
/// while nothing replaces it), and without those its held ones (a ready
/// pod's readiness flapping, [`ReadSlice::held_from`]). An address also
/// names the nodes of its endpoints still starting. Unparsable addresses
/// are reported.
pub(crate) fn ready_addresses(slices: &[&ReadSlice], warnings: &mut Warnings<'_>) -> Backends {
    let mut out = Backends::new();
    let mut draining = Backends::new();
    let mut held = Backends::new();
    let add = |to: &mut Backends, (ip, node): (&IpAddr, &Option<Arc<str>>)| {
        let nodes = to
            .entry(Family::of(ip))
            .or_default()
            .entry(*ip)
            .or_default();
        nodes.serving.extend(node.iter().cloned());
    };
    for slice in slices {
        slice.used(Use::Ready).for_each(|e| add(&mut out, e));
        slice
            .used(Use::Draining)
            .for_each(|e| add(&mut draining, e));
        slice.used(Use::Held).for_each(|e| add(&mut held, e));
        for text in slice.invalid.iter() {
            warnings.push(
                WarningKind::InvalidIp,
                format!(
                    "endpoint address {text:?} in EndpointSlice {} is not an IP address; skipped",
                    slice.shown_name()
                ),
            );
        }
    }
    for (family, addrs) in draining.into_iter().chain(held) {
        out.entry(family).or_insert(addrs);
    }
    for (ip, node) in slices.iter().flat_map(|s| s.used(Use::Starting)) {
        let backing = out.get_mut(&Family::of(ip)).and_then(|a| a.get_mut(ip));
        if let (Some(nodes), Some(node)) = (backing, node) {
            if !nodes.serving.contains(node) {
                nodes.starting.insert(node.clone());
            }
        }
    }
    out
}
