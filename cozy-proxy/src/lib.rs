//! cozy-proxy: 1:1 NAT between a Kubernetes LoadBalancer IP and its one pod.
//!
//! - [`model`]: pure desired state (Services + EndpointSlices -> [`model::Plan`]).
//! - [`datapath`]: the backend-neutral tables a plan becomes, and the trait
//!   each datapath implements.
//! - [`nft`]: the nftables datapath over netlink.
//! - [`source`]: where Services and EndpointSlices come from.
//! - [`reconcile`]: the loop that keeps a datapath equal to the plan.
pub mod controller;
pub mod datapath;
pub mod ebpf;
pub mod events;
pub mod model;
pub mod netlink;
pub mod nft;
pub mod rbac;
pub mod reconcile;
pub mod source;
pub mod telemetry;
