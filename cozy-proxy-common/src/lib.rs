//! Types shared by the eBPF programs (`cozy-proxy-ebpf`) and userspace: the
//! keys and values of the BPF maps.
//!
//! Every type is `#[repr(C)]` with explicit padding (always zero) so that
//! both sides agree byte for byte, and BTF shows readable fields in
//! `bpftool map dump`.
#![no_std]

/// Where the pinned maps and links of the eBPF backend live.
pub const PIN_DIR: &str = "/sys/fs/bpf/cozy-proxy";

/// Protocol number our routes carry (`ip route show proto 249`).
pub const ROUTE_PROTO: u8 = 249;

/// The packet mark bit that asks for the masquerade of an in-cluster
/// client's hairpin (docs/traffic.md), set by the nft backend's forward
/// chain or by the eBPF programs, read by one masquerade rule at source
/// NAT. A bit no common agent uses: kube-proxy and Kube-OVN take 0x4000
/// and 0x8000, Calico 0xffff0000, Cilium 0x0f00 and the upper half.
pub const HAIRPIN_MARK: u32 = 0x1000;

pub const FAMILY_V4: u32 = 4;
pub const FAMILY_V6: u32 = 6;

/// An IP address: `family` 4 or 6; IPv4 in the first 4 bytes of `addr`
/// (network order), the rest zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpKey {
    pub family: u32,
    pub addr: [u8; 16],
}

impl IpKey {
    pub const fn v4(octets: [u8; 4]) -> Self {
        IpKey::from_words(FAMILY_V4, [u32::from_ne_bytes(octets), 0, 0, 0])
    }

    /// An address from four words holding its bytes in memory order (as
    /// the programs load them from a header): word-wide stores in BPF,
    /// where building the byte array became a byte at a time (and zeroing
    /// its tail a call of a byte loop, `memset`) on every packet.
    #[inline(always)]
    pub const fn from_words(family: u32, words: [u32; 4]) -> Self {
        IpKey {
            family,
            // SAFETY: same size; any bit pattern is valid for both.
            addr: unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) },
        }
    }

    /// The address as four words (its bytes in memory order): copies,
    /// comparisons and checksum arithmetic a word at a time. The array
    /// sits 4 bytes into a 4-aligned struct, so the words are aligned.
    #[inline(always)]
    pub const fn words(&self) -> [u32; 4] {
        // SAFETY: 16 bytes at an offset aligned for u32 (see above).
        unsafe { core::ptr::read(self.addr.as_ptr() as *const [u32; 4]) }
    }

    pub const fn v6(octets: [u8; 16]) -> Self {
        IpKey {
            family: FAMILY_V6,
            addr: octets,
        }
    }
}

impl From<core::net::IpAddr> for IpKey {
    fn from(ip: core::net::IpAddr) -> Self {
        match ip {
            core::net::IpAddr::V4(a) => IpKey::v4(a.octets()),
            core::net::IpAddr::V6(a) => IpKey::v6(a.octets()),
        }
    }
}

impl From<IpKey> for core::net::IpAddr {
    fn from(k: IpKey) -> Self {
        if k.family == FAMILY_V4 {
            let [a, b, c, d, ..] = k.addr;
            core::net::IpAddr::from([a, b, c, d])
        } else {
            core::net::IpAddr::from(k.addr)
        }
    }
}

/// What an address is to us (`addrs`, keyed by [`IpKey`]): one lookup
/// answers role, peer, policy, the interfaces and the counter slot.
pub mod addr {
    /// A mapped pod's IP (`peer`: its LB IP).
    pub const POD: u16 = 1 << 0;
    /// A managed LB IP (`peer`: its pod, unless `UNMAPPED`).
    pub const LB: u16 = 1 << 1;
    /// The mapping's pod is on this node: translated here.
    pub const LOCAL: u16 = 1 << 2;
    /// An LB IP without a mapping: dropped.
    pub const UNMAPPED: u16 = 1 << 3;
    /// The pod is in port-filter mode (on the pod and its LB IP).
    pub const FILTERED: u16 = 1 << 4;
    /// ...and accepts ICMP.
    pub const ICMP_ALLOWED: u16 = 1 << 5;
    /// The LB IP is restricted by loadBalancerSourceRanges (on the LB IP).
    pub const RANGED: u16 = 1 << 6;
    /// `path_ifindex` is a veth (or netkit) whose peer is the pod's end in
    /// another namespace: the fast path hands packets to it directly.
    pub const PATH_PEER: u16 = 1 << 7;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddrInfo {
    /// The other side of the mapping (LB IP for a pod, pod for an LB IP).
    pub peer: IpKey,
    /// The only interface this address may arrive on as a source (0: none).
    pub src_ifindex: u32,
    /// The interface toward the mapping's pod (0: no path).
    pub path_ifindex: u32,
    /// [`addr`] flags.
    pub flags: u16,
    /// Index into `stats` (local mappings).
    pub slot: u16,
}

/// Key of `allowed_ports`: keyed on the pod IP (the filter runs after the
/// destination rewrite). `port` in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    pub pod: IpKey,
    pub proto: u8,
    pub _pad: u8,
    pub port: u16,
}

