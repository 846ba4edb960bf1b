//! The pinned BPF maps, opened by path: what the programs read, kept equal
//! to the plan, and read back for `dump`.
use super::EbpfError;
use crate::datapath::{AllowedPort, Count, Counters, DatapathState, ServiceCount, StateDiff};
use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use cozy_proxy_common::{
    maps as names, Counter, DropReason, FilterPolicy, FlowKey, FragKey, IpKey, PortKey,
    ServiceCounters,
};
use std::{fs, mem::size_of, net::IpAddr, path::Path};
use tracing::warn;

fn key(ip: &IpAddr) -> IpKey {
    IpKey::from(*ip)
}

fn ip(k: &IpKey) -> IpAddr {
    IpAddr::from(*k)
}

fn port_key(p: &AllowedPort) -> PortKey {
    PortKey {
        pod: key(&p.pod),
        proto: p.proto,
        _pad: 0,
        port: p.port,
    }
}

/// Key and value sizes the current programs expect, to refuse reusing a
/// pinned map of an older, different layout.
fn expected_sizes(name: &str) -> Option<(usize, usize)> {
    Some(match name {
        names::POD_SVC | names::SVC_POD => (size_of::<IpKey>(), size_of::<IpKey>()),
        names::FILTERED_PODS => (size_of::<IpKey>(), size_of::<FilterPolicy>()),
        names::ALLOWED_PORTS => (size_of::<PortKey>(), 1),
        names::UNMAPPED_LBS => (size_of::<IpKey>(), 1),
        names::FLOWS => (size_of::<FlowKey>(), 8),
        names::FRAGS => (size_of::<FragKey>(), 8),
        names::SVC_STATS => (size_of::<IpKey>(), size_of::<ServiceCounters>()),
        names::DROP_STATS => (4, size_of::<Counter>()),
        _ => return None,
    })
}

/// Unpins maps whose key or value size differs from the programs' (an
/// older layout): the loader then creates them anew, and the next sync
/// fills them from the plan.
pub fn drop_incompatible_pins(pin_dir: &Path) {
    for name in names::ALL {
        let path = pin_dir.join(name);
        let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
            continue;
        };
        if let Some((k, v)) = expected_sizes(name) {
            if info.key_size() as usize != k || info.value_size() as usize != v {
                warn!(map = name, "pinned map has another layout; replacing it");
                let _ = fs::remove_file(&path);
            }
        }
    }
}

/// Names a map error after its map.
fn named(name: &'static str) -> impl Fn(MapError) -> EbpfError {
    move |source| EbpfError::Map { name, source }
}

fn open(dir: &Path, name: &'static str) -> Result<Map, EbpfError> {
    let data = MapData::from_pin(dir.join(name)).map_err(named(name))?;
    Map::from_map_data(data).map_err(named(name))
}

macro_rules! typed {
    ($dir:expr, $name:expr) => {
        open($dir, $name)?.try_into().map_err(named($name))?
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

    pub fn read_state(&self) -> Result<DatapathState, EbpfError> {
        let mut s = DatapathState::default();
        for (map, name, out) in [
            (&self.pod_svc, names::POD_SVC, &mut s.pod_svc),
            (&self.svc_pod, names::SVC_POD, &mut s.svc_pod),
        ] {
            for entry in map.iter() {
                let (k, v) = entry.map_err(named(name))?;
                out.insert(ip(&k), ip(&v));
            }
        }
        for entry in self.filtered_pods.iter() {
            let (k, policy) = entry.map_err(named(names::FILTERED_PODS))?;
            s.filtered_pods.insert(ip(&k));
            if policy.allow_icmp != 0 {
                s.icmp_allowed_pods.insert(ip(&k));
            }
        }
        for k in self.allowed_ports.keys() {
            let k = k.map_err(named(names::ALLOWED_PORTS))?;
            s.allowed_ports.insert(AllowedPort {
                pod: ip(&k.pod),
                proto: k.proto,
                port: k.port,
            });
        }
        for k in self.unmapped_lbs.keys() {
            s.unmapped_lbs
                .insert(ip(&k.map_err(named(names::UNMAPPED_LBS))?));
        }
        Ok(s)
    }

    /// Applies `diff` (from the kernel's state to `desired`), in an order
    /// that never lets traffic through unfiltered: policies are added before
    /// the mappings that need them and removed after.
    pub fn apply(&mut self, diff: &StateDiff, desired: &DatapathState) -> Result<(), EbpfError> {
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
            self.filtered_pods
                .insert(key(pod), policy, 0)
                .map_err(named(names::FILTERED_PODS))?;
        }
        for p in &diff.allowed_ports.add {
            self.allowed_ports
                .insert(port_key(p), 1, 0)
                .map_err(named(names::ALLOWED_PORTS))?;
        }
        // 2. Mappings: drop the gone keys, then write new and changed ones
        // (an update replaces a value atomically).
        for (map, name, change, target) in [
            (
                &mut self.pod_svc,
                names::POD_SVC,
                &diff.pod_svc,
                &desired.pod_svc,
            ),
            (
                &mut self.svc_pod,
                names::SVC_POD,
                &diff.svc_pod,
                &desired.svc_pod,
            ),
        ] {
            for (k, _) in change
                .remove
                .iter()
                .filter(|(k, _)| !target.contains_key(k))
            {
                absent_ok(map.remove(&key(k))).map_err(named(name))?;
            }
            for (k, v) in &change.add {
                map.insert(key(k), key(v), 0).map_err(named(name))?;
            }
        }
        // 3. Unmapped LB IPs.
        let unmapped = named(names::UNMAPPED_LBS);
        for lb in &diff.unmapped_lbs.remove {
            absent_ok(self.unmapped_lbs.remove(&key(lb))).map_err(&unmapped)?;
        }
        for lb in &diff.unmapped_lbs.add {
            self.unmapped_lbs.insert(key(lb), 1, 0).map_err(&unmapped)?;
        }
        // 4. Policies no longer needed; counters of Services gone.
        for p in &diff.allowed_ports.remove {
            absent_ok(self.allowed_ports.remove(&port_key(p)))
                .map_err(named(names::ALLOWED_PORTS))?;
        }
        for pod in &diff.filtered_pods.remove {
            absent_ok(self.filtered_pods.remove(&key(pod))).map_err(named(names::FILTERED_PODS))?;
        }
        for (lb, _) in diff
            .svc_pod
            .remove
            .iter()
            .filter(|(k, _)| !desired.svc_pod.contains_key(k))
        {
            absent_ok(self.svc_stats.remove(&key(lb))).map_err(named(names::SVC_STATS))?;
        }
        Ok(())
    }

    /// Per-service counters (summed over CPUs) and drops by reason.
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let count = |c: &Counter| Count {
            packets: c.packets,
            bytes: c.bytes,
        };
        let mut out = Counters::default();
        for entry in self.svc_stats.iter() {
            let (k, per_cpu) = entry.map_err(named(names::SVC_STATS))?;
            let sum = out
                .services
                .entry(ip(&k))
                .or_insert(ServiceCount::default());
            for c in per_cpu.iter() {
                sum.ingress += count(&c.ingress);
                sum.egress += count(&c.egress);
            }
        }
        for reason in DropReason::ALL {
            let per_cpu = self
                .drop_stats
                .get(&(reason as u32), 0)
                .map_err(named(names::DROP_STATS))?;
            let sum = out.drops.entry(reason.name()).or_default();
            for c in per_cpu.iter() {
                *sum += count(c);
            }
        }
        Ok(out)
    }
}
