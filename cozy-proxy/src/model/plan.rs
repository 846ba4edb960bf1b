//! From Services and EndpointSlices to the NAT plan.
use super::cluster::node_addresses;
use super::endpoints::{ready_addresses, Backends, EndpointNodes, ReadSlice, SliceIndex};
use super::service::{is_selected, read_service, service_ref, ReadService, ServiceIntent};
use super::trust::SliceTrust;
use super::types::{Family, Hosts, Mapping, Plan, ServiceRef};
use super::warning::{first_few, Warning, WarningKind, Warnings};
use super::Cidr;
use super::FastMap;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

/// The plan and every problem found on the way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub plan: Plan,
    /// Sorted, without repeats.
    pub warnings: Vec<Warning>,
}

/// One family's wish of one Service, before conflicts are settled.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub lb_ip: IpAddr,
    /// `None`: no single ready endpoint; the LB IP stays unmapped.
    pub pod_ip: Option<IpAddr>,
    /// The nodes of the endpoints holding `pod_ip`.
    pub hosts: Hosts,
}

/// The addresses never translated besides the kinds no Service may take
/// (loopback, link-local, ...): the nodes' own, as their Node objects
/// publish them, and the operator's reserved ranges (`--reserved-cidrs`:
/// node VIPs, which float between nodes and appear in no Node object). A
/// Service on one of them would get the nodes' own traffic to that
/// address translated to its pod. The same on every node, as the plan is.
/// The ClusterIP ranges (`ServiceCIDR`s) are never a pod's either: a
/// Service on one would take the traffic kube-proxy balances. Which
/// EndpointSlices count goes with them ([`SliceTrust`]): what no Service
/// may name as its pod.
#[derive(Clone, Debug, Default)]
pub struct Forbidden {
    node_ips: BTreeSet<IpAddr>,
    reserved: Vec<Cidr>,
    service_cidrs: Vec<Cidr>,
    slices: SliceTrust,
}

impl Forbidden {
    pub fn new(nodes: &[Node], reserved: &[Cidr]) -> Forbidden {
        Forbidden {
            node_ips: node_addresses(nodes),
            reserved: reserved.to_vec(),
            ..Default::default()
        }
    }

    /// With the ClusterIP ranges of `cidrs` (unparsable ones are reported
    /// where the in-cluster ranges are read).
    pub fn with_service_cidrs(mut self, cidrs: &[ServiceCIDR]) -> Forbidden {
        self.service_cidrs = (cidrs.iter())
            .flat_map(|c| c.spec.iter().flat_map(|s| s.cidrs.iter().flatten()))
            .filter_map(|text| text.parse().ok())
            .collect();
        self
    }

    /// Reading a Service's pod only from the slices `trust` counts.
    pub fn trusting(mut self, trust: SliceTrust) -> Forbidden {
        self.slices = trust;
        self
    }

    /// Why `ip` must never be translated: `None` if it may be.
    fn why(&self, ip: &IpAddr) -> Option<&'static str> {
        let link_local = match ip {
            IpAddr::V4(a) => a.is_link_local(),
            IpAddr::V6(a) => a.is_unicast_link_local(),
        };
        if ip.is_unspecified() {
            Some("unspecified")
        } else if ip.is_loopback() {
            Some("loopback")
        } else if ip.is_multicast() || matches!(ip, IpAddr::V4(a) if a.is_broadcast()) {
            Some("multicast or broadcast")
        } else if link_local {
            Some("link-local")
        } else if self.node_ips.contains(ip) {
            Some("a node's own address")
        } else if self.reserved.iter().any(|c| c.contains(ip)) {
            Some("reserved (--reserved-cidrs: a node VIP)")
        } else if self.service_cidrs.iter().any(|c| c.contains(ip)) {
            Some("in a ServiceCIDR (ClusterIPs)")
        } else {
            None
        }
    }
}

