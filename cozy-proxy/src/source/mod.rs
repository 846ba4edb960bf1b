//! Where Services and EndpointSlices come from.
pub mod manifests;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

/// A snapshot of the objects the model reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
}
