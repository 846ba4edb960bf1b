//! An IP prefix (`192.0.2.0/24`, `2001:db8::/32`), as Services, Nodes and
//! flags write them.
use serde::{Deserialize, Serialize};
use std::{fmt, net::IpAddr, str::FromStr};

/// A network: its address with the host bits cleared, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

fn width(ip: &IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

fn bits(ip: &IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(*a) as u128,
        IpAddr::V6(a) => u128::from(*a),
    }
}

fn mask(prefix: u8, width: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        let all = if width == 32 {
            u32::MAX as u128
        } else {
            u128::MAX
        };
        all & !((1u128 << (width - prefix)) - 1)
    }
}

impl Cidr {
    /// `addr/prefix`, host bits cleared. `None` if the prefix is too long.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Cidr> {
        let w = width(&addr);
        if prefix > w {
            return None;
        }
        let net = bits(&addr) & mask(prefix, w);
        let addr = match addr {
            IpAddr::V4(_) => IpAddr::from((net as u32).to_be_bytes()),
            IpAddr::V6(_) => IpAddr::from(net.to_be_bytes()),
        };
        Some(Cidr { addr, prefix })
    }

    /// One address, as a /32 or /128.
    pub fn host(addr: IpAddr) -> Cidr {
        Cidr {
            addr,
            prefix: width(&addr),
        }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        ip.is_ipv4() == self.addr.is_ipv4()
            && bits(ip) & mask(self.prefix, width(ip)) == bits(&self.addr)
    }

    /// The last address of the network.
    pub fn last(&self) -> IpAddr {
        let w = width(&self.addr);
        let host = !mask(self.prefix, w) & if w == 32 { u32::MAX as u128 } else { u128::MAX };
        let last = bits(&self.addr) | host;
        match self.addr {
            IpAddr::V4(_) => IpAddr::from((last as u32).to_be_bytes()),
            IpAddr::V6(_) => IpAddr::from(last.to_be_bytes()),
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// `a.b.c.d/n`, `x::y/n`, or a bare address (a host).
    fn from_str(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP prefix"))?;
        let prefix = match prefix {
            None => width(&addr),
            Some(p) => p
                .parse::<u8>()
                .map_err(|_| format!("{s:?} has an invalid prefix length"))?,
        };
        Cidr::new(addr, prefix).ok_or_else(|| format!("{s:?} has a prefix longer than the address"))
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Cidr, String> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// An inclusive range of addresses of one family: what interval sets and
/// LPM tries hold once overlapping and adjacent prefixes are merged (the
/// kernel refuses overlapping intervals, and reads back merged ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IpRange {
    pub first: IpAddr,
    pub last: IpAddr,
}

fn from_bits(v4: bool, b: u128) -> IpAddr {
    if v4 {
        IpAddr::from((b as u32).to_be_bytes())
    } else {
        IpAddr::from(b.to_be_bytes())
    }
}

impl IpRange {
    pub fn of(c: &Cidr) -> IpRange {
        IpRange {
            first: c.addr(),
            last: c.last(),
        }
    }

    pub fn is_ipv4(&self) -> bool {
        self.first.is_ipv4()
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        ip.is_ipv4() == self.is_ipv4()
            && bits(&self.first) <= bits(ip)
            && bits(ip) <= bits(&self.last)
    }

    /// The address after `last`, if the range does not end the family.
    pub fn after(&self) -> Option<IpAddr> {
        let max = if self.is_ipv4() {
            u32::MAX as u128
        } else {
            u128::MAX
        };
        let last = bits(&self.last);
        (last < max).then(|| from_bits(self.is_ipv4(), last + 1))
    }

    /// The fewest prefixes that cover exactly this range (for LPM tries).
    pub fn cidrs(&self) -> Vec<Cidr> {
        let v4 = self.is_ipv4();
        let w = if v4 { 32u32 } else { 128 };
        let (mut lo, hi) = (bits(&self.first), bits(&self.last));
        let mut out = Vec::new();
        loop {
            // The largest aligned block starting at lo that stays <= hi.
            let align = if lo == 0 {
                w
            } else {
                lo.trailing_zeros().min(w)
            };
            let fits = |size: u32| {
                if size >= 128 {
                    lo == 0 && hi == u128::MAX
                } else {
                    lo.checked_add((1u128 << size) - 1)
                        .is_some_and(|end| end <= hi)
                }
            };
            let mut size = align;
            while size > 0 && !fits(size) {
                size -= 1;
            }
            out.push(Cidr::new(from_bits(v4, lo), (w - size) as u8).expect("aligned block"));
            let block_last = if size >= 128 {
                u128::MAX
            } else {
                lo + ((1u128 << size) - 1)
            };
            if block_last >= hi {
                return out;
            }
            lo = block_last + 1;
        }
    }
}

/// Merges prefixes into disjoint, non-adjacent ranges.
pub fn merge(cidrs: impl IntoIterator<Item = Cidr>) -> std::collections::BTreeSet<IpRange> {
    let mut all: Vec<IpRange> = cidrs.into_iter().map(|c| IpRange::of(&c)).collect();
    all.sort_by_key(|r| (!r.is_ipv4(), bits(&r.first), bits(&r.last)));
    let mut out: Vec<IpRange> = Vec::new();
    for r in all {
        if let Some(prev) = out.last_mut() {
            let touches = prev.is_ipv4() == r.is_ipv4()
                && prev
                    .after()
                    .is_none_or(|next| bits(&r.first) <= bits(&next));
            if touches {
                if bits(&r.last) > bits(&prev.last) {
                    prev.last = r.last;
                }
                continue;
            }
        }
        out.push(r);
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Cidr {
        s.parse().expect("valid")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("valid")
    }

    #[test]
    fn parses_masks_and_contains() {
        assert_eq!(c("192.0.2.77/26").to_string(), "192.0.2.64/26");
        assert_eq!(c("192.0.2.7").to_string(), "192.0.2.7/32");
        assert_eq!(c("2001:db8:2::1ff/120").to_string(), "2001:db8:2::100/120");
        assert_eq!(c("0.0.0.0/0").last(), ip("255.255.255.255"));
        assert_eq!(c("192.0.2.64/26").last(), ip("192.0.2.127"));
        assert_eq!(
            c("2001:db8::/32").last(),
            ip("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff")
        );
        assert!(c("192.0.2.64/26").contains(&ip("192.0.2.100")));
        assert!(!c("192.0.2.64/26").contains(&ip("192.0.2.128")));
        assert!(!c("0.0.0.0/0").contains(&ip("::1")));
        assert!(c("::/0").contains(&ip("2001:db8::1")));
        for bad in ["192.0.2.0/33", "10.0.0.0/x", "nope", "2001:db8::/129", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn merges_overlapping_and_adjacent_prefixes_and_covers_ranges_with_prefixes() {
        let merged = merge([
            c("192.0.2.0/25"),
            c("192.0.2.128/25"),
            c("192.0.2.5/32"),
            c("198.51.100.7"),
            c("2001:db8::/33"),
            c("2001:db8:8000::/33"),
            c("0.0.0.0/0"),
        ]);
        let v: Vec<String> = merged
            .iter()
            .map(|r| format!("{}-{}", r.first, r.last))
            .collect();
        assert_eq!(
            v,
            [
                "0.0.0.0-255.255.255.255",
                "2001:db8::-2001:db8:ffff:ffff:ffff:ffff:ffff:ffff"
            ]
        );
        let r = merge([c("10.0.0.0/24"), c("10.0.1.0/25")]);
        let cover: Vec<String> = r
            .iter()
            .flat_map(|r| r.cidrs())
            .map(|c| c.to_string())
            .collect();
        assert_eq!(cover, ["10.0.0.0/24", "10.0.1.0/25"]);
        let odd = IpRange {
            first: ip("10.0.0.3"),
            last: ip("10.0.0.9"),
        };
        let cover: Vec<String> = odd.cidrs().iter().map(|c| c.to_string()).collect();
        assert_eq!(cover, ["10.0.0.3/32", "10.0.0.4/30", "10.0.0.8/31"]);
        assert_eq!(IpRange::of(&c("::/0")).cidrs(), vec![c("::/0")]);
        assert_eq!(IpRange::of(&c("0.0.0.0/0")).after(), None);
        assert_eq!(IpRange::of(&c("10.0.0.0/8")).after(), Some(ip("11.0.0.0")));
    }
}
