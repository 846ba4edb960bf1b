//! The ruleset of the nft backend: one table per family (`ip cozy_proxy`,
//! `ip6 cozy_proxy`), the same sets, chains and rules in both. The original
//! cozy-proxy's three chains, extended for a cluster (docs/traffic.md,
//! docs/nft-datapath.md): anti-spoofing, in-cluster exemptions, client-side
//! translation for in-cluster clients, ICMP errors, source ranges, and a
//! port filter that fails closed.
use super::expr::Expr;
use super::sys::*;
use crate::datapath::Capacity;
use cozy_proxy_common::limits;
use std::net::IpAddr;

pub const TABLE: &str = "cozy_proxy";

/// Stored as the table's user data. Change it whenever the sets, chains or
/// rules change: a table with another mark is replaced (atomically) at the
/// first sync, one with this mark is adopted as it is.
pub const SCHEMA_MARK: &[u8] = b"cozy-proxy nft schema 8";

pub const POD_SVC: &str = "pod_svc";
pub const SVC_POD: &str = "svc_pod";
pub const REMOTE: &str = "remote";
pub const FILTERED_PODS: &str = "filtered_pods";
pub const ALLOWED_PORTS: &str = "allowed_ports";
pub const ICMP_ALLOWED_PODS: &str = "icmp_allowed_pods";
pub const UNMAPPED_LBS: &str = "unmapped_lbs";
pub const CLUSTER: &str = "cluster";
pub const RANGED_LBS: &str = "ranged_lbs";
pub const SOURCE_RANGES: &str = "source_ranges";
pub const GUARDED: &str = "guarded";
pub const GUARD_PATHS: &str = "guard_paths";

pub const PRIO_RAW: i32 = -300;
pub const PRIO_MANGLE: i32 = -150;
pub const PRIO_DSTNAT: i32 = -100;
pub const PRIO_FILTER: i32 = 0;
pub const PRIO_SRCNAT: i32 = 100;

/// Carries "masquerade this hairpin" from the forward hook (where the
/// route back to the client can be asked) to source NAT.
pub use cozy_proxy_common::HAIRPIN_MARK;

/// Where a family keeps its addresses and checksums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub nfproto: u8,
    /// `nft` family keyword.
    pub name: &'static str,
    pub addr_len: u32,
    pub addr_type: u32,
    pub saddr_offset: u32,
    pub daddr_offset: u32,
    /// IPv4 header checksum offset; IPv6 has none.
    pub ip_csum_offset: Option<u32>,
    pub icmp_proto: u8,
    /// `ct original daddr` key.
    pub ct_daddr: u32,
    /// ICMP error types, as inclusive ranges.
    pub icmp_errors: &'static [(u8, u8)],
    /// Neighbour discovery's ICMP types, as an inclusive range (IPv6's;
    /// IPv4 has ARP, which no IP rule sees).
    pub neighbour_discovery: Option<(u8, u8)>,
}

pub const IPV4: Layout = Layout {
    nfproto: NFPROTO_IPV4,
    name: "ip",
    addr_len: 4,
    addr_type: TYPE_IPADDR,
    saddr_offset: 12,
    daddr_offset: 16,
    ip_csum_offset: Some(10),
    icmp_proto: 1,
    ct_daddr: NFT_CT_DST_IP,
    // destination unreachable, source quench, redirect; time exceeded,
    // parameter problem
    icmp_errors: &[(3, 5), (11, 12)],
    neighbour_discovery: None,
};

pub const IPV6: Layout = Layout {
    nfproto: NFPROTO_IPV6,
    name: "ip6",
    addr_len: 16,
    addr_type: TYPE_IP6ADDR,
    saddr_offset: 8,
    daddr_offset: 24,
    ip_csum_offset: None,
    icmp_proto: 58,
    ct_daddr: NFT_CT_DST_IP6,
    // destination unreachable, packet too big, time exceeded, parameter
    // problem
    icmp_errors: &[(1, 4)],
    neighbour_discovery: Some((133, 137)),
};

pub const LAYOUTS: [Layout; 2] = [IPV4, IPV6];

