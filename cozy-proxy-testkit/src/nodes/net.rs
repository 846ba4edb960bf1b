//! The addresses of the scenario topology, per family (documentation ranges
//! only: 192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32).
use std::net::IpAddr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fam {
    V4,
    V6,
}

#[derive(Clone, Debug)]
pub struct Net {
    pub fam: Fam,
    /// The outside client and server.
    pub ext: IpAddr,
    /// The node's uplink address (what masquerade produces).
    pub node: IpAddr,
    /// pod1 (managed), pod2 (unmanaged), pod3 (managed by another Service).
    pub pods: [IpAddr; 3],
    /// LoadBalancer IPs handed out in the scenarios.
    pub lbs: [IpAddr; 4],
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

impl Net {
    pub fn new(fam: Fam) -> Net {
        match fam {
            Fam::V4 => Net {
                fam,
                ext: ip("198.51.100.1"),
                node: ip("198.51.100.2"),
                pods: [ip("192.0.2.11"), ip("192.0.2.12"), ip("192.0.2.13")],
                lbs: [
                    ip("203.0.113.10"),
                    ip("203.0.113.20"),
                    ip("203.0.113.30"),
                    ip("203.0.113.40"),
                ],
            },
            Fam::V6 => Net {
                fam,
                ext: ip("2001:db8:100::1"),
                node: ip("2001:db8:100::2"),
                pods: [
                    ip("2001:db8:2::11"),
                    ip("2001:db8:2::12"),
                    ip("2001:db8:2::13"),
                ],
                lbs: [
                    ip("2001:db8:203::10"),
                    ip("2001:db8:203::20"),
                    ip("2001:db8:203::30"),
                    ip("2001:db8:203::40"),
                ],
            },
        }
    }

    pub fn address_type(&self) -> &'static str {
        match self.fam {
            Fam::V4 => "IPv4",
            Fam::V6 => "IPv6",
        }
    }
}