/// One Service's wish, from its own objects alone: what it asks for
/// (shared with the source's cache, not copied), the candidates per
/// family, and the problems found in its objects. Conflicts between
/// Services are settled after ([`compute_plan`], or
/// [`super::incremental::PlanState`] one Service at a time).
#[derive(Clone, Debug)]
pub(crate) struct Wish {
    pub read: Arc<ReadService>,
    pub candidates: Box<[Candidate]>,
    /// Problems found beside the Service's own (`read.warnings`): in its
    /// slices, its forbidden addresses.
    pub found: Vec<Warning>,
}

/// Who wins a conflict: the older Service, ties broken by namespace/name,
/// so that every node decides the same way. Its Service as read, shared
/// with its wish: the plan keeps one in every claim on an address, a
/// pointer, not a copy of the timestamp and the name per claim.
#[derive(Clone, Debug)]
pub(crate) struct Rank(Arc<ReadService>);

impl Rank {
    fn key(&self) -> (&Option<k8s_openapi::jiff::Timestamp>, &ServiceRef) {
        (&self.0.intent.created, &self.0.intent.service)
    }

    pub fn service(&self) -> &ServiceRef {
        &self.0.intent.service
    }
}

impl PartialEq for Rank {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Rank {}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rank {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl Wish {
    pub fn intent(&self) -> &ServiceIntent {
        &self.read.intent
    }

    pub fn rank(&self) -> Rank {
        Rank(self.read.clone())
    }

    /// Every problem of this Service's own objects.
    pub fn warnings(&self) -> impl Iterator<Item = &Warning> {
        self.read.warnings.iter().chain(&self.found)
    }

    pub fn candidate(&self, lb_ip: &IpAddr) -> Option<&Candidate> {
        self.candidates.iter().find(|c| c.lb_ip == *lb_ip)
    }