/// An ICMP error's header before the quoted packet.
const ICMP_HDR: u32 = 8;
/// The ICMP checksum's offset in the ICMP header.
const ICMP_CSUM: u32 = 2;

impl Layout {
    pub fn of(ip: &IpAddr) -> &'static Layout {
        match ip {
            IpAddr::V4(_) => &IPV4,
            IpAddr::V6(_) => &IPV6,
        }
    }

    pub fn addr_from_bytes(&self, b: &[u8]) -> Option<IpAddr> {
        match (self.addr_len, b.len()) {
            (4, 4) => <[u8; 4]>::try_from(b).ok().map(IpAddr::from),
            (16, 16) => <[u8; 16]>::try_from(b).ok().map(IpAddr::from),
            _ => None,
        }
    }

    /// Registers one address takes (nf_tables registers are 32 bits).
    fn addr_regs(&self) -> u32 {
        self.addr_len / 4
    }

    /// Key of `allowed_ports`: address . protocol . port, each component
    /// padded to 4 bytes.
    pub fn port_key(ip: &IpAddr, proto: u8, port: u16) -> Vec<u8> {
        let mut k = crate::netlink::wire::ip_bytes(ip);
        k.extend_from_slice(&[proto, 0, 0, 0]);
        k.extend_from_slice(&port.to_be_bytes());
        k.extend_from_slice(&[0, 0]);
        k
    }

    pub fn parse_port_key(&self, k: &[u8]) -> Option<(IpAddr, u8, u16)> {
        let a = self.addr_len as usize;
        if k.len() != a + 8 {
            return None;
        }
        let ip = self.addr_from_bytes(&k[..a])?;
        Some((ip, k[a], u16::from_be_bytes([k[a + 4], k[a + 5]])))
    }

    /// Key of `guard_paths`: address . interface index (host order, as
    /// `meta iif` loads it).
    pub fn path_key(ip: &IpAddr, ifindex: u32) -> Vec<u8> {
        let mut k = crate::netlink::wire::ip_bytes(ip);
        k.extend_from_slice(&ifindex.to_ne_bytes());
        k
    }

    pub fn parse_path_key(&self, k: &[u8]) -> Option<(IpAddr, u32)> {
        let a = self.addr_len as usize;
        let ip = self.addr_from_bytes(k.get(..a)?)?;
        let index = u32::from_ne_bytes(k.get(a..a + 4)?.try_into().ok()?);
        Some((ip, index))
    }

    /// Where the quoted packet's source (or destination) address sits in
    /// an ICMP error, from the start of the ICMP header.
    fn inner_addr(&self, source: bool) -> u32 {
        ICMP_HDR
            + if source {
                self.saddr_offset
            } else {
                self.daddr_offset
            }
    }
}

/// One of our tables: its family, the mark of its version (stored as the
/// table's user data), its sets and chains.
pub struct Table {
    pub nfproto: u8,
    /// `nft` family keyword.
    pub family: &'static str,
    pub mark: &'static [u8],
    pub sets: Vec<SetDef>,
    pub chains: Vec<ChainDef>,
}

impl Layout {
    /// This family's table.
    pub fn table(&self) -> Table {
        Table {
            nfproto: self.nfproto,
            family: self.name,
            mark: SCHEMA_MARK,
            sets: sets(self),
            chains: chains(self),
        }
    }
}

/// A set or map, as created and as read back for comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetDef {
    pub name: String,
    pub id: u32,
    /// NFT_SET_MAP, NFT_SET_INTERVAL, NFT_SET_CONCAT.
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// `(type, len)` of map values.
    pub data: Option<(u32, u32)>,
    /// The field lengths of a concatenated interval key (NFTA_SET_DESC).
    pub fields: Vec<u32>,
    /// Elements the set holds at most (NFTA_SET_DESC_SIZE); 0: no limit.
    /// A size makes the kernel pick its fixed-size hash (`nft_hash`, or
    /// `nft_hash_fast` for 4-byte keys) over the resizable one: no table
    /// growth while a full sync fills it (about a third of the kernel's
    /// time for 300 000 elements), a cheaper lookup per packet, and no
    /// dump that misses elements during a resize. The kernel enforces the
    /// size (ENFILE), so the backend reports it as its capacity and the
    /// sync never asks for more ([`set_capacity`]).
    pub size: u32,
}

