//! The desired-state model: pure functions from Kubernetes objects to the NAT
//! plan. No I/O here; nothing in this module knows of netlink or BPF.
mod cidr;
pub mod cluster;
mod endpoints;
mod plan;
mod service;
mod types;
mod warning;

pub use cidr::{merge as merge_ranges, Cidr, IpRange};
pub use endpoints::SERVICE_NAME_LABEL;
pub use plan::{compute_plan, Outcome};
pub use service::{
    is_selected, ALLOW_ICMP_ANNOTATION, PROXY_NAME, PROXY_NAME_LABEL, WHOLE_IP_ANNOTATION,
};
pub use types::{Family, Mapping, Mode, Plan, PortRule, Protocol, ServiceRef};
pub use warning::{Warning, WarningKind};

#[cfg(test)]
mod tests;
