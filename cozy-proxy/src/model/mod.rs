//! The desired-state model: pure functions from Kubernetes objects to the NAT
//! plan. No I/O here; nothing in this module knows of netlink or BPF.
mod cidr;
pub mod cluster;
mod endpoints;
pub mod incremental;
mod plan;
mod service;
pub mod trim;
mod trust;
mod types;
mod warning;

pub use cidr::{merge as merge_ranges, Cidr, IpRange};
pub use endpoints::{
    slice_owner, ReadSlice, Writer, MANAGED_BY_LABEL, SERVICE_NAME_LABEL, SLICE_CONTROLLER,
};
pub use incremental::{LbChange, PlanState, PlanSummary, ServiceObjects};
pub(crate) use plan::Rank;
pub use plan::{compute_plan, compute_plan_with, read_chosen, Forbidden, Outcome};
pub use service::{
    is_selected, read_service, service_ref, ReadService, ALLOW_ICMP_ANNOTATION, PROXY_NAME,
    PROXY_NAME_LABEL, WHOLE_IP_ANNOTATION,
};
pub use trust::SliceTrust;
pub use types::{
    Family, Hosts, LbResult, Mapping, Mode, Plan, PortRule, Protocol, ServiceRef, Uid,
};
pub use warning::{Warning, WarningKind};

/// The model's hash tables, keyed by address or Service name: foldhash,
/// seeded per table. SipHash, the standard one, would be a large part of
/// a rebuild.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub(crate) type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

#[cfg(test)]
pub(crate) mod tests;