/// The sizes of the sets that grow with every mapping (the eBPF maps'
/// limits: a node holds as many mappings on either backend): the two maps
/// hold one entry per local mapping, `guarded` and `guard_paths` one per
/// guarded address (pods and LB IPs). The others stay unsized: they hold
/// what few Services ask for (filtered pods, allowed ports, unmapped or
/// ranged LB IPs), and a sized set's buckets are allocated whole up front
/// (a 196 608-entry set takes 4 MiB, a 65 536-entry one 2 MiB).
const MAPPING_SET_SIZE: u32 = limits::MAPPINGS as u32;
pub(super) const ADDR_SET_SIZE: u32 = limits::ADDRS as u32;

/// What the sized sets hold at most, as the sync layer counts it.
pub fn set_capacity() -> Capacity {
    Capacity::new(
        ADDR_SET_SIZE as usize,
        MAPPING_SET_SIZE as usize,
        usize::MAX,
        usize::MAX,
    )
}

/// The flags `read_sets` compares (the kernel may report others).
pub const SET_FLAGS: u32 = NFT_SET_MAP | NFT_SET_INTERVAL | NFT_SET_CONCAT;

pub(super) fn concat(types: &[u32]) -> u32 {
    types.iter().fold(0, |acc, t| (acc << TYPE_BITS) | t)
}

/// A plain, unsized set of `l`'s addresses.
pub(super) fn addr_set(l: &Layout, name: &str, id: u32) -> SetDef {
    SetDef {
        name: name.into(),
        id,
        flags: 0,
        key_type: l.addr_type,
        key_len: l.addr_len,
        data: None,
        fields: Vec::new(),
        size: 0,
    }
}

pub fn sets(l: &Layout) -> Vec<SetDef> {
    let addr_set = |name: &str, id: u32| addr_set(l, name, id);
    let addr_map = |name: &str, id: u32| SetDef {
        flags: NFT_SET_MAP,
        data: Some((l.addr_type, l.addr_len)),
        ..addr_set(name, id)
    };
    let per_mapping = |s: SetDef| SetDef {
        size: MAPPING_SET_SIZE,
        ..s
    };
    let per_address = |s: SetDef| SetDef {
        size: ADDR_SET_SIZE,
        ..s
    };
    vec![
        per_mapping(addr_map(POD_SVC, 1)),
        per_mapping(addr_map(SVC_POD, 2)),
        addr_map(REMOTE, 3),
        addr_set(FILTERED_PODS, 4),
        SetDef {
            key_type: concat(&[l.addr_type, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]),
            key_len: l.addr_len + 4 + 4,
            ..addr_set(ALLOWED_PORTS, 5)
        },
        addr_set(ICMP_ALLOWED_PODS, 6),
        addr_set(UNMAPPED_LBS, 7),
        SetDef {
            flags: NFT_SET_INTERVAL,
            ..addr_set(CLUSTER, 8)
        },
        addr_set(RANGED_LBS, 9),
        SetDef {
            flags: NFT_SET_INTERVAL | NFT_SET_CONCAT,
            key_type: concat(&[l.addr_type, l.addr_type]),
            key_len: 2 * l.addr_len,
            fields: vec![l.addr_len, l.addr_len],
            ..addr_set(SOURCE_RANGES, 10)
        },
        per_address(addr_set(GUARDED, 11)),
        per_address(SetDef {
            key_type: concat(&[l.addr_type, TYPE_IFINDEX]),
            key_len: l.addr_len + 4,
            ..addr_set(GUARD_PATHS, 12)
        }),
    ]
}

pub fn set_id(name: &str) -> u32 {
    sets(&IPV4)
        .iter()
        .find(|s| s.name == name)
        .map_or(0, |s| s.id)
}

pub struct RuleDef {
    /// Shown by `nft list` as the rule's comment.
    pub comment: &'static str,
    pub exprs: Vec<Expr>,
}

impl RuleDef {
    /// What the rule holds, as a number stored with it (in its userdata)
    /// and compared when the table is read back: a rule someone replaced
    /// is told apart from ours even when the chain keeps its length.
    pub fn fingerprint(&self) -> u64 {
        let text = format!("{:?}", self.exprs);
        crate::fingerprint::fnv1a([text.as_bytes()])
    }
}

