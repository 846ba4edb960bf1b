//! Netlink, spoken directly: a small codec shared by the nf_tables datapath
//! and the eBPF datapath's routes.
pub mod addr;
pub mod conntrack;
pub mod neigh;
pub mod netdev;
pub mod route;
pub mod socket;
pub mod tc;
pub mod wire;

pub use socket::{NetlinkError, NlSocket};
