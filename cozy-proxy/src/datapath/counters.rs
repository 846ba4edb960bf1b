//! A datapath's own traffic counters: what `dump` prints and what the
//! metrics export (`cozy_proxy_service_packets` and friends).
use serde::Serialize;
use std::{collections::BTreeMap, net::IpAddr};

/// Packets and bytes, monotonic while the datapath exists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Count {
    pub packets: u64,
    pub bytes: u64,
}

impl std::ops::AddAssign for Count {
    fn add_assign(&mut self, other: Count) {
        self.packets += other.packets;
        self.bytes += other.bytes;
    }
}

/// One LoadBalancer IP's traffic, both directions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServiceCount {
    /// Toward the pod (destination rewritten).
    pub ingress: Count,
    /// From the pod (source rewritten).
    pub egress: Count,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Per LoadBalancer IP.
    pub services: BTreeMap<IpAddr, ServiceCount>,
    /// Drops by reason (stable names, the metric's `reason` label).
    pub drops: BTreeMap<&'static str, Count>,
}

impl Counters {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && self.drops.is_empty()
    }
}
