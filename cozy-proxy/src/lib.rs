//! cozy-proxy: 1:1 NAT between a Kubernetes LoadBalancer IP and its one pod.
//! docs/architecture.md describes the layers; in short:
//!
//! - [`model`]: pure desired state (Services + EndpointSlices -> [`model::Plan`]).
//! - [`datapath`]: the backend-neutral tables a plan becomes, the one sync
//!   layer, and the [`datapath::Kernel`] trait each backend implements.
//! - [`nft`], [`ebpf`]: the two backends; [`netlink`]: the codec they share.
//! - [`backend`]: the type that chooses and owns a node's backend.
//! - [`source`]: where Services and EndpointSlices come from.
//! - [`reconcile`], [`controller`]: the loop that keeps a datapath equal to
//!   the plan; [`app`]: `cozy-proxy run` wired together.
pub mod app;
pub mod backend;
pub mod bridge_ports;
pub mod cli;
pub mod controller;
pub mod datapath;
pub mod ebpf;
pub mod events;
pub mod fingerprint;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod memory;
pub mod model;
pub mod netlink;
pub mod nft;
pub mod node;
pub mod rbac;
pub mod reconcile;
pub mod repeats;
pub mod seccomp;
pub mod shares;
pub mod source;
pub mod steer;
pub mod telemetry;