pub struct ChainDef {
    pub name: &'static str,
    /// "filter" or "nat".
    pub kind: &'static str,
    pub hook: u32,
    pub priority: i32,
    pub rules: Vec<RuleDef>,
}

/// The registers rules use: the first address (or key) at `A`, a second
/// address after it at `b(l)`, a scratch register after that at `c(l)`.
pub(super) const A: u32 = NFT_REG32_00;

fn b(l: &Layout) -> u32 {
    A + l.addr_regs()
}

fn c(l: &Layout) -> u32 {
    b(l) + l.addr_regs()
}

pub(super) fn load(base: u32, offset: u32, len: u32, dreg: u32) -> Expr {
    Expr::Load {
        base,
        offset,
        len,
        dreg,
    }
}

fn load_addr(l: &Layout, offset: u32, dreg: u32) -> Expr {
    load(NFT_PAYLOAD_NETWORK_HEADER, offset, l.addr_len, dreg)
}

pub(super) fn lookup(set: &'static str, sreg: u32, invert: bool) -> Expr {
    Expr::Lookup {
        set,
        set_id: set_id(set),
        sreg,
        dreg: None,
        invert,
    }
}

/// Looks `sreg` up in map `map`; the value lands in `dreg` (no entry:
/// the rule stops there).
fn map(map: &'static str, sreg: u32, dreg: u32) -> Expr {
    Expr::Lookup {
        set: map,
        set_id: set_id(map),
        sreg,
        dreg: Some(dreg),
        invert: false,
    }
}

pub(super) fn cmp(sreg: u32, op: u32, data: Vec<u8>) -> Expr {
    Expr::Cmp { sreg, op, data }
}

pub(super) fn l4proto_is(proto: u8) -> [Expr; 2] {
    [
        Expr::Meta {
            key: NFT_META_L4PROTO,
            dreg: A,
        },
        cmp(A, NFT_CMP_EQ, vec![proto]),
    ]
}

/// Writes the address in `sreg` at `offset` of the network header, fixing
/// the IPv4 header checksum and the L4 checksum over the pseudo-header.
fn store_addr(l: &Layout, offset: u32, sreg: u32) -> Expr {
    Expr::Store {
        base: NFT_PAYLOAD_NETWORK_HEADER,
        offset,
        len: l.addr_len,
        sreg,
        csum_type: if l.ip_csum_offset.is_some() {
            NFT_PAYLOAD_CSUM_INET
        } else {
            NFT_PAYLOAD_CSUM_NONE
        },
        csum_offset: l.ip_csum_offset.unwrap_or(0),
        l4_pseudo: true,
    }
}

/// Writes the address in `sreg` into an ICMP error's quoted header. The
/// quoted IPv4 header's own checksum is fixed, which leaves the ICMP
/// checksum valid (the two changes cancel); IPv6 has no header checksum,
/// so the ICMPv6 checksum is fixed instead.
fn store_inner_addr(l: &Layout, source: bool, sreg: u32) -> Expr {
    Expr::Store {
        base: NFT_PAYLOAD_TRANSPORT_HEADER,
        offset: l.inner_addr(source),
        len: l.addr_len,
        sreg,
        csum_type: NFT_PAYLOAD_CSUM_INET,
        csum_offset: match l.ip_csum_offset {
            Some(ip_csum) => ICMP_HDR + ip_csum,
            None => ICMP_CSUM,
        },
        l4_pseudo: false,
    }
}

/// `daddr != @cluster fib daddr type unicast`: a destination outside the
/// cluster, routed on (not local, broadcast or multicast: neighbour
/// discovery and the node's own services see the pod as itself).
fn leaves_the_cluster(l: &Layout) -> [Expr; 4] {
    [
        load_addr(l, l.daddr_offset, b(l)),
        lookup(CLUSTER, b(l), true),
        Expr::FibDaddrType { dreg: c(l) },
        cmp(c(l), NFT_CMP_EQ, RTN_UNICAST.to_ne_bytes().to_vec()),
    ]
}

