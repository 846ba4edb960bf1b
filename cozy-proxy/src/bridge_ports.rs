//! Where a next hop's frames enter the node when the route toward it goes
//! out of a Linux bridge: the bridge port it is behind. A pod on a bridge
//! (the bridge plugin, Flannel, kindnet) and a neighbour pod forging its
//! address both arrive "on the bridge" as the routes see it; only the port
//! tells them apart.
//!
//! The port is first the one whose veth peer holds the address as its own,
//! read in the peer's network namespace: a neighbour cannot write another
//! pod's namespace, while one forged ARP request or neighbour advertisement
//! writes the node's neighbour table and the bridge's forwarding database.
//! Only for an address no peer holds (a VM that took its pod's address,
//! KubeVirt's bridge binding; a gateway that is no pod) or several do are
//! those tables read: the neighbour entry gives the MAC, the forwarding
//! database the port it was learned on.
//!
//! A port learned is kept while that port exists, also once the bridge's
//! entry ages out (300 s without a frame from the pod): a quiet pod keeps
//! its place, and the entry is learned again, on the same port, by its next
//! frame. A next hop whose port is not known yet (no neighbour entry, no
//! forwarding entry) enters "by the bridge": any of its ports is taken as
//! its own until the kernel learns which.
use crate::netlink::{
    addr::{addresses_in, IfAddr, StrictSocket},
    neigh::{self, Mac, NeighNews},
    route::{self, Link},
    NetlinkError, NlSocket,
};
use std::{
    collections::{btree_map::Entry, BTreeMap, BTreeSet},
    net::IpAddr,
};

#[derive(Default)]
pub struct BridgePorts {
    /// The node's bridges and each port's bridge, as last read (`None`:
    /// read them again).
    links: Option<Links>,
    /// Where each (bridge, MAC) was last learned.
    learned: BTreeMap<(u32, Mac), u32>,
    /// The MAC each next hop resolved to on its bridge (`None`: none yet):
    /// the neighbour notifications that concern these are news.
    resolved: BTreeMap<(u32, IpAddr), Option<Mac>>,
    /// A socket that checks strictly, for other namespaces' addresses
    /// (opened when first needed).
    strict: Option<StrictSocket>,
}

#[derive(Default)]
struct Links {
    bridges: BTreeSet<u32>,
    /// port -> its bridge
    ports: BTreeMap<u32, u32>,
    /// port -> its veth peer's namespace (the node's id of it) and index
    /// there: a pod's own interface.
    peers: BTreeMap<u32, (i32, u32)>,
}

impl Links {
    fn of(all: &[Link]) -> Links {
        let bridges: BTreeSet<u32> = all
            .iter()
            .filter(|l| l.is_bridge())
            .map(|l| l.index)
            .collect();
        let ports = all
            .iter()
            .filter(|l| l.is_bridge_port())
            .filter_map(|l| Some((l.index, l.master?)))
            .filter(|(_, b)| bridges.contains(b))
            .collect::<BTreeMap<u32, u32>>();
        let peers = all
            .iter()
            .filter(|l| ports.contains_key(&l.index))
            .filter_map(|l| Some((l.index, l.peer_ns?)))
            .collect();
        Links {
            bridges,
            ports,
            peers,
        }
    }
}

impl BridgePorts {
    fn links(&mut self, sock: &NlSocket) -> Result<&Links, NetlinkError> {
        if self.links.is_none() {
            let links = Links::of(&route::links(sock)?);
            // A port gone (a pod's veth deleted) takes what was learned on
            // it.
            self.learned
                .retain(|(bridge, _), port| links.ports.get(port) == Some(bridge));
            self.links = Some(links);
        }
        Ok(self.links.get_or_insert_with(Links::default))
    }

    /// Is `ifindex` a bridge (links as last read)?
    pub fn is_bridge(&mut self, sock: &NlSocket, ifindex: u32) -> Result<bool, NetlinkError> {
        Ok(self.links(sock)?.bridges.contains(&ifindex))
    }

    /// Each bridge port's bridge, and the bridges.
    pub fn bridges(
        &mut self,
        sock: &NlSocket,
    ) -> Result<(BTreeMap<u32, u32>, BTreeSet<u32>), NetlinkError> {
        let l = self.links(sock)?;
        Ok((l.ports.clone(), l.bridges.clone()))
    }

    /// The links changed: read them again when next needed.
    pub fn forget_links(&mut self) {
        self.links = None;
    }

