//! Other agents on the node's hooks, beside cozy-proxy: the real Cilium
//! agent as Cozystack configures it (`cilium`), and a TC program standing
//! in for one where a test needs a precise chain position or verdict
//! (`tc_program`: it ends the chain, as Cilium's programs do).
//!
//! What they do not model: Cilium's own pods, its operator and its
//! network policy (the agent runs as a process in the node's namespace,
//! with its CNI plugin announcing the pods).
pub mod cilium;
pub mod tc_program;