/// Key of the `src_ranges` LPM trie: the LB IP (all 160 bits always
/// matched) then the source prefix (its family's 32 bits plus the prefix).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbSource {
    pub lb: IpKey,
    pub src: IpKey,
}

/// The `cluster` LPM trie is keyed by an [`IpKey`]: its `prefix_len`
/// counts the 32 bits of `family` plus the prefix of the address.
/// Bits of an [`IpKey`] before its address.
pub const FAMILY_BITS: u32 = 32;
pub const IP_KEY_BITS: u32 = 160;

/// A flow a filtered (or ranged) pod started (key of `flows`): replies to
/// it pass the port filter. Ports in host order; for ICMP echo,
/// `pod_port` is the echo identifier and `peer_port` 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub pod: IpKey,
    pub peer: IpKey,
    pub proto: u8,
    pub _pad: u8,
    pub pod_port: u16,
    pub peer_port: u16,
    pub _pad2: u16,
}

/// What is known of a flow: when it was last seen, and how far it got
/// (which decides how long it is remembered, as conntrack's timeouts).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowState {
    pub last_seen_ns: u64,
    pub state: u8,
    // Padding as integers, not byte arrays: zeroing an array became a
    // call of a byte loop (`memset`) in BPF.
    pub _pad: u8,
    pub _pad2: u16,
    pub _pad3: u32,
}

/// [`FlowState::state`] values, and how long each is remembered.
pub mod flow {
    pub const TCP_OPENING: u8 = 1;
    pub const TCP_ESTABLISHED: u8 = 2;
    pub const TCP_CLOSING: u8 = 3;
    pub const UDP: u8 = 4;
    /// A reply has been seen.
    pub const UDP_REPLIED: u8 = 5;
    pub const OTHER: u8 = 6;

    const S: u64 = 1_000_000_000;

    /// nf_conntrack's defaults: tcp_timeout_syn_sent 120 s, established
    /// 5 days, time_wait/close 120 s; udp_timeout 30 s, udp_timeout_stream
    /// 120 s; icmp_timeout 30 s.
    pub const fn timeout_ns(state: u8) -> u64 {
        match state {
            TCP_OPENING => 120 * S,
            TCP_ESTABLISHED => 432_000 * S,
            TCP_CLOSING => 120 * S,
            UDP => 30 * S,
            UDP_REPLIED => 120 * S,
            _ => 30 * S,
        }
    }
}

/// A fragmented datagram whose first fragment passed the port filter (key
/// of the `frags` LRU map): its later fragments pass too.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src: IpKey,
    pub dst: IpKey,
    pub id: u32,
    pub proto: u8,
    pub _pad: u8,
    pub _pad2: u16,
}

/// An in-cluster client's flow to an LB IP, translated to the pod (key of
/// `rev_nat`): its replies get the LB IP back as source.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevKey {
    pub client: IpKey,
    pub backend: IpKey,
    pub proto: u8,
    pub _pad: u8,
    pub client_port: u16,
    pub backend_port: u16,
    pub _pad2: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevValue {
    pub lb: IpKey,
    /// Conntrack saw the LB IP (the translation happened after it, at TC
    /// egress): the reply is translated back before conntrack, at TC
    /// ingress. Otherwise conntrack saw the pod: after it, at TC egress.
    pub before_conntrack: u8,
    pub _pad: u8,
    pub _pad2: u16,
    /// The interface at whose hook the flow was translated: only the
    /// node's own flow to the pod's IP through that same hook ends it (a
    /// bridge's port is the second hook the translated packet passes).
    pub ifindex: u32,
    /// When the client last sent on the flow, in whole seconds of the
    /// programs' clock (CLOCK_MONOTONIC): the sweep forgets an entry quiet
    /// longer than [`RevValue::idle_s`].
    pub seen_s: u32,
}

