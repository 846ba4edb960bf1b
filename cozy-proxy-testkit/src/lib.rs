//! Test support for cozy-proxy (dev-only), in parts by what each stands
//! for:
//!
//! - [`nodes`]: nodes and their networks in network namespaces (one node
//!   and its pods in the shapes CNIs build; two nodes; a migrating VM);
//! - [`agents`]: other agents on the node's hooks (the real Cilium agent;
//!   a program standing in for one);
//! - [`controller`]: our binary as the node's controller (process, image
//!   under runc, previous release, refused `bpf(2)` calls, manifests);
//! - [`control_plane`]: the real Kubernetes control plane and MetalLB;
//! - [`standin`]: the Kubernetes API stand-in;
//! - [`traffic`]: real traffic and its counting (exchanges, held flows,
//!   streams across a change);
//! - [`packets`]: crafted frames, fuzzing, the programs under
//!   `BPF_PROG_TEST_RUN`;
//! - [`scenario`]: the scenarios' environment and vocabulary, and the
//!   macros that make one test per scenario, family and datapath;
//! - [`sh`]: running tools inside namespaces (every part uses it).
//!
//! The benchmarks are the `cozy-proxy-bench` crate's binaries; the demo
//! is this crate's.

pub mod agents;
pub mod control_plane;
pub mod controller;
pub mod nodes;
pub mod packets;
pub mod scenario;
pub mod sh;
pub mod standin;
pub mod traffic;

pub use controller::{
    bin, built_beside, test_bpffs, workspace, Backend, Controller, SourceKind, StandIn, STANDIN_URL,
};
pub use scenario::env::{expected_state, Env};
