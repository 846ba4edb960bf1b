//! What the source hands the reconcile loop: every object, or the
//! Services that changed.
use crate::model::ServiceObjects;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use std::sync::Arc;

/// A snapshot of the objects the model reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Shared with the caches they come from, not copied.
    pub services: Vec<Arc<Service>>,
    pub endpoint_slices: Vec<Arc<EndpointSlice>>,
    /// Services given as what the model reads of them and of their slices
    /// (the Kubernetes source keeps no more).
    pub read: Vec<ServiceObjects>,
    /// Every Node: their addresses (never translated, in-cluster) and pod
    /// networks (in-cluster).
    pub nodes: Vec<Node>,
    /// The cluster's service networks (in-cluster).
    pub service_cidrs: Vec<ServiceCIDR>,
    /// The CNI's pools of pod addresses (in-cluster), where it publishes
    /// them in objects of its own.
    pub pools: Vec<crate::model::cluster::PodPool>,
}

/// What a round reconciles.
#[derive(Clone, Debug)]
pub enum Update {
    /// Every object as it is now: the first round, a resync, a relist, a
    /// change of Nodes or ServiceCIDRs (they concern every Service).
    Full(Snapshot),
    /// Only these Services changed (their objects or their slices): the
    /// plan is updated for them alone.
    Services(Vec<ServiceObjects>),
}
