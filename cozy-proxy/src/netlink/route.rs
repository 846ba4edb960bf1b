//! rtnetlink: the node's links, route lookups, and the host routes the
//! datapaths own (tagged with one protocol number).
//! Constants come from `libc`; the header sizes and RTNH_F_ONLINK (which
//! it lacks) from <linux/rtnetlink.h> and <linux/if_link.h>.
use super::socket::{next_seq, Acked, NetlinkError, NlSocket};
use super::wire::{
    attr, attr_str, ip_bytes as bytes, Writer, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

const RTM_GETLINK: u16 = libc::RTM_GETLINK;
const RTM_NEWROUTE: u16 = libc::RTM_NEWROUTE;
const RTM_DELROUTE: u16 = libc::RTM_DELROUTE;
const RTM_GETROUTE: u16 = libc::RTM_GETROUTE;
const IFLA_IFNAME: u16 = libc::IFLA_IFNAME;
const RTA_DST: u16 = libc::RTA_DST;
const RTA_GATEWAY: u16 = libc::RTA_GATEWAY;
const RTA_PREFSRC: u16 = libc::RTA_PREFSRC;
const RTA_TABLE: u16 = libc::RTA_TABLE;
const RTA_MULTIPATH: u16 = libc::RTA_MULTIPATH;
const RT_TABLE_MAIN: u8 = libc::RT_TABLE_MAIN;
const RTN_UNICAST: u8 = libc::RTN_UNICAST;
const RTN_UNREACHABLE: u8 = libc::RTN_UNREACHABLE;
const RTA_OIF: u16 = libc::RTA_OIF;
const RTM_F_LOOKUP_TABLE: u32 = libc::RTM_F_LOOKUP_TABLE;
/// Answer with the matched FIB entry (its own prefix length and next hop),
/// not a resolved host route.
const RTM_F_FIB_MATCH: u32 = libc::RTM_F_FIB_MATCH;
const RTNH_F_ONLINK: u32 = 4;
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
    /// A veth or netkit device whose peer is in another network namespace
    /// (a pod's interface): BPF can hand a packet to that peer directly
    /// (`bpf_redirect_peer`).
    pub peer_elsewhere: bool,
    /// Where that peer is: the node's id of its namespace
    /// (IFLA_LINK_NETNSID) and its index there (IFLA_LINK).
    pub peer_ns: Option<(i32, u32)>,
    /// The device it is enslaved to (IFLA_MASTER): a bridge, a bond, an
    /// Open vSwitch datapath, a VRF.
    pub master: Option<u32>,
    /// Its own kind (IFLA_INFO_KIND: "veth", "bridge", "bond", "vlan",
    /// "vxlan", "openvswitch", ...), empty for a physical device.
    pub info_kind: String,
    /// What its master makes of it (IFLA_INFO_SLAVE_KIND: "bridge",
    /// "bond", "openvswitch", ...), empty when it has none.
    pub slave_kind: String,
    /// The device it is stacked on (IFLA_LINK) when that is in this
    /// namespace: a VLAN's, a macvlan's or an ipvlan's parent. (A veth's
    /// IFLA_LINK is its peer; `None` when the peer is elsewhere.)
    pub lower: Option<u32>,
    /// The XDP program attached to it, if any (IFLA_XDP).
    pub xdp: Option<XdpAttached>,
}

/// An XDP program on an interface, as IFLA_XDP reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct XdpAttached {
    /// XDP_ATTACHED_DRV (1, native), _SKB (2, generic), _HW (3), _MULTI (4).
    pub mode: u8,
    /// The program's id (0 with several attached in different modes).
    pub prog_id: u32,
}

/// IFLA_XDP's nested attributes (<linux/if_link.h>).
const IFLA_XDP_ATTACHED: u16 = 2;
const IFLA_XDP_PROG_ID: u16 = 4;
/// IFLA_XDP_ATTACHED's values.
pub const XDP_ATTACHED_DRV: u8 = 1;
pub const XDP_ATTACHED_SKB: u8 = 2;

