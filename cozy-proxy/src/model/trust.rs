//! Which EndpointSlices a Service's pod is read from. A slice maps the
//! Service's public IP to the address it names, both ways: whoever writes
//! one for another tenant's pod takes that pod's traffic and egress
//! identity. Labels prove nothing by themselves (anyone who may write a
//! slice writes its labels too), so a slice counts where its writer is the
//! one that picks addresses from Pods:
//!
//! - the EndpointSlice controller's own slices (`managed-by` its name, the
//!   Service its owner, every endpoint naming a Pod of the namespace) of a
//!   Service with a selector. The controller deletes or rewrites a slice
//!   with its label that it did not write, for a Service with a selector;
//!   for one without, it writes none, and any slice there is someone
//!   else's;
//! - any slice in a namespace the operator lists (`--trust-unmanaged-slices`:
//!   selector-less Services whose slices an administrator writes, or the
//!   mirroring controller copies from Endpoints);
//! - any slice read from manifests (the operator wrote them all).
//!
//! Kubernetes' own roles (`admin`, `edit`) grant no write on EndpointSlices,
//! nor on Endpoints since 1.22; docs/security.md states what is left to
//! RBAC.
use super::endpoints::{ReadSlice, Writer, SLICE_CONTROLLER};
use super::service::ReadService;
use super::warning::{first_few, WarningKind, Warnings};
use std::collections::BTreeSet;

/// Which slices count, the same on every node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SliceTrust {
    /// Every slice labelled with the Service's name (manifests).
    #[default]
    Any,
    /// The EndpointSlice controller's own slices of a Service with a
    /// selector, and every slice in the listed namespaces.
    Controller { unmanaged_in: BTreeSet<Box<str>> },
}

/// At most this many slices are named in one warning.
const NAMED: usize = 4;

impl SliceTrust {
    /// From `--trust-unmanaged-slices`: namespaces, or `*` for every one.
    pub fn with_unmanaged_in(namespaces: &[String]) -> SliceTrust {
        if namespaces.iter().any(|n| n == "*") {
            return SliceTrust::Any;
        }
        SliceTrust::Controller {
            unmanaged_in: namespaces.iter().map(|n| n.as_str().into()).collect(),
        }
    }

    /// The slices of `service` that count; each other one is reported on
    /// the Service (one warning naming a few).
    pub(crate) fn trusted<'a>(
        &self,
        service: &ReadService,
        slices: &[&'a ReadSlice],
        warnings: &mut Warnings<'_>,
    ) -> Vec<&'a ReadSlice> {
        let SliceTrust::Controller { unmanaged_in } = self else {
            return slices.to_vec();
        };
        if unmanaged_in.contains(&*service.intent.service.namespace) {
            return slices.to_vec();
        }
        let mut kept = Vec::with_capacity(slices.len());
        let mut refused = Vec::new();
        for slice in slices {
            match why_not_the_controllers(service, slice) {
                None => kept.push(*slice),
                Some(why) => refused.push(format!("{} ({why})", slice.shown_name())),
            }
        }
        if !refused.is_empty() {
            warnings.push(
                WarningKind::UntrustedEndpointSlice,
                format!(
                    "EndpointSlice {} not written by the EndpointSlice controller for this Service; its endpoints are not used (--trust-unmanaged-slices lists the namespaces whose hand-written slices are)",
                    first_few(refused, NAMED)
                ),
            );
        }
        kept
    }
}

