//! Random and mutated frames for fuzzing the packet paths: structured
//! frames (Ethernet, VLAN, IPv4 with options, IPv6 with extension headers,
//! fragments, TCP/UDP/ICMP/ICMPv6, ICMP errors quoting a packet) built from
//! pools of interesting addresses and ports, then cut, flipped or left
//! whole. Deterministic for a seed, so that a failure can be replayed.
use crate::packets::frames::{Spec, GRE, ICMP, ICMPV6, TCP, UDP};
use std::net::IpAddr;

/// SplitMix64: small, fast, and good enough to pick test inputs.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// What frames are made of: addresses of one family each, and ports.
#[derive(Clone, Debug)]
pub struct Pools {
    pub v4: Vec<IpAddr>,
    pub v6: Vec<IpAddr>,
    /// Ports the datapath treats specially (listed in a filter...).
    pub ports: Vec<u16>,
    /// Destinations to aim at more often than the rest (both families).
    pub targets: Vec<IpAddr>,
}

/// How a structured frame was changed afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    Whole,
    /// Cut to this many bytes.
    Cut(usize),
    /// Some bytes changed at random.
    Flipped,
}

fn address(rng: &mut Rng, pool: &[IpAddr], v6: bool) -> IpAddr {
    if rng.chance(85) {
        *rng.pick(pool)
    } else if v6 {
        let mut o = [0u8; 16];
        o[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
        for b in &mut o[4..] {
            *b = rng.next_u64() as u8;
        }
        IpAddr::from(o)
    } else {
        IpAddr::from([203, 0, 113, rng.next_u64() as u8])
    }
}

fn port(rng: &mut Rng, pools: &Pools) -> u16 {
    if rng.chance(50) {
        *rng.pick(&pools.ports)
    } else {
        rng.next_u64() as u16
    }
}

/// ICMP(v6) types: echo, every error type, neighbour discovery, random.
fn icmp_type(rng: &mut Rng, v6: bool) -> u8 {
    let types: &[u8] = if v6 {
        &[128, 129, 1, 2, 3, 4, 133, 134, 135, 136, 137]
    } else {
        &[8, 0, 3, 4, 5, 11, 12, 13]
    };
    if rng.chance(90) {
        *rng.pick(types)
    } else {
        rng.next_u64() as u8
    }
}

fn is_error(t: u8, v6: bool) -> bool {
    if v6 {
        (1..=4).contains(&t)
    } else {
        matches!(t, 3..=5 | 11 | 12)
    }
}

/// A structured frame with correct lengths and checksums.
pub fn structured(rng: &mut Rng, pools: &Pools, depth: u8) -> Vec<u8> {
    let v6 = rng.chance(50);
    let pool = if v6 { &pools.v6 } else { &pools.v4 };
    let icmp = if v6 { ICMPV6 } else { ICMP };
    let any = rng.next_u64() as u8;
    let proto = *rng.pick(&[TCP, TCP, UDP, UDP, icmp, icmp, GRE, 132, any]);
    let aimed: Vec<IpAddr> = pools
        .targets
        .iter()
        .copied()
        .filter(|t| t.is_ipv6() == v6)
        .collect();
    let dst = if !aimed.is_empty() && rng.chance(30) {
        *rng.pick(&aimed)
    } else {
        address(rng, pool, v6)
    };
    let mut spec = Spec::new(address(rng, pool, v6), dst, proto);
    spec = spec.ports(port(rng, pools), port(rng, pools));
    spec.options = rng.chance(15);
    spec.vlan = rng.chance(10);
    spec.udp_no_checksum = !v6 && rng.chance(10);
    let any = rng.next_u64() as u8;
    spec.hop_limit = *rng.pick(&[64, 255, 1, any]);
    if rng.chance(10) {
        let offset = if rng.chance(50) {
            0
        } else {
            8 * (1 + rng.below(100) as u16)
        };
        spec.fragment = Some((rng.below(4) as u32, offset, rng.chance(70)));
    }
    spec.payload = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
    if proto == icmp {
        let t = icmp_type(rng, v6);
        spec.icmp_type = Some(t);
        if is_error(t, v6) && depth == 0 {
            // The quoted packet: a frame of the same family, its IP part,
            // possibly cut (routers quote a prefix).
            let mut quoted = structured_family(rng, pools, v6, 1);
            let l3 = if quoted.get(12..14) == Some(&[0x81, 0x00][..]) {
                18
            } else {
                14
            };
            let mut ip = quoted.split_off(l3.min(quoted.len()));
            if rng.chance(30) {
                let keep = rng.below(ip.len() + 1);
                ip.truncate(keep);
            }
            spec.payload = ip;
        }
    }
    spec.build()
}

/// [`structured`] of one family (for quoted packets).
fn structured_family(rng: &mut Rng, pools: &Pools, v6: bool, depth: u8) -> Vec<u8> {
    loop {
        let f = structured(rng, pools, depth);
        let is_v6 =
            f.get(12..14) == Some(&[0x86, 0xdd][..]) || f.get(16..18) == Some(&[0x86, 0xdd][..]);
        if is_v6 == v6 {
            return f;
        }
    }
}

/// A structured frame, then possibly cut or flipped (never below
/// `min_len` bytes: what the kernel's test runner accepts).
pub fn frame(rng: &mut Rng, pools: &Pools, min_len: usize) -> (Vec<u8>, Mutation) {
    let mut f = structured(rng, pools, 0);
    let mutation = match rng.below(10) {
        0..=4 => Mutation::Whole,
        5..=6 => {
            let cut = min_len + rng.below(f.len().saturating_sub(min_len) + 1);
            f.truncate(cut.min(f.len()));
            Mutation::Cut(f.len())
        }
        _ => {
            for _ in 0..1 + rng.below(4) {
                // Mostly in the headers, where the parsing is.
                let span = f.len().min(96);
                let at = rng.below(span);
                f[at] = rng.next_u64() as u8;
            }
            Mutation::Flipped
        }
    };
    (f, mutation)
}

/// Hex, for keeping a frame as a regression case.
pub fn to_hex(f: &[u8]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packets::frames::parse;

    fn pools() -> Pools {
        Pools {
            v4: vec!["192.0.2.1".parse().unwrap(), "203.0.113.1".parse().unwrap()],
            v6: vec!["2001:db8::1".parse().unwrap()],
            ports: vec![22, 53],
            targets: vec![],
        }
    }

    #[test]
    fn same_seed_same_frames_and_hex_round_trips() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..200 {
            let fa = frame(&mut a, &pools(), 34);
            assert_eq!(fa, frame(&mut b, &pools(), 34));
            assert_eq!(from_hex(&to_hex(&fa.0)), Some(fa.0));
        }
    }

    #[test]
    fn whole_frames_parse_with_correct_checksums() {
        let mut rng = Rng::new(1);
        let mut checked = 0;
        for _ in 0..500 {
            let f = structured(&mut rng, &pools(), 0);
            let seen = parse(&f).expect("a structured frame parses");
            assert!(seen.ip_checksum_ok);
            if !seen.fragment {
                assert_ne!(seen.l4_checksum_ok, Some(false), "{}", to_hex(&f));
                checked += u32::from(seen.l4_checksum_ok == Some(true));
            }
        }
        assert!(checked > 100, "only {checked} frames with a checksum");
    }
}
