//! From Services and EndpointSlices to the NAT plan.
use super::endpoints::{ready_addresses, SliceIndex};
use super::service::{is_selected, read_intent, service_ref, ServiceIntent};
use super::types::{Family, Mapping, Plan};
use super::warning::{Warning, WarningKind, Warnings};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

/// The plan and every problem found on the way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub plan: Plan,
    /// Sorted, without repeats.
    pub warnings: Vec<Warning>,
}

/// One family's wish of one Service, before conflicts are settled.
struct Candidate {
    lb_ip: IpAddr,
    /// `None`: no single ready endpoint; the LB IP stays unmapped.
    pod_ip: Option<IpAddr>,
}

/// Computes the NAT plan. Pure and deterministic: the same objects in any
/// order give the same outcome, on every node.
pub fn compute_plan(services: &[Service], slices: &[EndpointSlice]) -> Outcome {
    let index = SliceIndex::new(slices);
    let mut warnings = Vec::new();
    let mut wishes: Vec<(ServiceIntent, Vec<Candidate>)> = Vec::new();
    for svc in unique_services(services) {
        let service = service_ref(svc);
        let mut sink = Warnings {
            service: &service,
            out: &mut warnings,
        };
        let intent = read_intent(svc, &mut sink);
        let backends = ready_addresses(index.slices_of(&service), &mut sink);
        let candidates = candidates(&intent, &backends, &mut sink);
        wishes.push((intent, candidates));
    }
    // Older Services win conflicts; ties broken by namespace/name so that
    // every node decides the same way.
    wishes.sort_by(|(a, _), (b, _)| (&a.created, &a.service).cmp(&(&b.created, &b.service)));

    let mut plan = Plan::default();
    let mut lb_owner: HashMap<IpAddr, usize> = HashMap::new();
    let mut pod_owner: HashMap<IpAddr, usize> = HashMap::new();
    for (i, (intent, candidates)) in wishes.iter().enumerate() {
        let mut sink = Warnings {
            service: &intent.service,
            out: &mut warnings,
        };
        for c in candidates {
            // The older Service owns its LB IP even while it has no ready
            // endpoint: a newer one must not take the traffic over whenever
            // the owner's pod restarts.
            if let Some(&owner) = lb_owner.get(&c.lb_ip) {
                sink.push(
                    WarningKind::LoadBalancerIpConflict,
                    format!(
                        "load-balancer IP {} is already claimed by older Service {}",
                        c.lb_ip, wishes[owner].0.service
                    ),
                );
                continue;
            }
            lb_owner.insert(c.lb_ip, i);
            let pod_ip = match c.pod_ip {
                Some(pod_ip) => match pod_owner.get(&pod_ip) {
                    Some(&owner) => {
                        sink.push(
                            WarningKind::PodIpConflict,
                            format!(
                                "pod IP {pod_ip} is already mapped for older Service {}; {} stays unmapped",
                                wishes[owner].0.service, c.lb_ip
                            ),
                        );
                        None
                    }
                    None => Some(pod_ip),
                },
                None => None,
            };
            match pod_ip {
                Some(pod_ip) => {
                    pod_owner.insert(pod_ip, i);
                    plan.mappings.push(Mapping {
                        service: intent.service.clone(),
                        lb_ip: c.lb_ip,
                        pod_ip,
                        mode: intent.mode.clone(),
                    });
                }
                None => {
                    plan.unmapped_lb_ips.insert(c.lb_ip, intent.service.clone());
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
/// by input order: the older, then the smaller serialization.
fn unique_services(services: &[Service]) -> Vec<&Service> {
    let mut by_name: BTreeMap<_, Vec<&Service>> = BTreeMap::new();
    for svc in services.iter().filter(|s| is_selected(s)) {
        by_name.entry(service_ref(svc)).or_default().push(svc);
    }
    by_name
        .into_values()
        .filter_map(|mut group| {
            if group.len() > 1 {
                group.sort_by_cached_key(|s| {
                    (
                        s.metadata.creation_timestamp.as_ref().map(|t| t.0),
                        serde_json::to_string(s).unwrap_or_default(),
                    )
                });
            }
            group.into_iter().next()
        })
        .collect()
}

/// Per family: the first LB IP and the one ready backend, if exactly one.
fn candidates(
    intent: &ServiceIntent,
    backends: &BTreeMap<Family, std::collections::BTreeSet<IpAddr>>,
    warnings: &mut Warnings<'_>,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        let mut lbs = intent.lb_ips.iter().filter(|ip| Family::of(ip) == family);
        let Some(&lb_ip) = lbs.next() else { continue };
        let extra: Vec<String> = lbs.map(ToString::to_string).collect();
        if !extra.is_empty() {
            warnings.push(
                WarningKind::ExtraLoadBalancerIp,
                format!(
                    "a 1:1 NAT maps one IP per family: {lb_ip} is used, {} ignored",
                    extra.join(", ")
                ),
            );
        }
        let pods = backends.get(&family);
        let pod_ip = match pods.map(|p| p.len()).unwrap_or(0) {
            0 => {
                warnings.push(
                    WarningKind::NoReadyEndpoint,
                    format!("no ready {family:?} endpoint; {lb_ip} is not mapped and its traffic is dropped"),
                );
                None
            }
            1 => pods.and_then(|p| p.iter().next().copied()),
            _ => {
                let list: Vec<String> = pods
                    .into_iter()
                    .flatten()
                    .map(ToString::to_string)
                    .collect();
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
        out.push(Candidate { lb_ip, pod_ip });
    }
    out
}