impl RevValue {
    /// `ns` of the programs' clock (`bpf_ktime_get_ns`) in the whole
    /// seconds `seen_s` counts.
    pub const fn seconds(ns: u64) -> u32 {
        (ns / 1_000_000_000) as u32
    }

    /// How long an entry of protocol `proto` lives without a packet from
    /// its client: as long as conntrack keeps an established TCP
    /// connection (5 days), three minutes for anything else (conntrack's
    /// UDP stream timeout is 120 s).
    pub const fn idle_s(proto: u8) -> u32 {
        match proto {
            // TCP
            6 => 432_000,
            _ => 180,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Per-service counters (`stats`, per CPU, indexed by the mapping's slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounters {
    /// Toward the pod (destination rewritten).
    pub ingress: Counter,
    /// From the pod (source rewritten).
    pub egress: Counter,
}

/// The address prefilter (`prefilter`, one entry): one bit per hash of
/// every address in `addrs`. A packet neither of whose addresses has its
/// bit set is not ours, decided without a hash-map lookup (most traffic on
/// a node). A set bit only means "look it up" (false positives are
/// harmless); userspace sets an address's bit before the address enters
/// `addrs` and clears it only after it left.
///
/// Two more bitmaps hold the addresses whose entry a hook acts on
/// ([`prefilter::roles`]): a packet whose address is in `addrs` but not
/// there is left alone without the lookup, which would only find an entry
/// that says "pass" (the LB IP of a translated packet leaving by the
/// uplink, a local LB IP at the uplink's TC ingress on the stack path).
/// Kept as `words` is, per bitmap: an address's bit is set before its
/// entry takes that role and cleared after it lost it.
///
/// It also holds the in-cluster hint: one bit per IPv4 /16 and per hashed
/// IPv6 /48 that holds in-cluster addresses (what the `cluster` trie
/// holds). An address whose bit is clear is not in the cluster, decided
/// without the trie lookup (most traffic from outside); userspace sets the
/// bits of a range before the range enters the trie.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Prefilter {
    /// Every address in `addrs`: a source at TC ingress (the guard), a
    /// destination at TC egress.
    pub words: [u64; prefilter::WORDS],
    /// The mapped pods (`addr::POD`): a source at TC egress, where only a
    /// pod's entry matters (a reply translated back).
    pub pods: [u64; prefilter::WORDS],
    /// The LB IPs whose pod is not on this node, and those without one
    /// (`addr::UNMAPPED`): a destination at TC ingress. A local mapping's
    /// LB IP is acted on there only by the fast path, which reads `words`.
    pub foreign_lbs: [u64; prefilter::WORDS],
    pub cluster: [u64; prefilter::CLUSTER_WORDS],
    /// Non-zero when an IPv6 range is wider than /32: the hint cannot
    /// exclude any IPv6 address. (A range from /32 to /47 sets the bit of
    /// each /48 it holds.)
    pub cluster_v6_wide: u64,
}

impl Prefilter {
    /// Might `ip` be in the cluster? `false` is certain: an address whose
    /// hint bit is clear is in no range of the `cluster` trie. The one
    /// rule both the programs and userspace's tests ask.
    #[inline(always)]
    pub fn maybe_in_cluster(&self, ip: &IpKey) -> bool {
        let w = ip.words();
        let (word, bit) = if ip.family == FAMILY_V4 {
            prefilter::cluster_slot_v4(w[0])
        } else {
            if self.cluster_v6_wide != 0 || prefilter::v6_link_local(w[0]) {
                return true;
            }
            prefilter::cluster_slot_v6(w[0], w[1])
        };
        self.cluster.get(word).is_none_or(|w| w & bit != 0)
    }
}

pub mod prefilter {
    /// 2^20 bits (128 KiB): about 0.1% false positives with 1 000
    /// addresses, 10% with 100 000.
    pub const BITS_LOG2: u32 = 20;
    pub const WORDS: usize = 1 << (BITS_LOG2 - 6);

    // An address folds to 32 bits (`IpKey::fold`): IPv4 its word, IPv6
    // its four words xor-ed.

    /// The in-cluster hint: 2^16 bits per family.
    pub const CLUSTER_WORDS: usize = 2 * (1 << (16 - 6));

    /// The hint's word and bit for an IPv4 address word (its bytes in
    /// memory order): its /16.
    #[inline(always)]
    pub const fn cluster_slot_v4(w: u32) -> (usize, u64) {
        let i = ((w & 0xff) << 8) | ((w >> 8) & 0xff);
        ((i >> 6) as usize, 1u64 << (i & 63))
    }

    /// Is an IPv6 address with this first word (memory order) in
    /// fe80::/10? Every node's in-cluster ranges hold that prefix, which
    /// no hint bit could cover: the programs send such an address to the
    /// trie without the hint, and the hint's marking leaves it out.
    #[inline(always)]
    pub const fn v6_link_local(w0: u32) -> bool {
        let b = w0.to_ne_bytes();
        b[0] == 0xfe && (b[1] & 0xc0) == 0x80
    }

    /// The hint's word and bit for an IPv6 address's /48, hashed: its first
    /// word and the first half of its second (memory order). A /48, not a
    /// /32: a provider's clients and its cluster's ranges often share its
    /// /32, and a /48 is the widest prefix a site is usually given.
    #[inline(always)]
    pub const fn cluster_slot_v6(w0: u32, w1: u32) -> (usize, u64) {
        let h = (w0 ^ (w1 & 0xffff).wrapping_mul(0x85eb_ca6b)).wrapping_mul(0x9e37_79b1) >> 16;
        (
            CLUSTER_WORDS / 2 + ((h >> 6) as usize & (CLUSTER_WORDS / 2 - 1)),
            1u64 << (h & 63),
        )
    }

    /// The prefilter's address bitmaps an `addrs` entry with these flags
    /// is in (see [`super::Prefilter`]).
    pub const ALL: u8 = 1;
    pub const PODS: u8 = 1 << 1;
    pub const FOREIGN_LBS: u8 = 1 << 2;

    #[inline(always)]
    pub const fn roles(flags: u16) -> u8 {
        use super::addr;
        let mut r = ALL;
        if flags & addr::POD != 0 {
            r |= PODS;
        }
        if flags & addr::LB != 0 && (flags & addr::UNMAPPED != 0 || flags & addr::LOCAL == 0) {
            r |= FOREIGN_LBS;
        }
        r
    }

    /// The word and bit of a folded address (multiplicative hashing).
    #[inline(always)]
    pub const fn slot(fold: u32) -> (usize, u64) {
        let h = fold.wrapping_mul(0x9e37_79b1) >> (32 - BITS_LOG2);
        ((h >> 6) as usize & (WORDS - 1), 1u64 << (h & 63))
    }
}

impl IpKey {
    /// This address's fold for the [`Prefilter`].
    #[inline(always)]
    pub const fn fold(&self) -> u32 {
        let w = self.words();
        if self.family == FAMILY_V4 {
            w[0]
        } else {
            w[0] ^ w[1] ^ w[2] ^ w[3]
        }
    }
}

/// Settings userspace gives the programs (`config`, one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// 1: LB traffic skips the host stack where it can (redirects).
    pub fast_path: u32,
    /// 1: the other backend still serves (a backend switch). The programs
    /// translate, filter and count nothing; they only remember the flows
    /// filtered pods start, so that the replies to those flows pass once
    /// they act.
    pub standby: u32,
    /// The interface whose in-cluster clients of this node's LB IPs may be
    /// routed back out of it (Kube-OVN's `ovn0`): their hairpins are
    /// marked there. 0: none; [`HAIRPIN_SEVERAL`]: those whose `ifaces`
    /// role has [`iface::HAIRPIN`].
    pub hairpin_iface: u32,
    pub _pad: u32,
}

/// [`Config::hairpin_iface`] when more than one interface may hairpin.
pub const HAIRPIN_SEVERAL: u32 = u32::MAX;

/// Index into `drop_stats`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// To the LB IP of a managed Service without a mapping.
    UnmappedLb = 0,
    /// TCP/UDP/SCTP to an unlisted port of a filtered pod.
    FilteredPort = 1,
    /// ICMP to a filtered pod without allowICMP (and not about its flows).
    FilteredIcmp = 2,
    /// Another protocol to a filtered pod, or one whose ports cannot be read.
    FilteredProtocol = 3,
    /// A later fragment of a datagram whose first fragment was not let in.
    FilteredFragment = 4,
    /// A mapped pod's or an LB IP's address as source, from elsewhere.
    Spoofed = 5,
    /// Not in the LB IP's loadBalancerSourceRanges.
    SourceRange = 6,
    /// A rewrite the kernel refused: dropped rather than passed untranslated.
    RewriteFailed = 7,
    /// A new in-cluster client's flow from a source already holding
    /// `limits::REV_PER_SOURCE` reverse translations.
    ReverseQuota = 8,
}

