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
        let mut addr = [0u8; 16];
        addr[0] = octets[0];
        addr[1] = octets[1];
        addr[2] = octets[2];
        addr[3] = octets[3];
        IpKey {
            family: FAMILY_V4,
            addr,
        }
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

/// Value of `filtered_pods`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterPolicy {
    /// 1 when the Service has `allowICMP: "true"`.
    pub allow_icmp: u8,
    pub _pad: [u8; 3],
}

/// A flow a filtered pod started (key of the `flows` LRU map): replies to
/// it pass the port filter. Ports in host order; for ICMP echo, `pod_port`
/// is the echo identifier and `peer_port` 0.
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

/// A fragmented datagram whose first fragment passed the port filter (key
/// of the `frags` LRU map): its later fragments pass too.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src: IpKey,
    pub dst: IpKey,
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Per-service counters (`svc_stats`, per CPU, keyed on the LB IP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounters {
    /// Toward the pod (destination rewritten).
    pub ingress: Counter,
    /// From the pod (source rewritten).
    pub egress: Counter,
}

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
    /// Another protocol to a filtered pod.
    FilteredProtocol = 3,
    /// A later fragment of a datagram whose first fragment was not let in.
    FilteredFragment = 4,
}

pub const DROP_REASONS: u32 = 5;

impl DropReason {
    pub const ALL: [DropReason; DROP_REASONS as usize] = [
        DropReason::UnmappedLb,
        DropReason::FilteredPort,
        DropReason::FilteredIcmp,
        DropReason::FilteredProtocol,
        DropReason::FilteredFragment,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            DropReason::UnmappedLb => "unmapped_lb",
            DropReason::FilteredPort => "filtered_port",
            DropReason::FilteredIcmp => "filtered_icmp",
            DropReason::FilteredProtocol => "filtered_protocol",
            DropReason::FilteredFragment => "filtered_fragment",
        }
    }
}

/// Map names, as pinned under [`PIN_DIR`].
pub mod maps {
    pub const POD_SVC: &str = "pod_svc";
    pub const SVC_POD: &str = "svc_pod";
    pub const FILTERED_PODS: &str = "filtered_pods";
    pub const ALLOWED_PORTS: &str = "allowed_ports";
    pub const UNMAPPED_LBS: &str = "unmapped_lbs";
    pub const FLOWS: &str = "flows";
    pub const FRAGS: &str = "frags";
    pub const SVC_STATS: &str = "svc_stats";
    pub const DROP_STATS: &str = "drop_stats";
    pub const ALL: [&str; 9] = [
        POD_SVC,
        SVC_POD,
        FILTERED_PODS,
        ALLOWED_PORTS,
        UNMAPPED_LBS,
        FLOWS,
        FRAGS,
        SVC_STATS,
        DROP_STATS,
    ];
}

/// The layouts both sides rely on, checked when either side compiles: a
/// field added or reordered fails the build instead of corrupting a map.
mod layout {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<IpKey>() == 20 && align_of::<IpKey>() == 4);
    const _: () = assert!(offset_of!(IpKey, addr) == 4);
    const _: () = assert!(size_of::<PortKey>() == 24);
    const _: () = assert!(offset_of!(PortKey, proto) == 20 && offset_of!(PortKey, port) == 22);
    const _: () = assert!(size_of::<FilterPolicy>() == 4);
    const _: () = assert!(size_of::<FlowKey>() == 48);
    const _: () = assert!(offset_of!(FlowKey, proto) == 40 && offset_of!(FlowKey, pod_port) == 42);
    const _: () = assert!(size_of::<FragKey>() == 48);
    const _: () = assert!(size_of::<Counter>() == 16);
    const _: () = assert!(size_of::<ServiceCounters>() == 32);
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain old data with explicit padding; any bit pattern is valid.
    unsafe impl aya::Pod for super::IpKey {}
    unsafe impl aya::Pod for super::PortKey {}
    unsafe impl aya::Pod for super::FilterPolicy {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::Counter {}
    unsafe impl aya::Pod for super::ServiceCounters {}
}
