//! rtnetlink: the node's links, and the routes the eBPF datapath owns.
//! Constants come from `libc`; the header sizes and RTNH_F_ONLINK (which
//! it lacks) from <linux/rtnetlink.h> and <linux/if_link.h>.
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, attr_str, ip_bytes as bytes, Writer, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP};
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

const RTM_GETLINK: u16 = libc::RTM_GETLINK;
const RTM_NEWROUTE: u16 = libc::RTM_NEWROUTE;
const RTM_DELROUTE: u16 = libc::RTM_DELROUTE;
const RTM_GETROUTE: u16 = libc::RTM_GETROUTE;
const IFLA_IFNAME: u16 = libc::IFLA_IFNAME;
const RTA_DST: u16 = libc::RTA_DST;
const RTA_GATEWAY: u16 = libc::RTA_GATEWAY;
const RTA_TABLE: u16 = libc::RTA_TABLE;
const RT_TABLE_MAIN: u8 = libc::RT_TABLE_MAIN;
const RTN_UNICAST: u8 = libc::RTN_UNICAST;
const RT_SCOPE_UNIVERSE: u8 = libc::RT_SCOPE_UNIVERSE;
const NLM_F_REPLACE: u16 = libc::NLM_F_REPLACE as u16;
const IFINFOMSG_LEN: usize = 16;
const RTMSG_LEN: usize = 12;
pub const ARPHRD_ETHER: u16 = libc::ARPHRD_ETHER;

/// A network interface of the node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// ARPHRD_* link type.
    pub kind: u16,
}

pub fn links(sock: &NlSocket) -> Result<Vec<Link>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let ifinfo = [0u8; IFINFOMSG_LEN];
    w.message(RTM_GETLINK, NLM_F_DUMP, seq, &ifinfo, |_| {});
    let answers = sock.dump(&w.into_bytes(), seq, "link dump")?;
    let mut out = Vec::new();
    for a in answers.iter().filter(|a| a.len() >= IFINFOMSG_LEN) {
        let kind = u16::from_ne_bytes([a[2], a[3]]);
        let index = i32::from_ne_bytes([a[4], a[5], a[6], a[7]]);
        let Some(name) = attr_str(&a[IFINFOMSG_LEN..], IFLA_IFNAME) else {
            continue;
        };
        if let Ok(index) = u32::try_from(index) {
            out.push(Link { index, name, kind });
        }
    }
    Ok(out)
}

fn family(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn host_prefix(ip: &IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

fn rtmsg(family: u8, dst_len: u8, protocol: u8) -> [u8; RTMSG_LEN] {
    [
        family,
        dst_len,
        0,
        0,
        RT_TABLE_MAIN,
        protocol,
        RT_SCOPE_UNIVERSE,
        RTN_UNICAST,
        0,
        0,
        0,
        0,
    ]
}

fn parse_ip(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => <[u8; 4]>::try_from(b)
            .ok()
            .map(|a| IpAddr::V4(Ipv4Addr::from(a))),
        16 => <[u8; 16]>::try_from(b)
            .ok()
            .map(|a| IpAddr::V6(Ipv6Addr::from(a))),
        _ => None,
    }
}

/// Host routes `dst via gateway` in the main table tagged with `protocol`.
pub fn host_routes(
    sock: &NlSocket,
    protocol: u8,
) -> Result<BTreeSet<(IpAddr, IpAddr)>, NetlinkError> {
    let mut out = BTreeSet::new();
    for fam in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let seq = next_seq();
        let mut w = Writer::new();
        w.message(RTM_GETROUTE, NLM_F_DUMP, seq, &rtmsg(fam, 0, 0), |_| {});
        for a in sock.dump(&w.into_bytes(), seq, "route dump")? {
            if a.len() < RTMSG_LEN || a[5] != protocol {
                continue;
            }
            let body = &a[RTMSG_LEN..];
            let table = attr(body, RTA_TABLE)
                .and_then(|t| <[u8; 4]>::try_from(t).ok())
                .map_or(a[4] as u32, u32::from_ne_bytes);
            if table != RT_TABLE_MAIN as u32 {
                continue;
            }
            let dst = attr(body, RTA_DST).and_then(parse_ip);
            let gw = attr(body, RTA_GATEWAY).and_then(parse_ip);
            if let (Some(dst), Some(gw)) = (dst, gw) {
                out.insert((dst, gw));
            }
        }
    }
    Ok(out)
}