pub const DROP_REASONS: u32 = 9;

impl DropReason {
    pub const ALL: [DropReason; DROP_REASONS as usize] = [
        DropReason::UnmappedLb,
        DropReason::FilteredPort,
        DropReason::FilteredIcmp,
        DropReason::FilteredProtocol,
        DropReason::FilteredFragment,
        DropReason::Spoofed,
        DropReason::SourceRange,
        DropReason::RewriteFailed,
        DropReason::ReverseQuota,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            DropReason::UnmappedLb => "unmapped_lb",
            DropReason::FilteredPort => "filtered_port",
            DropReason::FilteredIcmp => "filtered_icmp",
            DropReason::FilteredProtocol => "filtered_protocol",
            DropReason::FilteredFragment => "filtered_fragment",
            DropReason::Spoofed => "spoofed_source",
            DropReason::SourceRange => "source_range",
            DropReason::RewriteFailed => "rewrite_failed",
            DropReason::ReverseQuota => "reverse_quota",
        }
    }
}

/// Capacities, shared so that userspace can check them.
pub mod limits {
    /// Mappings (LB IP <-> pod) a node can hold, local and remote.
    pub const MAPPINGS: usize = 65_536;
    /// Addresses: a pod and an LB IP per mapping, and unmapped LB IPs.
    pub const ADDRS: usize = 3 * MAPPINGS;
    /// Allowed (pod, protocol, port) entries.
    pub const PORTS: usize = 262_144;
    /// In-cluster prefixes.
    pub const CLUSTER: usize = 4_096;
    /// loadBalancerSourceRanges prefixes, all LB IPs together.
    pub const SOURCE_RANGES: usize = 65_536;
    /// Flows one pod may have remembered at once (its quota in
    /// `flow_counts`): a pod that opens more cannot push out another's.
    pub const FLOWS_PER_POD: usize = 16_384;
    /// Flows remembered on a node, all pods together (allocated as used).
    pub const FLOWS: usize = 1 << 20;
    /// Fragmented datagrams in flight toward filtered pods.
    pub const FRAGS: usize = 16_384;
    /// In-cluster clients' flows to LB IPs, translated on this node.
    pub const REV_NAT: usize = 262_144;
    /// Reverse translations one client address may hold at once (its
    /// quota in `rev_held`): one client cannot push out the others'.
    pub const REV_PER_SOURCE: u64 = 16_384;
    /// Client addresses whose reverse translations are counted.
    pub const REV_SOURCES: usize = 16_384;
    /// Interfaces with a role in `ifaces` (bridges, their ports, ports of
    /// bonds and other masters).
    pub const IFACES: usize = 16_384;
    /// Interfaces the XDP program may redirect into (`xdp_targets`).
    pub const XDP_TARGETS: usize = 16_384;
}