/// The XDP program IFLA_XDP names, if one is attached.
fn xdp_attached(body: &[u8]) -> Option<XdpAttached> {
    let xdp = attr(body, libc::IFLA_XDP)?;
    let mode = *attr(xdp, IFLA_XDP_ATTACHED)?.first()?;
    if mode == 0 {
        return None;
    }
    let prog_id = u32_attr(xdp, IFLA_XDP_PROG_ID).unwrap_or(0);
    Some(XdpAttached { mode, prog_id })
}

impl Link {
    /// A port of a Linux bridge.
    pub fn is_bridge_port(&self) -> bool {
        self.master.is_some() && self.slave_kind == "bridge"
    }

    pub fn is_bridge(&self) -> bool {
        self.info_kind == "bridge"
    }
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
        let body = &a[IFINFOMSG_LEN..];
        let info = attr(body, libc::IFLA_LINKINFO);
        let info_str = |t: u16| info.and_then(|i| attr_str(i, t)).unwrap_or_default();
        let info_kind = info_str(libc::IFLA_INFO_KIND);
        let slave_kind = info_str(libc::IFLA_INFO_SLAVE_KIND);
        let pair_kind = info_kind == "veth" || info_kind == "netkit";
        let link_netnsid = attr(body, libc::IFLA_LINK_NETNSID);
        let netnsid = link_netnsid
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(i32::from_ne_bytes);
        let peer_elsewhere = pair_kind && netnsid.is_some();
        let link = u32_attr(body, libc::IFLA_LINK);
        let peer_ns = netnsid.filter(|_| pair_kind).zip(link);
        let master = u32_attr(body, libc::IFLA_MASTER).filter(|m| *m != 0);
        let lower = link.filter(|l| *l != 0 && link_netnsid.is_none());
        if let Ok(index) = u32::try_from(index) {
            out.push(Link {
                index,
                name,
                kind,
                peer_elsewhere,
                peer_ns,
                master,
                info_kind,
                slave_kind,
                lower,
                xdp: xdp_attached(body),
            });
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

fn rtmsg(family: u8, dst_len: u8, protocol: u8, kind: u8) -> [u8; RTMSG_LEN] {
    [
        family,
        dst_len,
        0,
        0,
        RT_TABLE_MAIN,
        protocol,
        RT_SCOPE_UNIVERSE,
        kind,
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

fn u32_attr(body: &[u8], t: u16) -> Option<u32> {
    attr(body, t)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_ne_bytes)
}

/// Where a route sends: through `gateway` (none: on the link) out of
/// `oif`; an `unreachable` route has neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Via {
    pub gateway: Option<IpAddr>,
    pub oif: u32,
    /// RTNH_F_ONLINK: the gateway is on the link without a route to it.
    pub onlink: bool,
    pub unreachable: bool,
    /// The source address the node's own sockets take (a lookup: the one
    /// chosen; a route: its `src`, if it has one).
    pub src: Option<IpAddr>,
}

impl Via {
    fn from_answer(a: &[u8]) -> Via {
        let body = &a[RTMSG_LEN..];
        Via {
            gateway: attr(body, RTA_GATEWAY).and_then(parse_ip),
            oif: u32_attr(body, RTA_OIF).unwrap_or(0),
            onlink: u32::from_ne_bytes([a[8], a[9], a[10], a[11]]) & RTNH_F_ONLINK != 0,
            unreachable: a[7] == RTN_UNREACHABLE,
            src: attr(body, RTA_PREFSRC).and_then(parse_ip),
        }
    }
}

/// Host routes (`/32`, `/128`) in the main table tagged with `protocol`.
pub fn host_routes(sock: &NlSocket, protocol: u8) -> Result<BTreeMap<IpAddr, Via>, NetlinkError> {
    let mut out = BTreeMap::new();
    for fam in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let seq = next_seq();
        let mut w = Writer::new();
        w.message(RTM_GETROUTE, NLM_F_DUMP, seq, &rtmsg(fam, 0, 0, 0), |_| {});
        for a in sock.dump(&w.into_bytes(), seq, "route dump")? {
            if a.len() < RTMSG_LEN || a[5] != protocol {
                continue;
            }
            let body = &a[RTMSG_LEN..];
            let table = u32_attr(body, RTA_TABLE).unwrap_or(a[4] as u32);
            if table != RT_TABLE_MAIN as u32 {
                continue;
            }
            if let Some(dst) = attr(body, RTA_DST).and_then(parse_ip) {
                if a[1] == host_prefix(&dst) {
                    out.insert(dst, Via::from_answer(&a));
                }
            }
        }
    }
    Ok(out)
}

/// Every route of `table`, both families, from one dump each: its
/// `rtmsg` bytes and its attributes.
fn each_route_of(
    sock: &NlSocket,
    table: u32,
    mut f: impl FnMut(&[u8], &[u8]),
) -> Result<(), NetlinkError> {
    for fam in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let seq = next_seq();
        let mut w = Writer::new();
        w.message(RTM_GETROUTE, NLM_F_DUMP, seq, &rtmsg(fam, 0, 0, 0), |_| {});
        for a in sock.dump(&w.into_bytes(), seq, "route dump")? {
            if a.len() < RTMSG_LEN {
                continue;
            }
            let body = &a[RTMSG_LEN..];
            if u32_attr(body, RTA_TABLE).unwrap_or(a[4] as u32) == table {
                f(&a[..RTMSG_LEN], body);
            }
        }
    }
    Ok(())
}

