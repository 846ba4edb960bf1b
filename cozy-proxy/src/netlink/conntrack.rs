//! The kernel's connection tracking table, as ctnetlink dumps it
//! (IPCTNL_MSG_CT_GET): what the eBPF datapath reads when it takes a node
//! over from nftables, whose port filter remembers the flows filtered pods
//! start in conntrack (see `ebpf::flow_seed`). Layouts from
//! <linux/netfilter/nfnetlink_conntrack.h> and
//! <linux/netfilter/nf_conntrack_common.h>.
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, attrs, Writer, NLM_F_DUMP};
use std::net::IpAddr;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
/// nfgenmsg: family (AF_UNSPEC: both), version 0, resource id 0.
const NFGENMSG_LEN: usize = 4;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTO_ICMP_ID: u16 = 4;
const CTA_PROTO_ICMP_TYPE: u16 = 5;
const CTA_PROTO_ICMPV6_ID: u16 = 7;
const CTA_PROTO_ICMPV6_TYPE: u16 = 8;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
/// IPS_SEEN_REPLY: a packet of the reply direction has been seen.
const IPS_SEEN_REPLY: u32 = 1 << 1;

/// conntrack's TCP states (`enum tcp_conntrack`).
pub mod tcp_state {
    pub const SYN_SENT: u8 = 1;
    pub const SYN_RECV: u8 = 2;
    pub const ESTABLISHED: u8 = 3;
    pub const SYN_SENT2: u8 = 9;
}

/// What identifies a tracked flow beside its addresses and protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ends {
    /// TCP, UDP, SCTP, ...: source and destination port.
    Ports(u16, u16),
    /// ICMP or ICMPv6: the original direction's type and identifier.
    Icmp { icmp_type: u8, id: u16 },
}

/// One conntrack entry, in its original direction (as its first packet
/// went).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracked {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub ends: Ends,
    /// TCP only: the state conntrack keeps (see [`tcp_state`]).
    pub tcp_state: Option<u8>,
    /// A packet of the reply direction has been seen.
    pub seen_reply: bool,
}

/// Every entry of this network namespace's table, both families, that
/// `keep` accepts (the table is read as it arrives, never held whole).
pub fn tracked(
    sock: &NlSocket,
    mut keep: impl FnMut(&Tracked) -> bool,
) -> Result<Vec<Tracked>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let msg_type = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET;
    w.message(msg_type, NLM_F_DUMP, seq, &[0u8; NFGENMSG_LEN], |_| {});
    let mut out = Vec::new();
    // An interrupted dump is not made again: it still lists every entry
    // that lived through it, and the kept ones are inserted only if absent.
    sock.dump_each(&w.into_bytes(), seq, "conntrack dump", |payload| {
        if let Some(t) = parse(payload).filter(|t| keep(t)) {
            out.push(t);
        }
    })?;
    Ok(out)
}

/// One entry (a dump answer's payload), or `None` if it names no flow
/// this reader knows (a protocol without ports or ICMP, say).
fn parse(payload: &[u8]) -> Option<Tracked> {
    let body = payload.get(NFGENMSG_LEN..)?;
    let orig = attr(body, CTA_TUPLE_ORIG)?;
    let (src, dst) = addresses(attr(orig, CTA_TUPLE_IP)?)?;
    let proto_attrs = attr(orig, CTA_TUPLE_PROTO)?;
    let proto = *attr(proto_attrs, CTA_PROTO_NUM)?.first()?;
    let be16 = |t| attr(proto_attrs, t).and_then(|d| <[u8; 2]>::try_from(d).ok());
    let ends = match (be16(CTA_PROTO_SRC_PORT), be16(CTA_PROTO_DST_PORT)) {
        (Some(s), Some(d)) => Ends::Ports(u16::from_be_bytes(s), u16::from_be_bytes(d)),
        _ => {
            let (id_attr, type_attr) = match proto {
                1 => (CTA_PROTO_ICMP_ID, CTA_PROTO_ICMP_TYPE),
                58 => (CTA_PROTO_ICMPV6_ID, CTA_PROTO_ICMPV6_TYPE),
                _ => return None,
            };
            Ends::Icmp {
                icmp_type: *attr(proto_attrs, type_attr)?.first()?,
                id: u16::from_be_bytes(be16(id_attr)?),
            }
        }
    };
    let status = attr(body, CTA_STATUS)
        .and_then(|d| <[u8; 4]>::try_from(d).ok())
        .map_or(0, u32::from_be_bytes);
    let tcp_state = (attr(body, CTA_PROTOINFO))
        .and_then(|p| attr(p, CTA_PROTOINFO_TCP))
        .and_then(|t| attr(t, CTA_PROTOINFO_TCP_STATE))
        .and_then(|s| s.first().copied());
    Some(Tracked {
        proto,
        src,
        dst,
        ends,
        tcp_state,
        seen_reply: status & IPS_SEEN_REPLY != 0,
    })
}