/// `saddr != @cluster`: a client outside the cluster (or another LB IP).
fn from_outside(l: &Layout) -> [Expr; 2] {
    [
        load_addr(l, l.saddr_offset, b(l)),
        lookup(CLUSTER, b(l), true),
    ]
}

/// Rules rewriting the quoted address of an ICMP error through `via`
/// (one rule per range of error types); `outer` are the conditions the
/// outer rewrite has too.
fn icmp_error_rules(
    l: &Layout,
    comment: &'static str,
    source: bool,
    via: &'static str,
    outer: &[Expr],
) -> Vec<RuleDef> {
    l.icmp_errors
        .iter()
        .map(|(first, last)| {
            let mut exprs = l4proto_is(l.icmp_proto).to_vec();
            exprs.extend([
                load(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1, A),
                cmp(A, NFT_CMP_GTE, vec![*first]),
                cmp(A, NFT_CMP_LTE, vec![*last]),
                load(
                    NFT_PAYLOAD_TRANSPORT_HEADER,
                    l.inner_addr(source),
                    l.addr_len,
                    A,
                ),
                map(via, A, A),
            ]);
            exprs.extend(outer.iter().cloned());
            exprs.push(store_inner_addr(l, source, A));
            RuleDef { comment, exprs }
        })
        .collect()
}

/// The rules that let neighbour discovery to a link-scoped destination
/// (link-local, link-local multicast) pass before a guard, each after
/// `first` (what the family's chain checks before it reads an IP header):
/// link-local control, as ARP is, which a VM whose interface has just
/// moved needs before this node's route to it follows (a drop held it a
/// second). Never forwarded, so a forged source goes no further than the
/// link. None for IPv4 (ARP is no IP packet).
pub(super) fn neighbour_discovery(l: &Layout, first: &[Expr]) -> Vec<RuleDef> {
    let Some((low, high)) = l.neighbour_discovery else {
        return Vec::new();
    };
    [
        (
            [0xff, 0xc0],
            [0xfe, 0x80],
            "neighbour discovery to a link-local address: not guarded",
        ),
        (
            [0xff, 0xff],
            [0xff, 0x02],
            "neighbour discovery to link-local multicast: not guarded",
        ),
    ]
    .into_iter()
    .map(|(mask, prefix, comment)| {
        let mut exprs = first.to_vec();
        exprs.extend(l4proto_is(l.icmp_proto));
        exprs.extend([
            load(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1, A),
            cmp(A, NFT_CMP_GTE, vec![low]),
            cmp(A, NFT_CMP_LTE, vec![high]),
            load(NFT_PAYLOAD_NETWORK_HEADER, l.daddr_offset, 2, A),
            Expr::Bitwise {
                reg: A,
                mask: mask.to_vec(),
                xor: vec![0; 2],
            },
            cmp(A, NFT_CMP_EQ, prefix.to_vec()),
            Expr::Verdict(NF_ACCEPT),
        ]);
        RuleDef { comment, exprs }
    })
    .collect()
}

fn egress_snat(l: &Layout) -> ChainDef {
    // The ICMP errors first (a protocol compare is all they cost other
    // packets): an error about a pod's flow may come from a router, not
    // only from a guarded source.
    let mut rules = icmp_error_rules(
        l,
        "ICMP error from a pod: quoted pod -> LoadBalancer IP",
        false,
        POD_SVC,
        &leaves_the_cluster(l),
    );
    // Everything below is about guarded sources (`pod_svc`'s pods are
    // guarded): any other packet leaves after one lookup.
    rules.push(RuleDef {
        comment: "not a guarded source",
        exprs: vec![
            load_addr(l, l.saddr_offset, A),
            lookup(GUARDED, A, true),
            Expr::Verdict(NF_ACCEPT),
        ],
    });
    rules.extend(neighbour_discovery(l, &[]));
    rules.push(RuleDef {
        comment: "anti-spoofing: a guarded source only from its own path",
        exprs: vec![
            load_addr(l, l.saddr_offset, A),
            Expr::Meta {
                key: NFT_META_IIF,
                dreg: b(l),
            },
            lookup(GUARD_PATHS, A, true),
            Expr::Counter,
            Expr::Verdict(NF_DROP),
        ],
    });
    let mut snat = vec![load_addr(l, l.saddr_offset, A), map(POD_SVC, A, A)];
    snat.extend(leaves_the_cluster(l));
    snat.extend([store_addr(l, l.saddr_offset, A), Expr::Counter]);
    rules.push(RuleDef {
        comment: "pod source -> LoadBalancer IP, leaving the cluster",
        exprs: snat,
    });
    ChainDef {
        name: "egress_snat",
        kind: "filter",
        hook: NF_INET_PRE_ROUTING,
        // Before conntrack (-200): the tracked tuple already carries the
        // LB IP, so replies match it and the flow has one entry.
        priority: PRIO_RAW,
        rules,
    }
}