/// The interfaces the main table's default routes leave by, both families
/// (every next hop of a multipath route): the node's uplinks.
pub fn default_route_interfaces(sock: &NlSocket) -> Result<BTreeSet<u32>, NetlinkError> {
    let mut out = BTreeSet::new();
    each_route_of(sock, RT_TABLE_MAIN as u32, |rt, body| {
        // A default route (prefix 0) of unicast type.
        if rt[1] != 0 || rt[7] != RTN_UNICAST {
            return;
        }
        out.extend(u32_attr(body, RTA_OIF).filter(|i| *i != 0));
        out.extend(multipath_interfaces(
            attr(body, RTA_MULTIPATH).unwrap_or_default(),
        ));
    })?;
    Ok(out)
}

/// The interfaces of RTA_MULTIPATH's next hops (struct rtnexthop: length,
/// flags, hops, ifindex, then its attributes).
fn multipath_interfaces(mut buf: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    while buf.len() >= 8 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        if len < 8 || len > buf.len() {
            break;
        }
        let index = u32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
        if index != 0 {
            out.push(index);
        }
        buf = &buf[((len + 3) & !3).min(buf.len())..];
    }
    out
}

/// The node's own addresses: what the local table delivers here (local,
/// broadcast and anycast host routes of both families).
pub fn local_addresses(sock: &NlSocket) -> Result<BTreeSet<IpAddr>, NetlinkError> {
    let mut out = BTreeSet::new();
    each_route_of(sock, libc::RT_TABLE_LOCAL as u32, |rt, body| {
        if !matches!(
            rt[7],
            libc::RTN_LOCAL | libc::RTN_BROADCAST | libc::RTN_ANYCAST
        ) {
            return;
        }
        if let Some(dst) = attr(body, RTA_DST).and_then(parse_ip) {
            if rt[1] == host_prefix(&dst) {
                out.insert(dst);
            }
        }
    })?;
    Ok(out)
}

/// What a lookup of one address found: the route's next hop and how
/// specific the route is (`0`: the default route).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    pub via: Via,
    pub prefix_len: u8,
}

