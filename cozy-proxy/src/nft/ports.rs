//! The anti-spoofing check at a bridge's ports: table `bridge cozy_proxy`.
//!
//! In the `ip` and `ip6` tables a frame a pod sent through a bridge (the
//! bridge plugin, Flannel, kindnet) shows the bridge as its input
//! interface, whichever port it came in by: a neighbour pod on the same
//! bridge forging a mapped pod's address looks the same there. The bridge
//! family's prerouting hook runs at the port, before the bridge forwards the
//! frame or hands it up (and before br_netfilter's IP hooks): there `iif` is
//! the port. So each guarded address has its place in both:
//!
//! - its entry interface a bridge **port** (the port behind which the
//!   pod lives, `bridge_ports.rs`): `(address . port)` here, `(address .
//!   bridge)` in the IP tables;
//! - its entry the **bridge** itself (the port not known yet): nothing
//!   here (any port passes), `(address . bridge)` in the IP tables;
//! - any other entry (an interface of its own, or none): nothing here. A
//!   bridge its route does not name is a segment the node only carries
//!   (Kube-OVN's pods' segment behind its router): the segment's router
//!   sends the pods' addresses back into it by its own port, which the
//!   node cannot tell from the pod's. The IP tables hold `(address .
//!   interface)`, and judge it where it enters the node's stack, a bridge
//!   that hands it up included.
use super::batch::Batch;
use super::encode::{element_message, Element};
use super::error::{DecodeError, NftError};
use super::expr::Expr;
use super::read::{element_addr, read_elements};
use super::schema::{
    addr_set, cmp, concat, l4proto_is, load, ChainDef, Layout, RuleDef, SetDef, Table, A,
    ADDR_SET_SIZE, IPV4, IPV6,
};
use super::sys::*;
use crate::datapath::Change;
use crate::netlink::NlSocket;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

pub const NFPROTO_BRIDGE: u8 = libc::NFPROTO_BRIDGE as u8;
/// The bridge family's prerouting hook (NF_BR_PRE_ROUTING).
const NF_BR_PRE_ROUTING: u32 = 0;
pub const MARK: &[u8] = b"cozy-proxy nft bridge schema 3";
/// ARP (RFC 826) for IPv4 over Ethernet: hardware type 1, protocol type
/// 0x0800, address lengths 6 and 4 (its first six bytes); the sender's
/// IPv4 address at 14.
const ETH_P_ARP: u16 = 0x0806;
const ARP_ETHERNET_IPV4: [u8; 6] = [0, 1, 8, 0, 6, 4];
const ARP_SENDER_ADDR: u32 = 14;
/// An ICMPv6 neighbour advertisement (RFC 4861) and its target address.
const ND_ADVERTISEMENT: u8 = 136;
const ND_TARGET: u32 = 8;

/// Sets per address family: the addresses checked at bridge ports, and the
/// ports they may enter by.
fn names(l: &Layout) -> (&'static str, &'static str) {
    if l.addr_len == 4 {
        ("guarded4", "guard_ports4")
    } else {
        ("guarded6", "guard_ports6")
    }
}

/// ETH_P_IP / ETH_P_IPV6 as `meta protocol` loads them (network order).
fn ethertype(l: &Layout) -> Vec<u8> {
    let t: u16 = if l.addr_len == 4 { 0x0800 } else { 0x86dd };
    t.to_be_bytes().to_vec()
}