fn ingress_dnat(l: &Layout) -> ChainDef {
    let mut rules = icmp_error_rules(
        l,
        "ICMP error about a pod's flow: quoted LoadBalancer IP -> pod",
        true,
        SVC_POD,
        &from_outside(l),
    );
    let mut dnat = vec![load_addr(l, l.daddr_offset, A), map(SVC_POD, A, A)];
    dnat.extend(from_outside(l));
    // Accepted at once (this chain only; the later hooks still see it):
    // the two drops below are for LB IPs left as they were, and this one
    // now carries the pod. Two lookups fewer per packet to an LB IP.
    dnat.extend([
        store_addr(l, l.daddr_offset, A),
        Expr::Counter,
        Expr::Verdict(NF_ACCEPT),
    ]);
    rules.push(RuleDef {
        comment: "LoadBalancer IP -> pod, from outside the cluster",
        exprs: dnat,
    });
    // Fails closed: the rewrite above gives up on a packet it cannot fix
    // the checksum of (a transport header cut short); it must not go on
    // toward the pod addressed to the LB IP.
    let mut untranslated = vec![load_addr(l, l.daddr_offset, A), lookup(SVC_POD, A, false)];
    untranslated.extend(from_outside(l));
    untranslated.extend([Expr::Counter, Expr::Verdict(NF_DROP)]);
    rules.push(RuleDef {
        comment: "LoadBalancer IP left untranslated (unreadable header): drop",
        exprs: untranslated,
    });
    rules.push(RuleDef {
        comment: "unmapped LoadBalancer IP: drop, never route back out",
        exprs: vec![
            load_addr(l, l.daddr_offset, A),
            lookup(UNMAPPED_LBS, A, false),
            Expr::Counter,
            Expr::Verdict(NF_DROP),
        ],
    });
    ChainDef {
        name: "ingress_dnat",
        kind: "filter",
        hook: NF_INET_PRE_ROUTING,
        // After conntrack: replies to pod-initiated flows match the entry
        // recorded with the LB IP as source.
        priority: PRIO_MANGLE,
        rules,
    }
}

/// `dnat to daddr map @map` for the in-cluster clients (`from_cluster`) or
/// all (the node's own sockets).
fn client_dnat(
    l: &Layout,
    from_cluster: bool,
    via: &'static str,
    comment: &'static str,
) -> RuleDef {
    let mut exprs = Vec::new();
    if from_cluster {
        exprs.extend([
            load_addr(l, l.saddr_offset, b(l)),
            lookup(CLUSTER, b(l), false),
        ]);
    }
    exprs.extend([
        load_addr(l, l.daddr_offset, A),
        map(via, A, A),
        Expr::Dnat {
            family: l.nfproto,
            reg: A,
        },
    ]);
    RuleDef { comment, exprs }
}