/// The route the kernel would use toward `dst` (as `ip route get`).
pub fn lookup(sock: &NlSocket, dst: &IpAddr) -> Result<Lookup, NetlinkError> {
    let found = lookup_many(sock, std::slice::from_ref(dst))?
        .pop()
        .ok_or(NetlinkError::MissingAcks(1))?;
    found.1.map_err(|errno| NetlinkError::Refused {
        what: format!("route lookup of {dst}"),
        source: std::io::Error::from_raw_os_error(errno),
        extack: None,
    })
}

/// A destination and what its lookup found: the route, or the errno.
pub type Found = (IpAddr, Result<Lookup, i32>);

/// Lookups sent per sendmsg by [`lookup_many`].
const LOOKUPS_PER_SEND: usize = 1000;

/// [`lookup`] of every address in `dsts`, many per sendmsg: one answer
/// each, the route or the errno the kernel gave (ENETUNREACH, ...).
pub fn lookup_many(sock: &NlSocket, dsts: &[IpAddr]) -> Result<Vec<Found>, NetlinkError> {
    lookups(sock, dsts, RTM_F_LOOKUP_TABLE | RTM_F_FIB_MATCH)
}

/// The source address the node's own sockets take toward each of `dsts`
/// (as `ip route get` shows it: the route resolved, not only matched),
/// many lookups per request; `None` where there is no route or no source.
pub fn chosen_sources(
    sock: &NlSocket,
    dsts: &[IpAddr],
) -> Result<Vec<(IpAddr, Option<IpAddr>)>, NetlinkError> {
    Ok(lookups(sock, dsts, RTM_F_LOOKUP_TABLE)?
        .into_iter()
        .map(|(dst, found)| (dst, found.ok().and_then(|l| l.via.src)))
        .collect())
}

fn lookups(sock: &NlSocket, dsts: &[IpAddr], flags: u32) -> Result<Vec<Found>, NetlinkError> {
    let mut out = Vec::with_capacity(dsts.len());
    for chunk in dsts.chunks(LOOKUPS_PER_SEND) {
        let mut w = Writer::new();
        let mut seqs = Vec::with_capacity(chunk.len());
        for dst in chunk {
            let seq = next_seq();
            let mut header = rtmsg(family(dst), host_prefix(dst), 0, 0);
            header[8..12].copy_from_slice(&flags.to_ne_bytes());
            w.message(RTM_GETROUTE, 0, seq, &header, |w| {
                w.put(RTA_DST, &bytes(dst))
            });
            seqs.push(seq);
        }
        let mut answers = sock.requests(&w.into_bytes(), &seqs)?;
        for (dst, seq) in chunk.iter().zip(&seqs) {
            let found = match answers.remove(seq) {
                Some(Ok(a)) if a.len() >= RTMSG_LEN => Ok(Lookup {
                    via: Via::from_answer(&a),
                    // With RTM_F_FIB_MATCH the answer is the matched route
                    // (with its own `src`, if it has one).
                    prefix_len: a[1],
                }),
                Some(Ok(_)) => Err(libc::EBADMSG),
                Some(Err(errno)) => Err(errno),
                None => return Err(NetlinkError::MissingAcks(1)),
            };
            out.push((*dst, found));
        }
    }
    Ok(out)
}

/// Route changes sent per sendmsg: never the requests of every LB IP at
/// once (a full sync's would be the controller's peak); a thousand are
/// about 100 KiB, and the system calls stay few.
const CHANGES_PER_SEND: usize = 1000;

/// Deletes the tagged host routes to `dsts`, many per request.
pub fn delete_host_routes(
    sock: &NlSocket,
    protocol: u8,
    dsts: &[IpAddr],
) -> Result<(), NetlinkError> {
    each_chunk(dsts, |chunk| {
        let mut w = Writer::new();
        let mut seqs = Vec::with_capacity(chunk.len());
        for (i, dst) in chunk.iter().enumerate() {
            let seq = next_seq();
            w.message(
                RTM_DELROUTE,
                Acked::Last.flag(i, chunk.len()),
                seq,
                &rtmsg(family(dst), host_prefix(dst), protocol, 0),
                |w| w.put(RTA_DST, &bytes(dst)),
            );
            seqs.push(seq);
        }
        sock.transact_described(&w.into_bytes(), &seqs, Acked::Last, |i| {
            format!("delete route {}", chunk[i])
        })
    })
}