    /// The ports of `hops` (bridge, next hop) whose address is the pod's
    /// own: on the peer of exactly one of the bridge's veths, as that
    /// peer's namespace lists it. What a neighbour writes (the node's
    /// neighbour table, the bridge's forwarding database) cannot move
    /// these. An address no port's peer holds (a VM that took its pod's
    /// address, KubeVirt's bridge binding) or several do (a pod with
    /// NET_ADMIN claiming another's) is left to the forwarding database.
    fn owners(
        &mut self,
        hops: &BTreeSet<(u32, IpAddr)>,
    ) -> Result<BTreeMap<(u32, IpAddr), u32>, NetlinkError> {
        let Some(links) = self.links.as_ref() else {
            return Ok(BTreeMap::new());
        };
        let bridges: BTreeSet<u32> = hops.iter().map(|(b, _)| *b).collect();
        let mut claims: BTreeMap<(u32, IpAddr), Vec<u32>> = BTreeMap::new();
        let mut read: BTreeMap<i32, Vec<IfAddr>> = BTreeMap::new();
        for (port, (netnsid, peer)) in &links.peers {
            let Some(bridge) = links.ports.get(port).filter(|b| bridges.contains(b)) else {
                continue;
            };
            let addrs = match read.entry(*netnsid) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let strict = match &self.strict {
                        Some(s) => s,
                        None => self.strict.insert(StrictSocket::open()?),
                    };
                    e.insert(addresses_in(strict, *netnsid)?)
                }
            };
            for a in addrs.iter().filter(|a| a.ifindex == *peer) {
                if hops.contains(&(*bridge, a.ip)) {
                    claims.entry((*bridge, a.ip)).or_default().push(*port);
                }
            }
        }
        Ok(claims
            .into_iter()
            .filter_map(|(hop, ports)| (ports.len() == 1).then(|| (hop, ports[0])))
            .collect())
    }

    /// The port each of `hops` (bridge, next hop) enters by, where known:
    /// the pod's own interface ([`BridgePorts::owners`]), else where the
    /// bridge learned the next hop's MAC.
    pub fn ports(
        &mut self,
        sock: &NlSocket,
        hops: &BTreeSet<(u32, IpAddr)>,
    ) -> Result<BTreeMap<(u32, IpAddr), u32>, NetlinkError> {
        if hops.is_empty() {
            return Ok(BTreeMap::new());
        }
        self.links(sock)?;
        let owners = self.owners(hops)?;
        let macs: BTreeMap<(u32, IpAddr), Mac> = neigh::neighbours(sock)?
            .into_iter()
            .map(|n| ((n.ifindex, n.ip), n.mac))
            .filter(|(k, _)| hops.contains(k))
            .collect();
        for e in neigh::fdb(sock)? {
            self.learned.insert((e.bridge, e.mac), e.port);
        }
        let links = self.links.as_ref();
        let mut out = BTreeMap::new();
        for hop in hops {
            let mac = macs.get(hop).copied();
            self.resolved.insert(*hop, mac);
            if let Some(port) = owners.get(hop) {
                out.insert(*hop, *port);
                continue;
            }
            let port = mac.and_then(|m| self.learned.get(&(hop.0, m)).copied());
            // Only a port the bridge still has.
            if let Some(port) =
                port.filter(|p| links.is_some_and(|l| l.ports.get(p) == Some(&hop.0)))
            {
                out.insert(*hop, port);
            }
        }
        Ok(out)
    }

    /// Forgets the next hops resolved (the paths are read again).
    pub fn forget_hops(&mut self) {
        self.resolved.clear();
    }

    /// Does this neighbour notification change where a resolved next hop's
    /// frames enter? A neighbour's new MAC, one found for a next hop that
    /// had none, or its MAC learned on another port; not an entry aging out
    /// or a neighbour going stale.
    pub fn is_news(&mut self, n: &NeighNews) -> bool {
        match *n {
            NeighNews::Ip { ip, ifindex, mac } => match self.resolved.get(&(ifindex, ip)) {
                Some(known) => mac.is_some() && mac != *known,
                None => false,
            },
            NeighNews::Fdb {
                mac,
                port,
                bridge: Some(bridge),
                gone: false,
            } => {
                let ours = self
                    .resolved
                    .iter()
                    .any(|((b, _), m)| *b == bridge && *m == Some(mac));
                let moved = self.learned.insert((bridge, mac), port) != Some(port);
                ours && moved
            }
            NeighNews::Fdb { .. } => false,
        }
    }
}