fn port_filter(l: &Layout) -> ChainDef {
    ChainDef {
        name: "port_filter",
        kind: "filter",
        hook: NF_INET_PRE_ROUTING,
        priority: PRIO_FILTER,
        rules: vec![
            RuleDef {
                comment: "replies and related traffic of known flows",
                exprs: [
                    bits_set(
                        Expr::Ct {
                            key: NFT_CT_STATE,
                            dreg: A,
                            original: false,
                        },
                        CT_STATE_ESTABLISHED | CT_STATE_RELATED,
                    )
                    .as_slice(),
                    &[Expr::Verdict(NF_ACCEPT)],
                ]
                .concat(),
            },
            RuleDef {
                comment: "loadBalancerSourceRanges: other sources through the LB IP",
                exprs: vec![
                    Expr::Ct {
                        key: l.ct_daddr,
                        dreg: A,
                        original: true,
                    },
                    lookup(RANGED_LBS, A, false),
                    load_addr(l, l.saddr_offset, b(l)),
                    lookup(SOURCE_RANGES, A, true),
                    Expr::Counter,
                    Expr::Verdict(NF_DROP),
                ],
            },
            // Every rule below concerns filtered pods alone: anything else
            // leaves here after one lookup (it would be accepted anyway).
            RuleDef {
                comment: "not a filtered pod",
                exprs: vec![
                    load_addr(l, l.daddr_offset, A),
                    lookup(FILTERED_PODS, A, true),
                    Expr::Verdict(NF_ACCEPT),
                ],
            },
            RuleDef {
                comment: "ICMP to pods with allowICMP",
                exprs: vec![
                    // The protocol first: no lookup for TCP and UDP.
                    Expr::Meta {
                        key: NFT_META_L4PROTO,
                        dreg: A,
                    },
                    cmp(A, NFT_CMP_EQ, vec![l.icmp_proto]),
                    load_addr(l, l.daddr_offset, A),
                    lookup(ICMP_ALLOWED_PODS, A, false),
                    Expr::Verdict(NF_ACCEPT),
                ],
            },
            RuleDef {
                comment: "filtered pod: listed protocol and port",
                exprs: vec![
                    load_addr(l, l.daddr_offset, A),
                    Expr::Meta {
                        key: NFT_META_L4PROTO,
                        dreg: b(l),
                    },
                    load(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, b(l) + 1),
                    lookup(ALLOWED_PORTS, A, false),
                    Expr::Verdict(NF_ACCEPT),
                ],
            },
            // Fails closed: whatever the rules above could not read (a port
            // past the end, a later fragment) ends here. Only filtered pods
            // get this far, but the lookup stays: a rule reordered by hand
            // must not drop everyone else's traffic.
            RuleDef {
                comment: "filtered pod: everything else",
                exprs: vec![
                    load_addr(l, l.daddr_offset, A),
                    lookup(FILTERED_PODS, A, false),
                    Expr::Counter,
                    Expr::Verdict(NF_DROP),
                ],
            },
        ],
    }
}

/// `load` (into `A`), then: any of the bits of `mask` set.
fn bits_set(load: Expr, mask: u32) -> [Expr; 3] {
    [
        load,
        Expr::Bitwise {
            reg: A,
            mask: mask.to_ne_bytes().to_vec(),
            xor: vec![0; 4],
        },
        cmp(A, NFT_CMP_NEQ, vec![0; 4]),
    ]
}

/// Marks an in-cluster client's flow this node translated toward a pod
/// (`via`) that leaves by the interface it came in on, unless that is a
/// bridge: the pod's reply would reach the client
/// directly, past this node, from the pod IP (Kube-OVN: both behind
/// `ovn0`). A bridge with br_netfilter shows this node both directions.
fn hairpin_mark(l: &Layout, via: &'static str, comment: &'static str) -> RuleDef {
    let mut bridge = b"bridge".to_vec();
    bridge.resize(16, 0);
    RuleDef {
        comment,
        exprs: [
            bits_set(
                Expr::Ct {
                    key: NFT_CT_STATUS,
                    dreg: A,
                    original: false,
                },
                IPS_DST_NAT,
            )
            .as_slice(),
            &[
                Expr::Ct {
                    key: l.ct_daddr,
                    dreg: b(l),
                    original: true,
                },
                lookup(via, b(l), false),
                Expr::Meta {
                    key: NFT_META_OIFKIND,
                    dreg: A,
                },
                cmp(A, NFT_CMP_NEQ, bridge),
                // Forwarded, the destination is the pod already.
                Expr::FibDaddrIif { dreg: A },
                cmp(A, NFT_CMP_NEQ, vec![0; 4]),
                Expr::Meta {
                    key: NFT_META_MARK,
                    dreg: A,
                },
                Expr::Bitwise {
                    reg: A,
                    mask: (!HAIRPIN_MARK).to_ne_bytes().to_vec(),
                    xor: HAIRPIN_MARK.to_ne_bytes().to_vec(),
                },
                Expr::MetaSet {
                    key: NFT_META_MARK,
                    sreg: A,
                },
            ],
        ]
        .concat(),
    }
}