/// What an interface is to the anti-spoofing check (`ifaces`, keyed by
/// ifindex): consulted only when a guarded source arrives elsewhere than
/// its own entry interface, to tell a frame on its way there (a bridge
/// port, a bond's port, a VLAN's parent) from a forgery. An interface
/// without an entry has no such role.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfRole {
    /// The bridge this interface is a port of (0: none).
    pub bridge: u32,
    /// [`iface`] flags.
    pub flags: u32,
}

pub mod iface {
    /// Frames arriving here are judged where they go next: a bridge whose
    /// ports all carry the programs (judged at the port they came in by),
    /// a port of a bond, team or Open vSwitch datapath (judged at that
    /// device, or at the interface the host's stack receives them on).
    pub const DEFER: u32 = 1;
    /// A port of a bridge whose ports all carry the programs: it judges,
    /// and translates for, the addresses whose entry is the bridge itself
    /// (their port not known yet).
    pub const PORT_JUDGES: u32 = 2;
    /// A bridge (with [`DEFER`], which programs before it read alone):
    /// what it hands up to the node came in by one of its ports. A guarded
    /// source whose entry is the bridge or one of its ports was judged at
    /// its port; any other was left alone at its port (a bridge its route
    /// does not name only carries it) and is forged here, where it would
    /// enter the node's own stack.
    pub const BRIDGE: u32 = 4;
    /// The node reaches a pod of one of its mappings through this
    /// interface via a router that is no node (Kube-OVN's `ovn0`): an
    /// in-cluster client's flow to an LB IP here may leave by it again.
    /// Read only where [`super::Config::hairpin_iface`] says several.
    pub const HAIRPIN: u32 = 8;
}

