//! A tracer of our rules without root: the chains `schema.rs` defines,
//! run expression by expression over a packet, against the sets the
//! encoder would fill from a datapath state (`encode::groups`). As
//! kube-proxy traces packets through its fake nftables: the rules' logic
//! is tested in the rootless tier, table by table; the kernel's own run of
//! the same rules is the scenario suite's.
//!
//! What the tracer takes as given, where the kernel decides: the
//! conntrack state and original destination of the packet, the route
//! type of its destination, and whether its route leaves by its input
//! interface. Checksums are not computed.
use super::encode::{groups, Element};
use super::expr::Expr;
use super::schema::{ChainDef, Layout};
use super::sys::*;
use crate::datapath::DatapathState;
use crate::netlink::wire::ip_bytes;
use std::{collections::BTreeMap, net::IpAddr};

/// A packet as the rules see it, and what the kernel would say of it.
#[derive(Clone, Debug)]
pub struct Packet {
    /// The network header.
    pub nh: Vec<u8>,
    /// The transport header (and what follows: an ICMP error's quote).
    pub th: Vec<u8>,
    pub l4proto: u8,
    pub iif: u32,
    pub mark: u32,
    /// `ct state` bits; `None`: untracked.
    pub ct_state: u32,
    pub ct_status: u32,
    /// The destination of the connection's original direction.
    pub ct_original_daddr: Option<IpAddr>,
    /// The route type (RTN_*) of the destination.
    pub fib_type: u32,
    /// `fib daddr . iif oif`: the input interface if the route to the
    /// destination leaves by it, else 0.
    pub fib_iif_oif: u32,
    pub oifkind: &'static str,
}

/// An IPv4 or IPv6 packet from `src` to `dst` of protocol `l4proto`, with
/// ports (or an ICMP type in the first byte), arriving on `iif`, of a new
/// connection, toward a unicast route.
pub fn packet(src: &str, dst: &str, l4proto: u8, sport: u16, dport: u16, iif: u32) -> Packet {
    let (src, dst): (IpAddr, IpAddr) = (
        src.parse().expect("source address"),
        dst.parse().expect("destination address"),
    );
    let l = Layout::of(&dst);
    let mut nh = vec![0u8; if dst.is_ipv4() { 20 } else { 40 }];
    let len = l.addr_len as usize;
    nh[l.saddr_offset as usize..][..len].copy_from_slice(&ip_bytes(&src));
    nh[l.daddr_offset as usize..][..len].copy_from_slice(&ip_bytes(&dst));
    let mut th = vec![0u8; 8];
    th[0..2].copy_from_slice(&sport.to_be_bytes());
    th[2..4].copy_from_slice(&dport.to_be_bytes());
    Packet {
        nh,
        th,
        l4proto,
        iif,
        mark: 0,
        ct_state: 8,
        ct_status: 0,
        ct_original_daddr: Some(dst),
        fib_type: RTN_UNICAST,
        fib_iif_oif: 0,
        oifkind: "veth",
    }
}

impl Packet {
    fn addr(&self, offset: u32) -> IpAddr {
        let l = if self.nh.len() == 20 {
            &super::schema::IPV4
        } else {
            &super::schema::IPV6
        };
        let b = &self.nh[offset as usize..][..l.addr_len as usize];
        l.addr_from_bytes(b).expect("an address")
    }

    pub fn saddr(&self) -> IpAddr {
        self.addr(if self.nh.len() == 20 { 12 } else { 8 })
    }

    pub fn daddr(&self) -> IpAddr {
        self.addr(if self.nh.len() == 20 { 16 } else { 24 })
    }
}

/// What a hook did with a packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Dropped by the named chain's rule (its comment).
    Drop(&'static str),
}

/// The sets of one family's table holding `state`.
pub struct Sets(BTreeMap<String, Vec<Element>>);

impl Sets {
    pub fn of(state: &DatapathState, l: &Layout) -> Sets {
        let diff = DatapathState::default().diff(state);
        let mut sets = BTreeMap::new();
        for (name, make) in groups(&diff, &diff.guard).iter() {
            let mine: Vec<Element> = make(false).filter(|e| Layout::of(&e.ip) == l).collect();
            sets.insert(name.to_string(), mine);
        }
        Sets(sets)
    }

