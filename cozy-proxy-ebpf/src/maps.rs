//! The BPF maps (BTF-typed; userspace pins them under /sys/fs/bpf/cozy-proxy).
use aya_ebpf::{
    btf_maps::{HashMap, LruHashMap, PerCpuArray, PerCpuHashMap},
    macros::btf_map,
};
use cozy_proxy_common::{
    Counter, FilterPolicy, FlowKey, FragKey, IpKey, PortKey, ServiceCounters, DROP_REASONS,
};

/// Mappings (Services) a node can hold.
pub const MAX_MAPPINGS: usize = 65_536;
/// Allowed (pod, protocol, port) entries.
pub const MAX_PORTS: usize = 262_144;
/// Flows started by filtered pods that are remembered for their replies.
pub const MAX_FLOWS: usize = 262_144;
/// Fragmented datagrams in flight toward filtered pods.
pub const MAX_FRAGS: usize = 16_384;
/// Allocate hash entries on demand: a node with few Services uses little.
const NO_PREALLOC: usize = 1;

/// pod IP -> LoadBalancer IP (egress source rewrite).
#[btf_map(name = "pod_svc")]
pub static POD_SVC: HashMap<IpKey, IpKey, MAX_MAPPINGS, NO_PREALLOC> = HashMap::new();

/// LoadBalancer IP -> pod IP (ingress destination rewrite).
#[btf_map(name = "svc_pod")]
pub static SVC_POD: HashMap<IpKey, IpKey, MAX_MAPPINGS, NO_PREALLOC> = HashMap::new();

/// Pods in port-filter mode, with their ICMP policy.
#[btf_map(name = "filtered_pods")]
pub static FILTERED_PODS: HashMap<IpKey, FilterPolicy, MAX_MAPPINGS, NO_PREALLOC> = HashMap::new();

/// (pod, protocol, port) a filtered pod accepts.
#[btf_map(name = "allowed_ports")]
pub static ALLOWED_PORTS: HashMap<PortKey, u8, MAX_PORTS, NO_PREALLOC> = HashMap::new();

/// LB IPs of managed Services without a mapping: dropped.
#[btf_map(name = "unmapped_lbs")]
pub static UNMAPPED_LBS: HashMap<IpKey, u8, MAX_MAPPINGS, NO_PREALLOC> = HashMap::new();

/// Flows filtered pods started; value: last seen (ns since boot).
#[btf_map(name = "flows")]
pub static FLOWS: LruHashMap<FlowKey, u64, MAX_FLOWS> = LruHashMap::new();

/// Fragmented datagrams whose first fragment passed the filter.
#[btf_map(name = "frags")]
pub static FRAGS: LruHashMap<FragKey, u64, MAX_FRAGS> = LruHashMap::new();

/// Per-service counters, keyed on the LB IP.
#[btf_map(name = "svc_stats")]
pub static SVC_STATS: PerCpuHashMap<IpKey, ServiceCounters, MAX_MAPPINGS> = PerCpuHashMap::new();

/// Drops by reason (index: `DropReason`).
#[btf_map(name = "drop_stats")]
pub static DROP_STATS: PerCpuArray<Counter, { DROP_REASONS as usize }> = PerCpuArray::new();