/// Map names, as pinned under [`PIN_DIR`].
pub mod maps {
    pub const ADDRS: &str = "addrs";
    pub const ALLOWED_PORTS: &str = "allowed_ports";
    pub const CLUSTER: &str = "cluster";
    pub const SRC_RANGES: &str = "src_ranges";
    pub const FLOWS: &str = "flows";
    pub const FLOW_COUNTS: &str = "flow_counts";
    pub const FRAGS: &str = "frags";
    pub const REV_NAT: &str = "rev_nat";
    pub const REV_HELD: &str = "rev_held";
    pub const STATS: &str = "stats";
    pub const DROP_STATS: &str = "drop_stats";
    pub const CONFIG: &str = "config";
    pub const PREFILTER: &str = "prefilter";
    pub const IFACES: &str = "ifaces";
    pub const XDP_TARGETS: &str = "xdp_targets";
    pub const ALL: [&str; 15] = [
        ADDRS,
        ALLOWED_PORTS,
        CLUSTER,
        SRC_RANGES,
        FLOWS,
        FLOW_COUNTS,
        FRAGS,
        REV_NAT,
        REV_HELD,
        STATS,
        DROP_STATS,
        CONFIG,
        PREFILTER,
        IFACES,
        XDP_TARGETS,
    ];
}

/// The layouts both sides rely on, checked when either side compiles: a
/// field added or reordered fails the build instead of corrupting a map.
mod layout {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<IpKey>() == 20 && align_of::<IpKey>() == 4);
    const _: () = assert!(offset_of!(IpKey, addr) == 4);
    const _: () = assert!(size_of::<AddrInfo>() == 32);
    const _: () = assert!(offset_of!(AddrInfo, src_ifindex) == 20);
    const _: () = assert!(offset_of!(AddrInfo, flags) == 28 && offset_of!(AddrInfo, slot) == 30);
    const _: () = assert!(size_of::<PortKey>() == 24);
    const _: () = assert!(size_of::<IfRole>() == 8 && offset_of!(IfRole, flags) == 4);
    const _: () = assert!(offset_of!(PortKey, proto) == 20 && offset_of!(PortKey, port) == 22);
    const _: () = assert!(size_of::<LbSource>() == 40);
    const _: () = assert!(size_of::<FlowKey>() == 48);
    const _: () = assert!(offset_of!(FlowKey, proto) == 40 && offset_of!(FlowKey, pod_port) == 42);
    const _: () = assert!(size_of::<FlowState>() == 16);
    const _: () = assert!(size_of::<FragKey>() == 48);
    const _: () = assert!(size_of::<RevKey>() == 48 && offset_of!(RevKey, proto) == 40);
    const _: () = assert!(size_of::<RevValue>() == 32);
    const _: () = assert!(size_of::<Counter>() == 16);
    const _: () = assert!(size_of::<ServiceCounters>() == 32);
    const _: () = assert!(size_of::<Config>() == 16);
    const _: () = assert!(
        size_of::<Prefilter>() == 8 * (3 * prefilter::WORDS + prefilter::CLUSTER_WORDS + 1)
    );
    const _: () = assert!(limits::MAPPINGS <= u16::MAX as usize + 1);
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain old data with explicit padding; any bit pattern is valid.
    unsafe impl aya::Pod for super::IpKey {}
    unsafe impl aya::Pod for super::AddrInfo {}
    unsafe impl aya::Pod for super::PortKey {}
    unsafe impl aya::Pod for super::LbSource {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::FlowState {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::RevKey {}
    unsafe impl aya::Pod for super::RevValue {}
    unsafe impl aya::Pod for super::Counter {}
    unsafe impl aya::Pod for super::ServiceCounters {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::Prefilter {}
    unsafe impl aya::Pod for super::IfRole {}
}