    /// The element `key` finds in `set`: an exact key, the interval it
    /// falls in (an rbtree set: the greatest start at or below it, unless
    /// that is an interval's end), or the concatenated range holding it.
    fn find(&self, set: &str, key: &[u8]) -> Option<&Element> {
        let elements = self.0.get(set)?;
        if elements.iter().any(|e| e.interval_end) || set == super::schema::CLUSTER {
            return (elements.iter())
                .filter(|e| e.key.as_slice() <= key)
                .max_by(|a, b| a.key.cmp(&b.key))
                .filter(|e| !e.interval_end);
        }
        elements.iter().find(|e| match &e.key_end {
            Some(end) => e.key.as_slice() <= key && key <= end.as_slice(),
            None => e.key == key,
        })
    }
}

/// 64 bytes: the four 16-byte registers, or sixteen 32-bit ones.
struct Regs([u8; 64]);

impl Regs {
    fn at(r: u32) -> usize {
        if r >= NFT_REG32_00 {
            ((r - NFT_REG32_00) * 4) as usize
        } else {
            (r.saturating_sub(1) * 16) as usize
        }
    }

    /// Writes `data` at register `r`, the rest of its last 32-bit word
    /// zeroed (as the kernel does).
    fn put(&mut self, r: u32, data: &[u8]) {
        let at = Regs::at(r);
        let words = data.len().div_ceil(4) * 4;
        self.0[at..at + words].fill(0);
        self.0[at..at + data.len()].copy_from_slice(data);
    }

    fn get(&self, r: u32, len: usize) -> &[u8] {
        &self.0[Regs::at(r)..][..len]
    }
}