pub fn table() -> Table {
    let mut sets = Vec::new();
    let mut rules = Vec::new();
    for (i, l) in [IPV4, IPV6].iter().enumerate() {
        let (guarded, ports) = names(l);
        let id = 100 + 2 * i as u32;
        let guarded_set = SetDef {
            size: ADDR_SET_SIZE,
            ..addr_set(l, guarded, id)
        };
        sets.push(SetDef {
            name: ports.into(),
            id: id + 1,
            key_type: concat(&[l.addr_type, TYPE_IFINDEX]),
            key_len: l.addr_len + 4,
            ..guarded_set.clone()
        });
        sets.push(guarded_set);
        let port_reg = A + l.addr_len / 4;
        // The address in register A, loaded by `first`: dropped when it is
        // guarded here and this is not its port.
        let from_another_port = |comment, first: Vec<Expr>| {
            let mut exprs = first;
            exprs.extend([
                Expr::Lookup {
                    set: guarded,
                    set_id: id,
                    sreg: A,
                    dreg: None,
                    invert: false,
                },
                Expr::Meta {
                    key: NFT_META_IIF,
                    dreg: port_reg,
                },
                Expr::Lookup {
                    set: ports,
                    set_id: id + 1,
                    sreg: A,
                    dreg: None,
                    invert: true,
                },
                Expr::Counter,
                Expr::Verdict(NF_DROP),
            ]);
            RuleDef { comment, exprs }
        };
        let protocol = |ethertype: Vec<u8>| {
            vec![
                Expr::Meta {
                    key: NFT_META_PROTOCOL,
                    dreg: A,
                },
                cmp(A, NFT_CMP_EQ, ethertype),
            ]
        };
        // Neighbour discovery is guarded here as any packet is: the port
        // is read from the pod's own namespace, never learned late.
        let mut source = protocol(ethertype(l));
        source.push(load(
            NFT_PAYLOAD_NETWORK_HEADER,
            l.saddr_offset,
            l.addr_len,
            A,
        ));
        rules.push(from_another_port(
            "anti-spoofing at a bridge port: a guarded source only from its own port",
            source,
        ));
        // A neighbour's claim to a guarded address would move the node's
        // neighbour entry (the node's traffic to the pod would go to the
        // claimant): ARP's sender address, a neighbour advertisement's
        // target, only from the address's own port.
        let claim = if l.addr_len == 4 {
            let mut e = protocol(ETH_P_ARP.to_be_bytes().to_vec());
            e.extend([
                load(NFT_PAYLOAD_NETWORK_HEADER, 0, 6, A),
                cmp(A, NFT_CMP_EQ, ARP_ETHERNET_IPV4.to_vec()),
                load(NFT_PAYLOAD_NETWORK_HEADER, ARP_SENDER_ADDR, 4, A),
            ]);
            from_another_port(
                "anti-spoofing at a bridge port: a claim to a guarded address (ARP) only from its own port",
                e,
            )
        } else {
            let mut e = protocol(ethertype(l));
            e.extend(l4proto_is(l.icmp_proto));
            e.extend([
                load(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1, A),
                cmp(A, NFT_CMP_EQ, vec![ND_ADVERTISEMENT]),
                load(NFT_PAYLOAD_TRANSPORT_HEADER, ND_TARGET, 16, A),
            ]);
            from_another_port(
                "anti-spoofing at a bridge port: a claim to a guarded address (neighbour advertisement) only from its own port",
                e,
            )
        };
        rules.push(claim);
    }
    Table {
        nfproto: NFPROTO_BRIDGE,
        family: "bridge",
        mark: MARK,
        sets,
        chains: vec![ChainDef {
            name: "ports",
            kind: "filter",
            hook: NF_BR_PRE_ROUTING,
            // Before br_netfilter's IP hooks (priority 0) and conntrack.
            priority: -300,
            rules,
        }],
    }
}

/// Where a guarded address with entry interface `entry` is written: the
/// interface in the IP tables (0: none), and here whether it is checked at
/// bridge ports and which port it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub ip_iface: u32,
    pub checked: bool,
    pub port: Option<u32>,
}

impl Place {
    /// `bridge_of`: each bridge port's bridge; `bridges`: the bridges.
    /// An entry that is a bridge itself (the port not known yet) is
    /// written at the bridge, as any other entry at itself.
    pub fn of(entry: u32, bridge_of: &BTreeMap<u32, u32>, bridges: &BTreeSet<u32>) -> Place {
        match bridge_of.get(&entry) {
            Some(bridge) => Place {
                ip_iface: *bridge,
                checked: true,
                port: Some(entry),
            },
            None if bridges.contains(&entry) => Place::direct(entry),
            None => Place::direct(entry),
        }
    }

    /// The place of an address at its entry interface: that interface in
    /// the IP tables, nothing in this one.
    pub fn direct(entry: u32) -> Place {
        Place {
            ip_iface: entry,
            checked: false,
            port: None,
        }
    }
}

/// Our places of the guarded addresses, as written, where they are not
/// [`Place::direct`] (a removal takes out what was put in, whatever the
/// links are now). An address not here was written at its entry: on routed
/// veths that is every one, and a place kept for each of a node's 100 000
/// guarded addresses would be 6.5 MiB.
pub type Placed = BTreeMap<IpAddr, Place>;