/// Runs `send` on each chunk of `items`, every chunk even after one failed
/// (as a single request would have: the kernel goes on past a message it
/// refuses): the first error is returned.
fn each_chunk<T>(
    items: &[T],
    mut send: impl FnMut(&[T]) -> Result<(), NetlinkError>,
) -> Result<(), NetlinkError> {
    let mut first_error = None;
    for chunk in items.chunks(CHANGES_PER_SEND) {
        if let Err(e) = send(chunk) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Adds the host routes `dst` -> `via` that `route` gives of each of
/// `routes` (read as they are sent: no copy of them all), many per request.
/// A route whose destination `ours` holds replaces the route there (ours);
/// any other is only added (`NLM_F_EXCL`): where a route of the same
/// destination and metric is already there, another agent's, it is kept,
/// and its destination is returned.
pub fn set_host_routes<T>(
    sock: &NlSocket,
    protocol: u8,
    routes: &[T],
    route: impl Fn(&T) -> (IpAddr, Via),
    ours: impl Fn(&IpAddr) -> bool,
) -> Result<Vec<IpAddr>, NetlinkError> {
    let mut kept = Vec::new();
    each_chunk(routes, |chunk| {
        let mut w = Writer::new();
        let mut seqs = Vec::with_capacity(chunk.len());
        for (i, r) in chunk.iter().enumerate() {
            let seq = next_seq();
            let r = route(r);
            let how = if ours(&r.0) {
                NLM_F_REPLACE
            } else {
                NLM_F_EXCL
            };
            let flags = NLM_F_CREATE | how | Acked::Last.flag(i, chunk.len());
            put_route(&mut w, seq, flags, protocol, &r);
            seqs.push(seq);
        }
        let refused = sock.transact_tolerating(
            &w.into_bytes(),
            &seqs,
            Acked::Last,
            |i| {
                let (dst, via) = route(&chunk[i]);
                format!("route {dst} via {via:?}")
            },
            |errno| errno == libc::EEXIST,
        )?;
        kept.extend(refused.into_iter().map(|i| route(&chunk[i]).0));
        Ok(())
    })?;
    Ok(kept)
}

/// One request that adds or replaces route `dst` -> `via` (`flags`).
fn put_route(w: &mut Writer, seq: u32, flags: u16, protocol: u8, (dst, via): &(IpAddr, Via)) {
    let kind = if via.unreachable {
        RTN_UNREACHABLE
    } else {
        RTN_UNICAST
    };
    let mut header = rtmsg(family(dst), host_prefix(dst), protocol, kind);
    if via.onlink {
        header[8..12].copy_from_slice(&RTNH_F_ONLINK.to_ne_bytes());
    }
    w.message(RTM_NEWROUTE, flags, seq, &header, |w| {
        w.put(RTA_DST, &bytes(dst));
        if let Some(gw) = &via.gateway {
            w.put(RTA_GATEWAY, &bytes(gw));
        }
        if via.oif != 0 {
            w.put_u32_ne(RTA_OIF, via.oif);
        }
        if let Some(src) = &via.src {
            w.put(RTA_PREFSRC, &bytes(src));
        }
    });
}

/// Of a route notification (RTM_NEWROUTE/RTM_DELROUTE), its protocol.
pub fn notification_protocol(msg_type: u16, payload: &[u8]) -> Option<u8> {
    (matches!(msg_type, RTM_NEWROUTE | RTM_DELROUTE) && payload.len() >= RTMSG_LEN)
        .then(|| payload[5])
}
