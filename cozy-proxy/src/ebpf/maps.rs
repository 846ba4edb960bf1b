//! The pinned BPF maps, opened by path: what the programs read, kept equal
//! to the plan, and read back for `dump`.
use super::EbpfError;
use crate::datapath::{AllowedPort, DatapathState, StateDiff};
use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use cozy_proxy_common::{
    maps as names, Counter, DropReason, FilterPolicy, IpKey, PortKey, ServiceCounters, FAMILY_V4,
};
use serde_json::{json, Value};
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

pub fn key(ip: &IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(a) => IpKey::v4(a.octets()),
        IpAddr::V6(a) => IpKey::v6(a.octets()),
    }
}

pub fn ip(k: &IpKey) -> IpAddr {
    if k.family == FAMILY_V4 {
        IpAddr::V4(Ipv4Addr::new(k.addr[0], k.addr[1], k.addr[2], k.addr[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(k.addr))
    }
}

fn port_key(p: &AllowedPort) -> PortKey {
    PortKey {
        pod: key(&p.pod),
        proto: p.proto,
        _pad: 0,
        port: p.port,
    }
}

fn open(dir: &Path, name: &str) -> Result<Map, EbpfError> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|source| EbpfError::Map {
        name: name.into(),
        source,
    })?;
    Map::from_map_data(data).map_err(|source| EbpfError::Map {
        name: name.into(),
        source,
    })
}

macro_rules! typed {
    ($dir:expr, $name:expr) => {
        open($dir, $name)?
            .try_into()
            .map_err(|source| EbpfError::Map {
                name: $name.into(),
                source,
            })?
    };
}