/// The in-cluster clients' hairpins: marked where the route can be asked
/// (forward), masqueraded at source NAT, so that the
/// pod's reply comes back through this node, which translates it back.
fn hairpin(l: &Layout) -> [ChainDef; 2] {
    [
        ChainDef {
            name: "hairpin_mark",
            kind: "filter",
            hook: NF_INET_FORWARD,
            priority: PRIO_FILTER,
            rules: vec![
                hairpin_mark(
                    l,
                    SVC_POD,
                    "in-cluster client -> LoadBalancer IP here, back out its own link",
                ),
                hairpin_mark(
                    l,
                    REMOTE,
                    "in-cluster client -> LoadBalancer IP elsewhere, back out its own link",
                ),
            ],
        },
        hairpin_masq(),
    ]
}

/// Masquerades what carries [`HAIRPIN_MARK`] (the nft backend's forward
/// chain or the eBPF programs set it): the pod's reply to an in-cluster
/// client's hairpin comes back through this node, which translates it.
/// Of no family's layout: the eBPF backend's `inet` table holds it too
/// (`hairpin.rs`).
pub fn hairpin_masq() -> ChainDef {
    ChainDef {
        name: "hairpin_masq",
        kind: "nat",
        hook: NF_INET_POST_ROUTING,
        priority: PRIO_SRCNAT,
        rules: vec![RuleDef {
            comment: "hairpin: the reply comes back through this node",
            exprs: [
                bits_set(
                    Expr::Meta {
                        key: NFT_META_MARK,
                        dreg: A,
                    },
                    HAIRPIN_MARK,
                )
                .as_slice(),
                &[Expr::Masquerade],
            ]
            .concat(),
        }],
    }
}

/// The ICMP errors this node sends itself (time exceeded, too big for the
/// pod's link) about a packet it forwards toward a pod, translated to the
/// pod at `ingress_dnat`: they quote the LB IP the client sent to, as the
/// pod's own errors do, so that the client's kernel applies them to its
/// flow (path MTU) and no client learns which pod holds an LB IP. Before
/// conntrack, whose entry holds the LB IP: the error is then related.
fn node_errors(l: &Layout) -> ChainDef {
    ChainDef {
        name: "node_errors",
        kind: "filter",
        hook: NF_INET_LOCAL_OUT,
        priority: PRIO_RAW,
        rules: icmp_error_rules(
            l,
            "ICMP error from this node: quoted pod -> LoadBalancer IP",
            false,
            POD_SVC,
            &leaves_the_cluster(l),
        ),
    }
}

pub fn chains(l: &Layout) -> Vec<ChainDef> {
    let [mark, masq] = hairpin(l);
    vec![
        egress_snat(l),
        ingress_dnat(l),
        node_errors(l),
        ChainDef {
            name: "cluster_dnat",
            kind: "nat",
            hook: NF_INET_PRE_ROUTING,
            priority: PRIO_DSTNAT,
            rules: vec![
                client_dnat(
                    l,
                    true,
                    SVC_POD,
                    "in-cluster client -> LoadBalancer IP here: its pod",
                ),
                client_dnat(
                    l,
                    true,
                    REMOTE,
                    "in-cluster client -> LoadBalancer IP elsewhere: its pod",
                ),
            ],
        },
        ChainDef {
            name: "local_dnat",
            kind: "nat",
            hook: NF_INET_LOCAL_OUT,
            priority: PRIO_DSTNAT,
            rules: vec![
                client_dnat(
                    l,
                    false,
                    SVC_POD,
                    "this node -> LoadBalancer IP here: its pod",
                ),
                client_dnat(
                    l,
                    false,
                    REMOTE,
                    "this node -> LoadBalancer IP elsewhere: its pod",
                ),
            ],
        },
        port_filter(l),
        mark,
        masq,
    ]
}