/// How the kernel reaches an address: gateway (if any), interface, flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NextHop {
    pub gateway: Option<IpAddr>,
    pub oif: u32,
    /// RTNH_F_ONLINK and friends, copied as they are.
    pub flags: u32,
}

const RTA_OIF: u16 = libc::RTA_OIF;
const RTM_F_LOOKUP_TABLE: u32 = libc::RTM_F_LOOKUP_TABLE;
const RTNH_F_ONLINK: u32 = 4;

/// The next hop the kernel would use toward `dst` (a route lookup, as `ip
/// route get`).
pub fn lookup(sock: &NlSocket, dst: &IpAddr) -> Result<NextHop, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let mut header = rtmsg(family(dst), host_prefix(dst), 0);
    header[8..12].copy_from_slice(&RTM_F_LOOKUP_TABLE.to_ne_bytes());
    w.message(RTM_GETROUTE, NLM_F_ACK, seq, &header, |w| {
        w.put(RTA_DST, &bytes(dst))
    });
    let answers = sock.dump(&w.into_bytes(), seq, &format!("route lookup of {dst}"))?;
    let a = answers
        .iter()
        .find(|a| a.len() >= RTMSG_LEN)
        .ok_or(NetlinkError::MissingAcks(1))?;
    let body = &a[RTMSG_LEN..];
    Ok(NextHop {
        gateway: attr(body, RTA_GATEWAY).and_then(parse_ip),
        oif: attr(body, RTA_OIF)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_ne_bytes),
        flags: u32::from_ne_bytes([a[8], a[9], a[10], a[11]]) & RTNH_F_ONLINK,
    })
}

/// Host routes in the main table tagged with `protocol`: their destinations.
pub fn tagged_destinations(
    sock: &NlSocket,
    protocol: u8,
) -> Result<BTreeSet<IpAddr>, NetlinkError> {
    Ok(host_routes(sock, protocol)?
        .into_iter()
        .map(|(dst, _)| dst)
        .collect())
}

/// Deletes the tagged host routes to `dst`.
pub fn delete_host_routes(
    sock: &NlSocket,
    protocol: u8,
    dsts: &[IpAddr],
) -> Result<(), NetlinkError> {
    let mut w = Writer::new();
    let mut pending = Vec::new();
    for dst in dsts {
        let seq = next_seq();
        w.message(
            RTM_DELROUTE,
            NLM_F_ACK,
            seq,
            &rtmsg(family(dst), host_prefix(dst), protocol),
            |w| {
                w.put(RTA_DST, &bytes(dst));
            },
        );
        pending.push((seq, format!("delete route {dst}")));
    }
    sock.transact(&w.into_bytes(), pending)
}

/// Adds (or replaces) the host route `dst` through `via`.
pub fn set_host_route(
    sock: &NlSocket,
    protocol: u8,
    dst: &IpAddr,
    via: &NextHop,
) -> Result<(), NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let mut header = rtmsg(family(dst), host_prefix(dst), protocol);
    header[8..12].copy_from_slice(&via.flags.to_ne_bytes());
    w.message(
        RTM_NEWROUTE,
        NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK,
        seq,
        &header,
        |w| {
            w.put(RTA_DST, &bytes(dst));
            if let Some(gw) = &via.gateway {
                w.put(RTA_GATEWAY, &bytes(gw));
            }
            if via.oif != 0 {
                w.put_u32_ne(RTA_OIF, via.oif);
            }
        },
    );
    sock.transact(
        &w.into_bytes(),
        vec![(seq, format!("route {dst} via {via:?}"))],
    )
}
