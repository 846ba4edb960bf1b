//! The in-cluster half of the prefilter: one bit per IPv4 /16 and per
//! hashed IPv6 /48 that holds an in-cluster address (see [`Prefilter`]).
//! The programs skip the `cluster` trie for an address whose bit is clear,
//! so every address of every range must find its bit set: a range sets the
//! bit of each /16 or /48 it holds, and an IPv6 range wider than /32 (65 536
//! /48s and more) sets the "wide" flag instead, which turns the IPv6 hint
//! off. fe80::/10, which every node's ranges hold, is the exception: the
//! programs ask the trie for a link-local address without the hint.
use crate::model::Cidr;
use cozy_proxy_common::{prefilter, IpKey, Prefilter};
use std::net::IpAddr;

/// The widest IPv6 range whose /48s are marked one by one.
const V6_WIDEST_MARKED: u8 = 32;

/// Sets the hint bits of every address of `c`.
pub fn mark(bits: &mut Prefilter, c: &Cidr) {
    match c.addr() {
        IpAddr::V4(a) => {
            let first = u32::from(a) >> 16;
            let count = 1u32 << (16 - c.prefix().min(16));
            for block in first..first + count {
                let w = u32::from_ne_bytes((block << 16).to_be_bytes());
                let (word, bit) = prefilter::cluster_slot_v4(w);
                bits.cluster[word] |= bit;
            }
        }
        // Asked of the trie without the hint (`prefilter::v6_link_local`).
        IpAddr::V6(a) if c.prefix() >= 10 && link_local(&a) => {}
        IpAddr::V6(_) if c.prefix() < V6_WIDEST_MARKED => bits.cluster_v6_wide = 1,
        IpAddr::V6(a) => {
            let octets = a.octets();
            let first = u16::from_be_bytes([octets[4], octets[5]]) as u32;
            let count = 1u32 << (48 - c.prefix().min(48));
            for site in first..first + count {
                let mut o = octets;
                o[4..6].copy_from_slice(&(site as u16).to_be_bytes());
                let w = IpKey::v6(o).words();
                let (word, bit) = prefilter::cluster_slot_v6(w[0], w[1]);
                bits.cluster[word] |= bit;
            }
        }
    }
}

fn link_local(a: &std::net::Ipv6Addr) -> bool {
    prefilter::v6_link_local(IpKey::v6(a.octets()).words()[0])
}

/// Might `ip` be in a range `bits` marks? What the programs ask.
#[cfg(test)]
fn maybe_in(bits: &Prefilter, ip: &IpAddr) -> bool {
    bits.maybe_in_cluster(&IpKey::from(*ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Box<Prefilter> {
        // SAFETY: `Prefilter` is integers only; all zeroes is a value.
        unsafe { Box::<Prefilter>::new_zeroed().assume_init() }
    }

    fn cidr(s: &str) -> Cidr {
        s.parse().expect("a CIDR")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    /// The first, the last and a few addresses between of `c`.
    fn samples(c: &Cidr) -> Vec<IpAddr> {
        let (bits, width) = match c.addr() {
            IpAddr::V4(a) => (u32::from(a) as u128, 32),
            IpAddr::V6(a) => (u128::from(a), 128),
        };
        let span = if width - c.prefix() as u32 >= 128 {
            u128::MAX
        } else {
            (1u128 << (width - c.prefix() as u32)) - 1
        };
        [
            0,
            1,
            span / 7,
            span / 3,
            span / 2,
            span.saturating_sub(1),
            span,
        ]
        .into_iter()
        .map(|off| {
            let x = bits + off.min(span);
            if width == 32 {
                IpAddr::from((x as u32).to_be_bytes())
            } else {
                IpAddr::from(x.to_be_bytes())
            }
        })
        .collect()
    }

    #[test]
    fn every_address_of_a_range_finds_its_bit_set() {
        for range in [
            "10.0.0.0/8",
            "10.96.0.0/12",
            "192.0.2.0/24",
            "198.51.100.7/32",
            "2001:db8::/32",
            "2001:db8:8000::/33",
            "2001:db8:2::/47",
            "2001:db8:2::/48",
            "2001:db8:2:40::/56",
            "fd00:10:96::/108",
            "2001:db8:2::50/128",
        ] {
            let c = cidr(range);
            let mut bits = empty();
            mark(&mut bits, &c);
            for a in samples(&c) {
                assert!(c.contains(&a), "{a} in {range}");
                assert!(
                    maybe_in(&bits, &a),
                    "{a} of {range} is excluded by the hint"
                );
            }
        }
    }

    #[test]
    fn an_ipv6_range_wider_than_a_32_turns_the_hint_off() {
        let mut bits = empty();
        mark(&mut bits, &cidr("2001:db8::/31"));
        assert_ne!(bits.cluster_v6_wide, 0);
        assert!(maybe_in(&bits, &ip("2001:db9:ffff::1")));
        assert!(!maybe_in(&bits, &ip("203.0.113.1")), "IPv4 keeps its hint");
    }

    #[test]
    fn the_link_local_range_every_node_holds_leaves_the_hint_on() {
        let mut bits = empty();
        for c in crate::model::cluster::link_local() {
            mark(&mut bits, &c);
        }
        mark(&mut bits, &cidr("2001:db8:2::/48"));
        assert_eq!(bits.cluster_v6_wide, 0);
        for inside in ["fe80::1", "febf:ffff::1", "2001:db8:2::50", "169.254.1.1"] {
            assert!(
                maybe_in(&bits, &ip(inside)),
                "{inside} is excluded by the hint"
            );
        }
        assert!(!maybe_in(&bits, &ip("2001:db8:300::200")));
        assert!(!maybe_in(&bits, &ip("fec0::1")), "past fe80::/10");
    }

    #[test]
    fn an_outside_client_of_the_clusters_32_is_excluded_by_its_48() {
        // A provider's cluster and its clients share its /32: the hint
        // tells them apart by their /48s (this pair's slots differ).
        let mut bits = empty();
        for range in ["2001:db8:2::/48", "2001:db8:3:1::/64", "198.51.100.0/24"] {
            mark(&mut bits, &cidr(range));
        }
        assert!(maybe_in(&bits, &ip("2001:db8:3:1::9")));
        for outside in ["2001:db8:100::200", "2001:db8:203::200", "2001:db9::1"] {
            assert!(!maybe_in(&bits, &ip(outside)), "{outside} needs the trie");
        }
        assert!(!maybe_in(&bits, &ip("203.0.113.200")));
    }
}
