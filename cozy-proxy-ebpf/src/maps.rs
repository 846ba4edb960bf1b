//! The BPF maps (BTF-typed; userspace pins them under /sys/fs/bpf/cozy-proxy).
use aya_ebpf::{
    btf_maps::{Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use cozy_proxy_common::{
    limits, AddrInfo, Config, Counter, Prefilter, FlowKey, FlowState, FragKey, IfRole, IpKey, LbSource,
    PortKey, RevKey, RevValue, ServiceCounters, DROP_REASONS,
};

/// Allocate hash entries on demand: a node with few Services uses little.
const NO_PREALLOC: usize = 1;

/// Every address we know: mapped pods, managed LB IPs (mapped or not),
/// local or on other nodes. One lookup per address answers everything.
#[btf_map(name = "addrs")]
pub static ADDRS: HashMap<IpKey, AddrInfo, { limits::ADDRS }, NO_PREALLOC> = HashMap::new();

/// (pod, protocol, port) a filtered pod accepts.
#[btf_map(name = "allowed_ports")]
pub static ALLOWED_PORTS: HashMap<PortKey, u8, { limits::PORTS }, NO_PREALLOC> = HashMap::new();

/// The in-cluster ranges.
#[btf_map(name = "cluster")]
pub static CLUSTER: LpmTrie<IpKey, u8, { limits::CLUSTER }> = LpmTrie::new();

/// (LB IP, source prefix) allowed through a ranged LB IP.
#[btf_map(name = "src_ranges")]
pub static SRC_RANGES: LpmTrie<LbSource, u8, { limits::SOURCE_RANGES }> = LpmTrie::new();

/// Flows filtered (and ranged) pods started, all pods in one map (a map
/// per pod cost a 256 KiB bucket array and an RCU grace period each).
#[btf_map(name = "flows")]
pub static FLOWS: HashMap<FlowKey, FlowState, { limits::FLOWS }, NO_PREALLOC> = HashMap::new();

/// Flows each mapping's pod has remembered (index: the mapping's slot):
/// its quota of `limits::FLOWS_PER_POD`, so that one pod cannot fill
/// `flows` for the others. Userspace recounts it at each sweep.
#[btf_map(name = "flow_counts")]
pub static FLOW_COUNTS: Array<u64, { limits::MAPPINGS }> = Array::new();

/// Fragmented datagrams whose first fragment passed the filter.
#[btf_map(name = "frags")]
pub static FRAGS: LruHashMap<FragKey, u64, { limits::FRAGS }> = LruHashMap::new();

/// In-cluster clients' flows to LB IPs translated on this node.
#[btf_map(name = "rev_nat")]
pub static REV_NAT: LruHashMap<RevKey, RevValue, { limits::REV_NAT }> = LruHashMap::new();

/// Reverse translations each client address holds in `rev_nat`: its
/// quota of `limits::REV_PER_SOURCE`. The programs count up as they
/// record; userspace recounts at each sweep (an LRU eviction is not seen
/// here). An LRU map itself: more clients than it holds weaken the quota
/// of the quietest, never refuse a client.
#[btf_map(name = "rev_held")]
pub static REV_HELD: LruHashMap<IpKey, u64, { limits::REV_SOURCES }> = LruHashMap::new();

/// Per-mapping counters, by slot.
#[btf_map(name = "stats")]
pub static STATS: PerCpuArray<ServiceCounters, { limits::MAPPINGS }> = PerCpuArray::new();

/// Drops by reason (index: `DropReason`).
#[btf_map(name = "drop_stats")]
pub static DROP_STATS: PerCpuArray<Counter, { DROP_REASONS as usize }> = PerCpuArray::new();

/// One bit per hash of every address in `addrs`: "not ours" without a
/// hash lookup.
#[btf_map(name = "prefilter")]
pub static PREFILTER: Array<Prefilter, 1> = Array::new();

/// Settings from userspace.
#[btf_map(name = "config")]
pub static CONFIG: Array<Config, 1> = Array::new();

/// Interfaces by ifindex, with their role for a guarded source arriving on
/// them from elsewhere than its own interface (`IfRole`).
#[btf_map(name = "ifaces")]
pub static IFACES: HashMap<u32, IfRole, { limits::IFACES }, NO_PREALLOC> = HashMap::new();

/// The interfaces that take XDP frames (ifindex -> itself), kept by
/// userspace: the XDP program redirects only into these (a veth whose
/// peer has an XDP program or GRO on; see xdp.rs).
#[btf_map(name = "xdp_targets")]
pub static XDP_TARGETS: DevMapHash<{ limits::XDP_TARGETS }> = DevMapHash::new();

/// Each CPU's packet being decided (see outline.rs): parsed here, not on
/// the stack, so that the programs' verification sees its fields as the
/// unknowns they are.
#[btf_map(name = "scratch")]
pub static SCRATCH: PerCpuArray<crate::parse::Packet, 1> = PerCpuArray::new();