/// What one chain did: its verdict, if a rule gave one.
enum Ending {
    Accept,
    Drop(&'static str),
    /// The end of the chain (its policy: accept).
    Fell,
}

fn header(p: &mut Packet, base: u32) -> &mut Vec<u8> {
    if base == NFT_PAYLOAD_NETWORK_HEADER {
        &mut p.nh
    } else {
        &mut p.th
    }
}

/// Runs one rule: `None` when a condition does not hold (the next rule
/// runs), else what it ended with (`Fell` when it matched without a
/// verdict).
fn run_rule(exprs: &[Expr], comment: &'static str, sets: &Sets, p: &mut Packet) -> Option<Ending> {
    let mut regs = Regs([0; 64]);
    for e in exprs {
        match e {
            Expr::Load {
                base,
                offset,
                len,
                dreg,
            } => {
                let h = header(p, *base);
                let data = h.get(*offset as usize..(*offset + *len) as usize)?.to_vec();
                regs.put(*dreg, &data);
            }
            Expr::Store {
                base,
                offset,
                len,
                sreg,
                ..
            } => {
                let data = regs.get(*sreg, *len as usize).to_vec();
                let h = header(p, *base);
                h.get_mut(*offset as usize..(*offset + *len) as usize)?
                    .copy_from_slice(&data);
            }
            Expr::Meta { key, dreg } => match *key {
                NFT_META_IIF => regs.put(*dreg, &p.iif.to_ne_bytes()),
                NFT_META_L4PROTO => regs.put(*dreg, &[p.l4proto]),
                NFT_META_MARK => regs.put(*dreg, &p.mark.to_ne_bytes()),
                NFT_META_OIFKIND => {
                    let mut name = [0u8; 16];
                    name[..p.oifkind.len()].copy_from_slice(p.oifkind.as_bytes());
                    regs.put(*dreg, &name);
                }
                other => panic!("meta key {other} is not traced"),
            },
            Expr::MetaSet { key, sreg } => {
                assert_eq!(*key, NFT_META_MARK, "only the mark is set");
                let v = regs.get(*sreg, 4);
                p.mark = u32::from_ne_bytes([v[0], v[1], v[2], v[3]]);
            }
            Expr::Ct { key, dreg, .. } => match *key {
                NFT_CT_STATE => regs.put(*dreg, &p.ct_state.to_ne_bytes()),
                NFT_CT_STATUS => regs.put(*dreg, &p.ct_status.to_ne_bytes()),
                NFT_CT_DST_IP | NFT_CT_DST_IP6 => regs.put(*dreg, &ip_bytes(&p.ct_original_daddr?)),
                other => panic!("ct key {other} is not traced"),
            },
            Expr::FibDaddrType { dreg } => regs.put(*dreg, &p.fib_type.to_ne_bytes()),
            Expr::FibDaddrIif { dreg } => regs.put(*dreg, &p.fib_iif_oif.to_ne_bytes()),
            Expr::Bitwise { reg, mask, xor } => {
                let v: Vec<u8> = (regs.get(*reg, mask.len()).iter())
                    .zip(mask.iter().zip(xor))
                    .map(|(v, (m, x))| (v & m) ^ x)
                    .collect();
                regs.put(*reg, &v);
            }
            Expr::Cmp { sreg, op, data } => {
                let order = regs.get(*sreg, data.len()).cmp(data.as_slice());
                let holds = match *op {
                    NFT_CMP_EQ => order.is_eq(),
                    NFT_CMP_NEQ => order.is_ne(),
                    NFT_CMP_LTE => order.is_le(),
                    NFT_CMP_GTE => order.is_ge(),
                    other => panic!("cmp op {other} is not traced"),
                };
                if !holds {
                    return None;
                }
            }
            Expr::Lookup {
                set,
                sreg,
                dreg,
                invert,
                ..
            } => {
                let len = set_key_len(set, p);
                let found = sets.find(set, regs.get(*sreg, len));
                match (dreg, found) {
                    (Some(d), Some(e)) => {
                        let value = e.value.clone().expect("a map's element has a value");
                        regs.put(*d, &value);
                    }
                    (Some(_), None) => return None,
                    (None, found) if found.is_some() == *invert => return None,
                    (None, _) => {}
                }
            }
            Expr::Dnat { reg, .. } => {
                let len = if p.nh.len() == 20 { 4 } else { 16 };
                let to = regs.get(*reg, len).to_vec();
                let l = Layout::of(&p.daddr());
                let at = l.daddr_offset as usize;
                p.nh[at..at + len].copy_from_slice(&to);
                return Some(Ending::Accept);
            }
            Expr::Masquerade => return Some(Ending::Accept),
            Expr::Counter => {}
            Expr::Verdict(code) if *code == NF_ACCEPT => return Some(Ending::Accept),
            Expr::Verdict(code) if *code == NF_DROP => return Some(Ending::Drop(comment)),
            Expr::Verdict(code) => panic!("verdict {code} is not traced"),
        }
    }
    Some(Ending::Fell)
}

/// The key length of `set` in the packet's family.
fn set_key_len(set: &str, p: &Packet) -> usize {
    let l = if p.nh.len() == 20 {
        &super::schema::IPV4
    } else {
        &super::schema::IPV6
    };
    (super::schema::sets(l).iter())
        .find(|s| s.name == set)
        .map_or(l.addr_len, |s| s.key_len) as usize
}

fn run_chain(chain: &ChainDef, sets: &Sets, p: &mut Packet) -> Ending {
    for rule in &chain.rules {
        match run_rule(&rule.exprs, rule.comment, sets, p) {
            None | Some(Ending::Fell) => continue,
            Some(end) => return end,
        }
    }
    Ending::Fell
}

/// Runs the packet through our base chains at `hook`, in priority order,
/// as the kernel does: a drop ends it, an accept ends only its chain. Nat
/// chains see only a connection's first packet.
pub fn hook(l: &Layout, hook: u32, sets: &Sets, p: &mut Packet) -> Verdict {
    let mut chains: Vec<ChainDef> = (super::schema::chains(l).into_iter())
        .filter(|c| c.hook == hook)
        .collect();
    chains.sort_by_key(|c| c.priority);
    for chain in &chains {
        if chain.kind == "nat" && p.ct_state & CT_STATE_NEW == 0 {
            continue;
        }
        if let Ending::Drop(why) = run_chain(chain, sets, p) {
            return Verdict::Drop(why);
        }
    }
    Verdict::Accept
}

/// `ct state new`.
pub const CT_STATE_NEW: u32 = 8;

#[cfg(test)]
mod tests;