/// Why `slice` is not the EndpointSlice controller's for `service`.
fn why_not_the_controllers(service: &ReadService, slice: &ReadSlice) -> Option<String> {
    let owner = match &slice.writer {
        Writer::Other { manager: None } => return Some("no managed-by label".into()),
        Writer::Other { manager: Some(m) } if **m == *SLICE_CONTROLLER => {
            return Some("an endpoint names no Pod of the namespace".into())
        }
        Writer::Other { manager: Some(m) } => return Some(format!("managed by {m}")),
        Writer::Controller { owner } => owner,
    };
    if !service.selects_pods {
        return Some("the Service has no selector".into());
    }
    match owner {
        Some((name, uid))
            if **name == *service.intent.service.name
                && service.uid.as_ref().is_none_or(|u| u == uid) =>
        {
            None
        }
        _ => Some("not owned by the Service".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::SliceTrust;
    use crate::fixtures::{Slice, Svc};
    use crate::model::{
        compute_plan_with, trim, Forbidden, Outcome, WarningKind, MANAGED_BY_LABEL,
    };
    use k8s_openapi::api::{
        core::v1::{ObjectReference, Service},
        discovery::v1::EndpointSlice,
    };

    const UID: &str = "0b5e1ad2-3c9a-4f7e-9d21-6a1f2b3c4d5e";
    const POD: &str = "192.0.2.11";

    /// Tenant `ns`'s Service `vm` on 203.0.113.10, with a selector and a
    /// uid, as the API holds it.
    fn service(selector: bool) -> Service {
        let svc = Svc::new("vm", "203.0.113.10").in_namespace("ns");
        let mut s = match selector {
            true => svc.selecting(),
            false => svc,
        }
        .object();
        s.metadata.uid = Some(UID.into());
        s
    }

    /// Its slice as the EndpointSlice controller writes it: its label, the
    /// Service its owner, each endpoint naming its Pod.
    fn controllers(address: &str) -> EndpointSlice {
        Slice::new("vm", "IPv4", &[(address, None)])
            .in_namespace("ns")
            .by_the_controller(UID)
            .object()
    }

    fn plan(trust: SliceTrust, service: Service, slice: EndpointSlice) -> Outcome {
        let forbidden = Forbidden::new(&[], &[]).trusting(trust);
        let whole = compute_plan_with(
            std::slice::from_ref(&service),
            std::slice::from_ref(&slice),
            &forbidden,
        );
        // Trimmed as the API source keeps them, the same outcome.
        let (mut s, mut e) = (service, slice);
        trim::trim_service(&mut s);
        trim::trim_slice(&mut e);
        assert_eq!(compute_plan_with(&[s], &[e], &forbidden), whole);
        whole
    }

    fn strict() -> SliceTrust {
        SliceTrust::with_unmanaged_in(&["infra".into()])
    }

    fn mapped(o: &Outcome) -> Vec<String> {
        o.plan
            .mappings
            .iter()
            .map(|m| m.pod_ip.to_string())
            .collect()
    }

    /// Refused: nothing mapped, one UntrustedEndpointSlice warning whose
    /// message gives `why`.
    fn refused(o: &Outcome, why: &str) {
        assert!(o.plan.mappings.is_empty(), "{:?}", o.plan.mappings);
        let untrusted: Vec<&str> = (o.warnings.iter())
            .filter(|w| w.kind == WarningKind::UntrustedEndpointSlice)
            .map(|w| w.message.as_str())
            .collect();
        assert!(
            matches!(untrusted.as_slice(), [m] if m.contains(why)),
            "{why}: {:?}",
            o.warnings
        );
    }

    #[test]
    fn the_controllers_slice_of_a_service_with_a_selector_counts() {
        let o = plan(strict(), service(true), controllers(POD));
        assert_eq!(mapped(&o), [POD]);
        assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    }

    #[test]
    fn a_hand_written_slice_counts_only_where_its_namespace_is_listed() {
        let hand = Slice::new("vm", "IPv4", &[(POD, None)]).in_namespace("ns");
        refused(
            &plan(strict(), service(false), hand.object()),
            "no managed-by label",
        );
        let listed = SliceTrust::with_unmanaged_in(&["infra".into(), "ns".into()]);
        assert_eq!(mapped(&plan(listed, service(false), hand.object())), [POD]);
        let every = SliceTrust::with_unmanaged_in(&["*".into()]);
        assert_eq!(every, SliceTrust::Any);
        assert_eq!(mapped(&plan(every, service(false), hand.object())), [POD]);
        // Another manager (the mirroring controller's copy of Endpoints).
        let mut mirrored = hand.object();
        let labels = mirrored
            .metadata
            .labels
            .get_or_insert_with(Default::default);
        labels.insert(
            MANAGED_BY_LABEL.into(),
            "endpointslicemirroring-controller.k8s.io".into(),
        );
        refused(
            &plan(strict(), service(false), mirrored),
            "managed by endpointslicemirroring-controller.k8s.io",
        );
    }

    #[test]
    fn the_controllers_label_on_a_slice_it_did_not_write_counts_for_nothing() {
        // A Service without a selector gets no slice from the controller.
        refused(
            &plan(strict(), service(false), controllers(POD)),
            "the Service has no selector",
        );
        // Not owned by the Service, or by another object of its name.
        let mut orphan = controllers(POD);
        orphan.metadata.owner_references = None;
        refused(
            &plan(strict(), service(true), orphan),
            "not owned by the Service",
        );
        let mut stale = controllers(POD);
        if let Some(o) = stale.metadata.owner_references.as_mut() {
            o[0].uid = "1b5e1ad2-3c9a-4f7e-9d21-6a1f2b3c4d5e".into();
        }
        refused(
            &plan(strict(), service(true), stale),
            "not owned by the Service",
        );
        // An endpoint naming another tenant's Pod, or no Pod.
        for target in [
            Some(ObjectReference {
                kind: Some("Pod".into()),
                namespace: Some("tenant-b".into()),
                name: Some("vm-b".into()),
                ..Default::default()
            }),
            Some(ObjectReference {
                kind: Some("Node".into()),
                name: Some("node-a".into()),
                ..Default::default()
            }),
            None,
        ] {
            let mut foreign = controllers(POD);
            foreign.endpoints[0].target_ref = target;
            refused(
                &plan(strict(), service(true), foreign),
                "an endpoint names no Pod of the namespace",
            );
        }
    }

    #[test]
    fn refused_slices_are_named_a_few_at_a_time() {
        let forbidden = Forbidden::new(&[], &[]).trusting(strict());
        let slices: Vec<EndpointSlice> = (0..10)
            .map(|i| {
                Slice::new("vm", "IPv4", &[(POD, None)])
                    .named(&format!("forged-{i}"))
                    .in_namespace("ns")
                    .object()
            })
            .collect();
        let o = compute_plan_with(&[service(true)], &slices, &forbidden);
        refused(&o, "and 6 more");
    }
}