/// Keeps `p` as `a`'s place, where it is not the direct one of `entry`.
fn keep(placed: &mut Placed, a: IpAddr, entry: u32, p: Place) {
    if p == Place::direct(entry) {
        placed.remove(&a);
    } else {
        placed.insert(a, p);
    }
}

/// This table's element changes.
#[derive(Debug, Default)]
pub struct PortsChange {
    checked: Change<IpAddr>,
    ports: Change<(IpAddr, u32)>,
}

/// For `guard`'s change: the IP tables' guard change (address, interface)
/// and this table's, placed by `place` (additions) and `placed`
/// (removals), which then holds the new places.
pub fn plan(
    guard: &Change<(IpAddr, u32)>,
    placed: &mut Placed,
    place: impl Fn(u32) -> Place,
) -> (Change<(IpAddr, u32)>, PortsChange) {
    let mut ip = Change::default();
    let mut here = PortsChange::default();
    for (a, entry) in &guard.remove {
        let p = placed.remove(a).unwrap_or(Place::direct(*entry));
        ip.remove.push((*a, p.ip_iface));
        if p.checked {
            here.checked.remove.push(*a);
        }
        here.ports.remove.extend(p.port.map(|port| (*a, port)));
    }
    for (a, entry) in &guard.add {
        let p = place(*entry);
        keep(placed, *a, *entry, p);
        ip.add.push((*a, p.ip_iface));
        if p.checked {
            here.checked.add.push(*a);
        }
        here.ports.add.extend(p.port.map(|port| (*a, port)));
    }
    (ip, here)
}

/// Writes `change`'s element messages into `batch`: every removal, then
/// every addition.
pub fn write(batch: &mut Batch, change: &PortsChange) {
    for remove in [true, false] {
        for l in [IPV4, IPV6] {
            let (guarded, port_set) = names(&l);
            let mine = |a: &IpAddr| Layout::of(a) == &l;
            let keys: Vec<Element> = (change.checked.side(!remove).iter())
                .filter(|a| mine(a))
                .map(|a| Element::key(*a, crate::netlink::wire::ip_bytes(a)))
                .collect();
            let pairs: Vec<Element> = (change.ports.side(!remove).iter())
                .filter(|(a, _)| mine(a))
                .map(|(a, port)| Element::key(*a, Layout::path_key(a, *port)))
                .collect();
            for (set, elems) in [(guarded, keys), (port_set, pairs)] {
                for chunk in elems.chunks(super::encode::ELEMENTS_PER_MESSAGE) {
                    element_message(batch, (NFPROTO_BRIDGE, "bridge"), set, chunk, remove);
                }
            }
        }
    }
}

/// The addresses checked at bridge ports and their ports, as the kernel
/// holds them.
pub fn read(sock: &NlSocket) -> Result<(BTreeSet<IpAddr>, BTreeMap<IpAddr, u32>), NftError> {
    let (mut checked, mut ports) = (BTreeSet::new(), BTreeMap::new());
    for l in [IPV4, IPV6] {
        let (guarded, port_set) = names(&l);
        for e in read_elements(sock, NFPROTO_BRIDGE, guarded)? {
            let ip = element_addr(&l, &e.key, guarded)?;
            checked.insert(ip);
        }
        for e in read_elements(sock, NFPROTO_BRIDGE, port_set)? {
            let (ip, port) = l
                .parse_path_key(&e.key)
                .ok_or(DecodeError::PathKey { len: e.key.len() })?;
            ports.insert(ip, port);
        }
    }
    Ok((checked, ports))
}

/// Reads the bridge table's places into the IP tables' guard `ip_guard`
/// (address -> interface): each address's entry becomes its port where it
/// has one. Returns where each address is written.
pub fn read_places(
    sock: &NlSocket,
    ip_guard: &mut BTreeMap<IpAddr, u32>,
) -> Result<Placed, NftError> {
    let (checked, ports) = match super::read::our_table(sock, NFPROTO_BRIDGE)? {
        Some(_) => read(sock)?,
        None => Default::default(),
    };
    let mut placed = Placed::new();
    for (a, iface) in ip_guard.iter_mut() {
        let port = ports.get(a).copied();
        let written = Place {
            ip_iface: *iface,
            checked: checked.contains(a),
            port,
        };
        if let Some(port) = port {
            *iface = port;
        }
        keep(&mut placed, *a, *iface, written);
    }
    Ok(placed)
}