/// The source and destination of a `CTA_TUPLE_IP` nest.
fn addresses(ip: &[u8]) -> Option<(IpAddr, IpAddr)> {
    let (mut src, mut dst) = (None, None);
    for (t, d) in attrs(ip) {
        let addr = match d.len() {
            4 => IpAddr::from(<[u8; 4]>::try_from(d).ok()?),
            16 => IpAddr::from(<[u8; 16]>::try_from(d).ok()?),
            _ => continue,
        };
        match t {
            CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = Some(addr),
            CTA_IP_V4_DST | CTA_IP_V6_DST => dst = Some(addr),
            _ => {}
        }
    }
    Some((src?, dst?))
}

#[cfg(test)]
mod tests {
    use super::super::wire::messages;
    use super::*;

    /// An entry as the kernel writes it (ctnetlink_fill_info's order).
    fn entry(
        (src, dst): (IpAddr, IpAddr),
        proto: u8,
        ends: Ends,
        status: u32,
        tcp: Option<u8>,
    ) -> Vec<u8> {
        let mut w = Writer::new();
        w.message(0x100, 0, 1, &[2, 0, 0, 0], |w| {
            w.nest(CTA_TUPLE_ORIG, |w| {
                w.nest(CTA_TUPLE_IP, |w| {
                    let (s, d) = match src {
                        IpAddr::V4(_) => (CTA_IP_V4_SRC, CTA_IP_V4_DST),
                        IpAddr::V6(_) => (CTA_IP_V6_SRC, CTA_IP_V6_DST),
                    };
                    w.put(s, &super::super::wire::ip_bytes(&src));
                    w.put(d, &super::super::wire::ip_bytes(&dst));
                });
                w.nest(CTA_TUPLE_PROTO, |w| {
                    w.put(CTA_PROTO_NUM, &[proto]);
                    match ends {
                        Ends::Ports(s, d) => {
                            w.put(CTA_PROTO_SRC_PORT, &s.to_be_bytes());
                            w.put(CTA_PROTO_DST_PORT, &d.to_be_bytes());
                        }
                        Ends::Icmp { icmp_type, id } => {
                            w.put(CTA_PROTO_ICMP_ID, &id.to_be_bytes());
                            w.put(CTA_PROTO_ICMP_TYPE, &[icmp_type]);
                            w.put(6, &[0]);
                        }
                    }
                });
            });
            w.put_u32(CTA_STATUS, status);
            if let Some(state) = tcp {
                w.nest(CTA_PROTOINFO, |w| {
                    w.nest(CTA_PROTOINFO_TCP, |w| {
                        w.put(CTA_PROTOINFO_TCP_STATE, &[state])
                    });
                });
            }
        });
        let bytes = w.into_bytes();
        let payload = messages(&bytes)
            .next()
            .expect("one message")
            .payload
            .to_vec();
        payload
    }

    #[test]
    fn entries_are_read_in_their_original_direction() {
        let (pod, peer): (IpAddr, IpAddr) = (
            "192.0.2.10".parse().unwrap(),
            "198.51.100.1".parse().unwrap(),
        );
        let tcp = entry(
            (pod, peer),
            6,
            Ends::Ports(40000, 443),
            0x0e,
            Some(tcp_state::ESTABLISHED),
        );
        assert_eq!(
            parse(&tcp),
            Some(Tracked {
                proto: 6,
                src: pod,
                dst: peer,
                ends: Ends::Ports(40000, 443),
                tcp_state: Some(tcp_state::ESTABLISHED),
                seen_reply: true,
            })
        );
        let (p6, q6): (IpAddr, IpAddr) = (
            "2001:db8::10".parse().unwrap(),
            "2001:db8:1::1".parse().unwrap(),
        );
        let udp = entry((p6, q6), 17, Ends::Ports(5353, 53), 0x08, None);
        let got = parse(&udp).expect("a UDP entry");
        assert_eq!((got.src, got.dst, got.seen_reply), (p6, q6, false));
        let ping = entry(
            (pod, peer),
            1,
            Ends::Icmp {
                icmp_type: 8,
                id: 7,
            },
            0,
            None,
        );
        assert_eq!(
            parse(&ping).map(|t| t.ends),
            Some(Ends::Icmp {
                icmp_type: 8,
                id: 7
            })
        );
    }

    #[test]
    fn an_entry_without_ports_or_echo_is_not_read() {
        let (a, b): (IpAddr, IpAddr) = (
            "192.0.2.10".parse().unwrap(),
            "198.51.100.1".parse().unwrap(),
        );
        let gre = entry(
            (a, b),
            47,
            Ends::Icmp {
                icmp_type: 0,
                id: 0,
            },
            0,
            None,
        );
        assert_eq!(parse(&gre), None);
        assert_eq!(parse(&[0, 0]), None);
    }
}