    /// The mapping of candidate `c` to `pod_ip`.
    pub fn mapping(&self, c: &Candidate, pod_ip: IpAddr) -> Mapping {
        let intent = self.intent();
        let family = Family::of(&c.lb_ip);
        Mapping {
            service: intent.service.clone(),
            lb_ip: c.lb_ip,
            pod_ip,
            mode: intent.mode.clone(),
            hosts: c.hosts.clone(),
            source_ranges: intent.source_ranges.as_ref().map(|r| {
                r.iter()
                    .filter(|c| Family::of(&c.addr()) == family)
                    .copied()
                    .collect()
            }),
        }
    }
}

/// What a Service that lost LB IP `lb_ip` to `owner` is told.
pub(crate) fn lb_conflict(service: &ServiceRef, lb_ip: &IpAddr, owner: &ServiceRef) -> Warning {
    Warning {
        service: service.clone(),
        kind: WarningKind::LoadBalancerIpConflict,
        message: format!("load-balancer IP {lb_ip} is already claimed by older Service {owner}"),
    }
}

/// What the owner of `lb_ip` whose pod `pod_ip` went to `owner` is told.
pub(crate) fn pod_conflict(
    service: &ServiceRef,
    lb_ip: &IpAddr,
    pod_ip: &IpAddr,
    owner: &ServiceRef,
) -> Warning {
    Warning {
        service: service.clone(),
        kind: WarningKind::PodIpConflict,
        message: format!(
            "pod IP {pod_ip} is already mapped for older Service {owner}; {lb_ip} stays unmapped"
        ),
    }
}

/// What the owner of `lb_ip` whose endpoint is `pod_ip`, the LB IP of
/// `holder`, is told: an LB IP is never a pod (translated to it, the
/// packets would meet the holder's translation, and egress from it would
/// leave as `lb_ip`).
pub(crate) fn pod_is_an_lb_ip(
    service: &ServiceRef,
    lb_ip: &IpAddr,
    pod_ip: &IpAddr,
    holder: &ServiceRef,
) -> Warning {
    Warning {
        service: service.clone(),
        kind: WarningKind::ForbiddenAddress,
        message: format!(
            "endpoint address {pod_ip} is the load-balancer IP of Service {holder}; {lb_ip} is not mapped"
        ),
    }
}

/// The wish of Service `read` (a selected one) with `slices`, the
/// EndpointSlices labelled with its name.
pub(crate) fn wish_of(
    read: Arc<ReadService>,
    slices: &[&ReadSlice],
    forbidden: &Forbidden,
) -> Wish {
    let service = &read.intent.service;
    let mut found = Vec::new();
    let mut sink = Warnings {
        service,
        out: &mut found,
    };
    let mut lb_ips = read.intent.lb_ips.to_vec();
    lb_ips.retain(|ip| match forbidden.why(ip) {
        None => true,
        Some(why) => {
            sink.push(
                WarningKind::ForbiddenAddress,
                format!("load-balancer IP {ip} is {why}; never translated"),
            );
            false
        }
    });
    let slices = forbidden.slices.trusted(&read, slices, &mut sink);
    let backends = ready_addresses(&slices, &mut sink);
    let candidates = candidates(&lb_ips, &backends, forbidden, &mut sink).into();
    Wish {
        read,
        candidates,
        found,
    }
}

/// Computes the NAT plan. Pure and deterministic: the same objects in any
/// order give the same outcome, on every node. `nodes` tell which addresses
/// are the nodes' own (never translated).
pub fn compute_plan<S, E>(services: &[S], slices: &[E], nodes: &[Node]) -> Outcome
where
    S: Borrow<Service>,
    E: Borrow<EndpointSlice>,
{
    compute_plan_with(services, slices, &Forbidden::new(nodes, &[]))
}

/// [`compute_plan`] with the addresses never translated given whole.
pub fn compute_plan_with<S, E>(services: &[S], slices: &[E], forbidden: &Forbidden) -> Outcome
where
    S: Borrow<Service>,
    E: Borrow<EndpointSlice>,
{
    let index = SliceIndex::new(slices);
    let mut warnings = Vec::new();
    let mut wishes: Vec<Wish> = unique_services(services)
        .into_iter()
        .map(|svc| {
            wish_of(
                Arc::new(read_service(svc)),
                &index.slices_of(&service_ref(svc)),
                forbidden,
            )
        })
        .collect();
    wishes.sort_by_cached_key(Wish::rank);

    // Every LB IP asked for, with its oldest claimant: none is a pod.
    let mut lb_first: FastMap<IpAddr, usize> = FastMap::default();
    for (i, wish) in wishes.iter().enumerate() {
        for c in &wish.candidates {
            lb_first.entry(c.lb_ip).or_insert(i);
        }
    }
    let mut plan = Plan::default();
    let mut lb_owner: FastMap<IpAddr, usize> = FastMap::default();
    let mut pod_owner: FastMap<IpAddr, usize> = FastMap::default();
    for (i, wish) in wishes.iter().enumerate() {
        let service = &wish.intent().service;
        warnings.extend(wish.warnings().cloned());
        for c in &wish.candidates {
            // The older Service owns its LB IP even while it has no ready
            // endpoint: a newer one must not take the traffic over whenever
            // the owner's pod restarts.
            if let Some(&owner) = lb_owner.get(&c.lb_ip) {
                warnings.push(lb_conflict(
                    service,
                    &c.lb_ip,
                    &wishes[owner].intent().service,
                ));
                continue;
            }
            lb_owner.insert(c.lb_ip, i);
            let pod_ip = match c.pod_ip {
                Some(pod_ip) if lb_first.contains_key(&pod_ip) => {
                    let holder = &wishes[lb_first[&pod_ip]].intent().service;
                    warnings.push(pod_is_an_lb_ip(service, &c.lb_ip, &pod_ip, holder));
                    None
                }
                Some(pod_ip) => match pod_owner.get(&pod_ip) {
                    Some(&owner) => {
                        warnings.push(pod_conflict(
                            service,
                            &c.lb_ip,
                            &pod_ip,
                            &wishes[owner].intent().service,
                        ));
                        None
                    }
                    None => Some(pod_ip),
                },
                None => None,
            };
            match pod_ip {
                Some(pod_ip) => {
                    pod_owner.insert(pod_ip, i);
                    plan.mappings.push(wish.mapping(c, pod_ip));
                }
                None => {
                    plan.unmapped_lb_ips.insert(c.lb_ip, service.clone());
                }
            }
        }
    }
    plan.mappings.sort_by_key(|m| m.lb_ip);
    warnings.sort();
    warnings.dedup();
    Outcome { plan, warnings }
}

/// The selected Services, one per namespace/name. Two objects with one name
/// (a broken input, e.g. two manifest files) are settled by content, never
/// by input order: see [`choose`].
fn unique_services<S: Borrow<Service>>(services: &[S]) -> Vec<&Service> {
    let mut by_name: BTreeMap<_, Vec<&Service>> = BTreeMap::new();
    for svc in services
        .iter()
        .map(Borrow::borrow)
        .filter(|s| is_selected(s))
    {
        by_name.entry(service_ref(svc)).or_default().push(svc);
    }
    by_name.into_values().filter_map(choose).collect()
}

/// What the model reads of the objects of one Service name: the one that
/// counts among the selected ones (see [`choose`]), if any.
pub fn read_chosen(objects: &[&Service]) -> Option<ReadService> {
    let selected = objects.iter().copied().filter(|s| is_selected(s)).collect();
    choose(selected).map(read_service)
}

/// The one of several selected objects with one namespace/name that
/// counts: the older, then the smaller serialization.
fn choose(mut group: Vec<&Service>) -> Option<&Service> {
    if group.len() > 1 {
        group.sort_by_cached_key(|s| {
            (
                s.metadata.creation_timestamp.as_ref().map(|t| t.0),
                serde_json::to_string(s).unwrap_or_default(),
            )
        });
    }
    group.into_iter().next()
}

/// Per family: the first LB IP and the one ready backend, if exactly one.
fn candidates(
    lb_ips: &[IpAddr],
    backends: &Backends,
    forbidden: &Forbidden,
    warnings: &mut Warnings<'_>,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        let mut lbs = lb_ips.iter().filter(|ip| Family::of(ip) == family);
        let Some(&lb_ip) = lbs.next() else { continue };
        let mut extra = lbs.peekable();
        if extra.peek().is_some() {
            const LISTED: usize = 8;
            warnings.push(
                WarningKind::ExtraLoadBalancerIp,
                format!(
                    "a 1:1 NAT maps one IP per family: {lb_ip} is used, {} ignored",
                    first_few(extra, LISTED)
                ),
            );
        }
        let pods: Vec<(&IpAddr, &EndpointNodes)> =
            backends.get(&family).into_iter().flatten().collect();
        let mut hosts = Hosts::Unnamed;
        let pod_ip = match pods.as_slice() {
            [] => {
                warnings.push(
                    WarningKind::NoReadyEndpoint,
                    format!("no ready {family:?} endpoint; {lb_ip} is not mapped and its traffic is dropped"),
                );
                None
            }
            [(ip, nodes)] => {
                hosts = Hosts::of(&nodes.serving, &nodes.starting);
                match forbidden.why(ip) {
                    None => Some(**ip),
                    Some(why) => {
                        warnings.push(
                            WarningKind::ForbiddenAddress,
                            format!("endpoint address {ip} is {why}; {lb_ip} is not mapped"),
                        );
                        None
                    }
                }
            }
            many => {
                let list: Vec<String> = many.iter().map(|(ip, _)| ip.to_string()).collect();
                warnings.push(
                    WarningKind::MultipleEndpoints,
                    format!(
                        "several ready endpoint addresses ({}); a 1:1 NAT needs exactly one; {lb_ip} is not mapped",
                        list.join(", ")
                    ),
                );
                None
            }
        };
        out.push(Candidate {
            lb_ip,
            pod_ip,
            hosts,
        });
    }
    out
}
