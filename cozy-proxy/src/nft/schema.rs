//! The ruleset of the nft backend: one table per family (`ip cozy_proxy`,
//! `ip6 cozy_proxy`), the same sets, chains and rules in both, as in the
//! original cozy-proxy (see docs/nft-datapath.md).
use super::expr::Expr;
use super::sys::*;
use std::net::IpAddr;

pub const TABLE: &str = "cozy_proxy";

/// Stored as the table's user data. Change it whenever the sets, chains or
/// rules change: a table with another mark is replaced (atomically) at the
/// first sync, one with this mark is adopted as it is.
pub const SCHEMA_MARK: &[u8] = b"cozy-proxy nft schema 1";

pub const POD_SVC: &str = "pod_svc";
pub const SVC_POD: &str = "svc_pod";
pub const FILTERED_PODS: &str = "filtered_pods";
pub const ALLOWED_PORTS: &str = "allowed_ports";
pub const ICMP_ALLOWED_PODS: &str = "icmp_allowed_pods";
pub const UNMAPPED_LBS: &str = "unmapped_lbs";

pub const PRIO_RAW: i32 = -300;
pub const PRIO_MANGLE: i32 = -150;
pub const PRIO_FILTER: i32 = 0;

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
};

pub const LAYOUTS: [Layout; 2] = [IPV4, IPV6];

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

    /// Key of `allowed_ports`: address . protocol . port, each component
    /// padded to 4 bytes (nf_tables registers are 32 bits wide).
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
}

/// A set or map, as created and as read back for comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetDef {
    pub name: String,
    pub id: u32,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// `(type, len)` of map values.
    pub data: Option<(u32, u32)>,
}

