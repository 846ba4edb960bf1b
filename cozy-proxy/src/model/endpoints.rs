//! Which pod backs a Service: the ready addresses of its EndpointSlices.
use super::types::{Family, ServiceRef};
use super::warning::{WarningKind, Warnings};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// EndpointSlices grouped by the Service they belong to.
pub struct SliceIndex<'a> {
    by_service: HashMap<ServiceRef, Vec<&'a EndpointSlice>>,
}

impl<'a> SliceIndex<'a> {
    pub fn new<E: Borrow<EndpointSlice>>(slices: &'a [E]) -> Self {
        let mut by_service: HashMap<ServiceRef, Vec<&'a EndpointSlice>> = HashMap::new();
        for slice in slices.iter().map(Borrow::borrow) {
            if let Some(owner) = slice_owner(slice) {
                by_service.entry(owner).or_default().push(slice);
            }
        }
        SliceIndex { by_service }
    }

    pub fn slices_of(&self, service: &ServiceRef) -> &[&'a EndpointSlice] {
        self.by_service.get(service).map_or(&[], Vec::as_slice)
    }
}

/// The Service an EndpointSlice belongs to (its `kubernetes.io/service-name`
/// label, in its namespace).
pub fn slice_owner(slice: &EndpointSlice) -> Option<ServiceRef> {
    let owner = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
    Some(ServiceRef::new(namespace, owner.as_str()))
}

/// A ready endpoint address, with the nodes its endpoints name (none when
/// no endpoint says).
pub(crate) type Backends = BTreeMap<Family, BTreeMap<IpAddr, BTreeSet<String>>>;

/// The distinct ready endpoint addresses of a Service, per family, with
/// their `nodeName`s. An endpoint whose `ready` condition is unset counts as
/// ready (as the API documents). FQDN slices are ignored; unparsable
/// addresses are reported.
pub(crate) fn ready_addresses(slices: &[&EndpointSlice], warnings: &mut Warnings<'_>) -> Backends {
    let mut out = Backends::new();
    for slice in slices {
        if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
            continue;
        }
        for endpoint in &slice.endpoints {
            let ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            if !ready {
                continue;
            }
            for text in &endpoint.addresses {
                match text.parse::<IpAddr>() {
                    Ok(ip) => {
                        let nodes = out.entry(Family::of(&ip)).or_default().entry(ip).or_default();
                        nodes.extend(endpoint.node_name.iter().cloned());
                    }
                    Err(_) => warnings.push(
                        WarningKind::InvalidIp,
                        format!(
                            "endpoint address {text:?} in EndpointSlice {} is not an IP address; skipped",
                            slice.metadata.name.as_deref().unwrap_or("?")
                        ),
                    ),
                }
            }
        }
    }
    out
}
