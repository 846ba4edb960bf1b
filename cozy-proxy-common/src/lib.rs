//! Types shared by the eBPF programs (`cozy-proxy-ebpf`) and userspace.
//!
//! Every type is `#[repr(C)]` with explicit padding so that the kernel side and
//! the userspace side agree byte for byte on map keys and values.
#![no_std]

/// Where the pinned maps and links of the eBPF backend live.
pub const PIN_DIR: &str = "/sys/fs/bpf/cozy-proxy";

/// An IP address in a map key or value: IPv4 is stored in the first 4 bytes
/// (network order) with the rest zero, IPv6 uses all 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpKey {
    pub addr: [u8; 16],
}

impl IpKey {
    pub const fn v4(octets: [u8; 4]) -> Self {
        let mut addr = [0u8; 16];
        addr[0] = octets[0];
        addr[1] = octets[1];
        addr[2] = octets[2];
        addr[3] = octets[3];
        IpKey { addr }
    }

    pub const fn v6(octets: [u8; 16]) -> Self {
        IpKey { addr: octets }
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain old data, no padding, any bit pattern is valid.
    unsafe impl aya::Pod for super::IpKey {}
}