/// Removing what is already gone is fine: the goal is its absence.
fn absent_ok(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::ElementNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

pub struct Maps {
    pod_svc: HashMap<MapData, IpKey, IpKey>,
    svc_pod: HashMap<MapData, IpKey, IpKey>,
    filtered_pods: HashMap<MapData, IpKey, FilterPolicy>,
    allowed_ports: HashMap<MapData, PortKey, u8>,
    unmapped_lbs: HashMap<MapData, IpKey, u8>,
    svc_stats: PerCpuHashMap<MapData, IpKey, ServiceCounters>,
    drop_stats: PerCpuArray<MapData, Counter>,
}

impl Maps {
    /// Opens the maps pinned in `dir`.
    pub fn open(dir: &Path) -> Result<Self, EbpfError> {
        Ok(Maps {
            pod_svc: typed!(dir, names::POD_SVC),
            svc_pod: typed!(dir, names::SVC_POD),
            filtered_pods: typed!(dir, names::FILTERED_PODS),
            allowed_ports: typed!(dir, names::ALLOWED_PORTS),
            unmapped_lbs: typed!(dir, names::UNMAPPED_LBS),
            svc_stats: typed!(dir, names::SVC_STATS),
            drop_stats: typed!(dir, names::DROP_STATS),
        })
    }

    pub fn read_state(&self) -> Result<DatapathState, MapError> {
        let mut s = DatapathState::default();
        for entry in self.pod_svc.iter() {
            let (k, v) = entry?;
            s.pod_svc.insert(ip(&k), ip(&v));
        }
        for entry in self.svc_pod.iter() {
            let (k, v) = entry?;
            s.svc_pod.insert(ip(&k), ip(&v));
        }
        for entry in self.filtered_pods.iter() {
            let (k, policy) = entry?;
            s.filtered_pods.insert(ip(&k));
            if policy.allow_icmp != 0 {
                s.icmp_allowed_pods.insert(ip(&k));
            }
        }
        for k in self.allowed_ports.keys() {
            let k = k?;
            s.allowed_ports.insert(AllowedPort {
                pod: ip(&k.pod),
                proto: k.proto,
                port: k.port,
            });
        }
        for k in self.unmapped_lbs.keys() {
            s.unmapped_lbs.insert(ip(&k?));
        }
        Ok(s)
    }

    /// Applies `diff` (from the kernel's state to `desired`), in an order
    /// that never lets traffic through unfiltered: policies are added before
    /// the mappings that need them and removed after.
    pub fn apply(&mut self, diff: &StateDiff, desired: &DatapathState) -> Result<(), MapError> {
        // 1. Filter policies of new or changed filtered pods, and their ports.
        let mut policies: Vec<&IpAddr> = diff.filtered_pods.add.iter().collect();
        policies.extend(
            diff.icmp_allowed_pods
                .add
                .iter()
                .chain(&diff.icmp_allowed_pods.remove),
        );
        for pod in policies
            .into_iter()
            .filter(|p| desired.filtered_pods.contains(p))
        {
            let policy = FilterPolicy {
                allow_icmp: u8::from(desired.icmp_allowed_pods.contains(pod)),
                _pad: [0; 3],
            };
            self.filtered_pods.insert(key(pod), policy, 0)?;
        }
        for p in &diff.allowed_ports.add {
            self.allowed_ports.insert(port_key(p), 1, 0)?;
        }
        // 2. Mappings: drop the gone keys, then write new and changed ones
        // (an update replaces a value atomically).
        for (map, change, target) in [
            (&mut self.pod_svc, &diff.pod_svc, &desired.pod_svc),
            (&mut self.svc_pod, &diff.svc_pod, &desired.svc_pod),
        ] {
            for (k, _) in change
                .remove
                .iter()
                .filter(|(k, _)| !target.contains_key(k))
            {
                absent_ok(map.remove(&key(k)))?;
            }
            for (k, v) in &change.add {
                map.insert(key(k), key(v), 0)?;
            }
        }
        // 3. Unmapped LB IPs.
        for lb in &diff.unmapped_lbs.remove {
            absent_ok(self.unmapped_lbs.remove(&key(lb)))?;
        }
        for lb in &diff.unmapped_lbs.add {
            self.unmapped_lbs.insert(key(lb), 1, 0)?;
        }
        // 4. Policies no longer needed; counters of Services gone.
        for p in &diff.allowed_ports.remove {
            absent_ok(self.allowed_ports.remove(&port_key(p)))?;
        }
        for pod in &diff.filtered_pods.remove {
            absent_ok(self.filtered_pods.remove(&key(pod)))?;
        }
        for (lb, _) in diff
            .svc_pod
            .remove
            .iter()
            .filter(|(k, _)| !desired.svc_pod.contains_key(k))
        {
            absent_ok(self.svc_stats.remove(&key(lb)))?;
        }
        Ok(())
    }

    /// Per-service counters (summed over CPUs) and drops by reason.
    pub fn counters(&self) -> Result<Value, MapError> {
        let mut services = BTreeMap::new();
        for entry in self.svc_stats.iter() {
            let (k, per_cpu) = entry?;
            let mut sum = ServiceCounters::default();
            for c in per_cpu.iter() {
                sum.ingress.packets += c.ingress.packets;
                sum.ingress.bytes += c.ingress.bytes;
                sum.egress.packets += c.egress.packets;
                sum.egress.bytes += c.egress.bytes;
            }
            services.insert(
                ip(&k).to_string(),
                json!({
                    "ingress_packets": sum.ingress.packets, "ingress_bytes": sum.ingress.bytes,
                    "egress_packets": sum.egress.packets, "egress_bytes": sum.egress.bytes,
                }),
            );
        }
        let mut drops = BTreeMap::new();
        for reason in DropReason::ALL {
            let per_cpu = self.drop_stats.get(&(reason as u32), 0)?;
            let packets: u64 = per_cpu.iter().map(|c| c.packets).sum();
            let bytes: u64 = per_cpu.iter().map(|c| c.bytes).sum();
            drops.insert(reason.name(), json!({ "packets": packets, "bytes": bytes }));
        }
        Ok(json!({ "services": services, "drops": drops }))
    }
}