pub fn sets(l: &Layout) -> Vec<SetDef> {
    let addr_set = |name: &str, id: u32| SetDef {
        name: name.into(),
        id,
        flags: 0,
        key_type: l.addr_type,
        key_len: l.addr_len,
        data: None,
    };
    let addr_map = |name: &str, id: u32| SetDef {
        flags: NFT_SET_MAP,
        data: Some((l.addr_type, l.addr_len)),
        ..addr_set(name, id)
    };
    vec![
        addr_map(POD_SVC, 1),
        addr_map(SVC_POD, 2),
        addr_set(FILTERED_PODS, 3),
        SetDef {
            name: ALLOWED_PORTS.into(),
            id: 4,
            flags: 0,
            key_type: (((l.addr_type << TYPE_BITS) | TYPE_INET_PROTOCOL) << TYPE_BITS)
                | TYPE_INET_SERVICE,
            key_len: l.addr_len + 4 + 4,
            data: None,
        },
        addr_set(ICMP_ALLOWED_PODS, 5),
        addr_set(UNMAPPED_LBS, 6),
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

pub struct ChainDef {
    pub name: &'static str,
    pub priority: i32,
    pub rules: Vec<RuleDef>,
}

const REG: u32 = NFT_REG32_00;

fn load_addr(l: &Layout, offset: u32, dreg: u32) -> Expr {
    Expr::Load {
        base: NFT_PAYLOAD_NETWORK_HEADER,
        offset,
        len: l.addr_len,
        dreg,
    }
}

fn lookup(set: &'static str, sreg: u32) -> Expr {
    Expr::Lookup {
        set,
        set_id: set_id(set),
        sreg,
        dreg: None,
        invert: false,
    }
}

/// `ip saddr set ip saddr map @map` (or daddr): rewrite through a map,
/// fixing the IPv4 header checksum and the L4 checksum (pseudo-header).
fn rewrite(l: &Layout, offset: u32, map: &'static str) -> Vec<Expr> {
    vec![
        load_addr(l, offset, REG),
        Expr::Lookup {
            set: map,
            set_id: set_id(map),
            sreg: REG,
            dreg: Some(REG),
            invert: false,
        },
        Expr::Store {
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            len: l.addr_len,
            sreg: REG,
            csum_type: if l.ip_csum_offset.is_some() {
                NFT_PAYLOAD_CSUM_INET
            } else {
                NFT_PAYLOAD_CSUM_NONE
            },
            csum_offset: l.ip_csum_offset.unwrap_or(0),
            l4_pseudo: true,
        },
        Expr::Counter,
    ]
}

/// ICMPv6 neighbour discovery (types 133-137: router and neighbour
/// solicitation and advertisement, redirect) is link-local plumbing between
/// a host and its neighbours: translating it breaks address resolution
/// (a pod's solicitation would carry the LB IP; a router's unicast probe of
/// the LB IP would be sent to the pod).
fn ndp_exempt(l: &Layout) -> Option<RuleDef> {
    (l.nfproto == NFPROTO_IPV6).then(|| RuleDef {
        comment: "neighbour discovery is never translated",
        exprs: vec![
            Expr::Meta {
                key: NFT_META_L4PROTO,
                dreg: REG,
            },
            Expr::Cmp {
                sreg: REG,
                op: NFT_CMP_EQ,
                data: vec![l.icmp_proto],
            },
            Expr::Load {
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                offset: 0,
                len: 1,
                dreg: REG,
            },
            Expr::Cmp {
                sreg: REG,
                op: NFT_CMP_GTE,
                data: vec![133],
            },
            Expr::Cmp {
                sreg: REG,
                op: NFT_CMP_LTE,
                data: vec![137],
            },
            Expr::Verdict(NF_ACCEPT),
        ],
    })
}

pub fn chains(l: &Layout) -> Vec<ChainDef> {
    let l4proto = |dreg| Expr::Meta {
        key: NFT_META_L4PROTO,
        dreg,
    };
    // Registers of the concatenated key address . protocol . port.
    let proto_reg = REG + l.addr_len / 4;
    let port_reg = proto_reg + 1;
    vec![
        ChainDef {
            name: "egress_snat",
            // Before conntrack (-200): the tracked tuple already carries the
            // LB IP, so replies match it and the flow has one entry.
            priority: PRIO_RAW,
            rules: ndp_exempt(l)
                .into_iter()
                .chain([RuleDef {
                    comment: "pod source -> LoadBalancer IP",
                    exprs: rewrite(l, l.saddr_offset, POD_SVC),
                }])
                .collect(),
        },
        ChainDef {
            name: "ingress_dnat",
            // After conntrack: replies to pod-initiated flows match the entry
            // recorded with the LB IP as source.
            priority: PRIO_MANGLE,
            rules: ndp_exempt(l)
                .into_iter()
                .chain([
                    RuleDef {
                        comment: "LoadBalancer IP -> pod",
                        exprs: rewrite(l, l.daddr_offset, SVC_POD),
                    },
                    RuleDef {
                        comment: "unmapped LoadBalancer IP: drop, never route back out",
                        exprs: vec![
                            load_addr(l, l.daddr_offset, REG),
                            lookup(UNMAPPED_LBS, REG),
                            Expr::Counter,
                            Expr::Verdict(NF_DROP),
                        ],
                    },
                ])
                .collect(),
        },
        ChainDef {
            name: "port_filter",
            priority: PRIO_FILTER,
            rules: vec![
                RuleDef {
                    comment: "replies and related traffic of known flows",
                    exprs: vec![
                        Expr::Ct {
                            key: NFT_CT_STATE,
                            dreg: REG,
                        },
                        Expr::Bitwise {
                            reg: REG,
                            mask: (CT_STATE_ESTABLISHED | CT_STATE_RELATED)
                                .to_ne_bytes()
                                .to_vec(),
                            xor: vec![0; 4],
                        },
                        Expr::Cmp {
                            sreg: REG,
                            op: NFT_CMP_NEQ,
                            data: vec![0; 4],
                        },
                        Expr::Verdict(NF_ACCEPT),
                    ],
                },
                RuleDef {
                    comment: "ICMP to pods with allowICMP",
                    exprs: vec![
                        load_addr(l, l.daddr_offset, REG),
                        lookup(ICMP_ALLOWED_PODS, REG),
                        l4proto(REG),
                        Expr::Cmp {
                            sreg: REG,
                            op: NFT_CMP_EQ,
                            data: vec![l.icmp_proto],
                        },
                        Expr::Verdict(NF_ACCEPT),
                    ],
                },
                RuleDef {
                    comment: "filtered pod: unlisted protocol or port",
                    exprs: vec![
                        load_addr(l, l.daddr_offset, REG),
                        lookup(FILTERED_PODS, REG),
                        l4proto(proto_reg),
                        Expr::Load {
                            base: NFT_PAYLOAD_TRANSPORT_HEADER,
                            offset: 2,
                            len: 2,
                            dreg: port_reg,
                        },
                        Expr::Lookup {
                            set: ALLOWED_PORTS,
                            set_id: set_id(ALLOWED_PORTS),
                            sreg: REG,
                            dreg: None,
                            invert: true,
                        },
                        Expr::Counter,
                        Expr::Verdict(NF_DROP),
                    ],
                },
            ],
        },
    ]
}
