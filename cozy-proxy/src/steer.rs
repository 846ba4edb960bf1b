//! Kernel plumbing both backends share: the kernel's own paths toward the
//! mapped pods (which interface a guarded address may arrive on, where an
//! LB IP is steered), and the LB IPs' host routes (`proto 249`).
use crate::bridge_ports::BridgePorts;
use crate::datapath::{Change, NextHop, Path, Paths, Routes};
use crate::netlink::{
    neigh,
    route::{self, Via},
    NetlinkError, NlSocket,
};
use crate::repeats::{Repeats, REPEAT_EVERY};
use cozy_proxy_common::ROUTE_PROTO;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Mutex,
    thread::JoinHandle,
};
use tracing::warn;

/// Link, route and neighbour notifications: what may change a pod's path.
const PATH_GROUPS: i32 =
    libc::RTMGRP_LINK | libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE | libc::RTMGRP_NEIGH;

/// Calls `wake` whenever the kernel announces a change that may move a
/// pod's path (on a thread of its own, with a socket of its own): the
/// datapath then drains its own notifications and follows the change
/// (`Datapath::paths_news`) at once, not at its next upkeep.
pub fn watch_paths(wake: impl Fn() + Send + 'static) -> Result<(), NetlinkError> {
    let sock = NlSocket::subscribe(libc::NETLINK_ROUTE, PATH_GROUPS as u32)?;
    std::thread::Builder::new()
        .name("path-news".into())
        .spawn(move || loop {
            if let Err(e) = sock.wait_event() {
                warn!(error = %e, "watching the kernel's paths failed; following them at each upkeep");
                return;
            }
            wake();
        })
        .map_err(NetlinkError::Io)?;
    Ok(())
}

pub struct Steering {
    rtnl: NlSocket,
    /// Link, route and neighbour notifications: a pod's path may have
    /// changed.
    events: NlSocket,
    /// The bridge ports next hops on a bridge enter by.
    bridge_ports: BridgePorts,
    /// Paths resolved since the last change the kernel announced (`None`:
    /// the pod has no specific route).
    cache: Paths,
    /// Host routes being changed on another thread (`Routes::Overlapped`),
    /// through the socket it gives back.
    in_flight: Option<JoinHandle<(NlSocket, Result<(), NetlinkError>)>>,
    /// That thread's socket between two changes, opened with the others:
    /// in the network namespace the steering was opened in, as they are.
    spare: Option<NlSocket>,
}

impl Steering {
    pub fn open() -> Result<Self, NetlinkError> {
        Ok(Steering {
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            events: NlSocket::subscribe(libc::NETLINK_ROUTE, PATH_GROUPS as u32)?,
            bridge_ports: BridgePorts::default(),
            cache: BTreeMap::new(),
            in_flight: None,
            spare: Some(NlSocket::open(libc::NETLINK_ROUTE)?),
        })
    }

    pub fn socket(&self) -> &NlSocket {
        &self.rtnl
    }

    /// The paths toward `pods`. Only a specific route counts: a pod reached
    /// only through the default route has no path here (steering its LB IP
    /// there would send it back where it came from).
    pub fn paths(&mut self, pods: &BTreeSet<IpAddr>) -> Result<&Paths, NetlinkError> {
        let unknown: Vec<IpAddr> = pods
            .iter()
            .filter(|p| !self.cache.contains_key(p))
            .copied()
            .collect();
        let all_new = self.cache.is_empty();
        // Many lookups per sendmsg: a full sync of 50 000 pods took 0.7 s
        // one lookup at a time.
        let mut found_paths = Vec::with_capacity(unknown.len());
        let mut bridged = BTreeSet::new();
        for (pod, found) in route::lookup_many(&self.rtnl, &unknown)? {
            // No route at all (ENETUNREACH, EHOSTUNREACH): no path.
            let path = found.ok().and_then(|l| path_of(&pod, &l));
            if let Some(p) = &path {
                if self.bridge_ports.is_bridge(&self.rtnl, p.oif)? {
                    bridged.insert((p.oif, p.gateway.unwrap_or(pod)));
                }
            }
            found_paths.push((pod, path));
        }
        let ports = self.bridge_ports.ports(&self.rtnl, &bridged)?;
        // The source the node's own sockets take, where a next hop stands
        // between the node and the pod (an LB IP steered to another node
        // keeps it: `DatapathState::route_of`); a pod on its own link
        // never needs it.
        let behind: Vec<IpAddr> = found_paths
            .iter()
            .filter(|(_, p)| p.as_ref().is_some_and(|p| p.gateway.is_some()))
            .map(|(pod, _)| *pod)
            .collect();
        let sources: BTreeMap<IpAddr, Option<IpAddr>> = route::chosen_sources(&self.rtnl, &behind)?
            .into_iter()
            .collect();
        for (pod, mut path) in found_paths {
            if let Some(p) = path.as_mut() {
                let hop = (p.oif, p.gateway.unwrap_or(pod));
                p.entry = ports.get(&hop).copied().unwrap_or(p.oif);
                p.src = sources.get(&pod).copied().flatten();
            }
            self.cache.insert(pod, path);
        }
        if all_new {
            crate::datapath::repack(&mut self.cache);
        }
        // Paths of pods no longer asked for stay until the next change of
        // routes or links (or the resync) clears the cache: an incremental
        // sync asks for a few pods, not for all.
        Ok(&self.cache)
    }

    /// Each bridge port's bridge, and the bridges (links as last read).
    pub fn bridges(&mut self) -> Result<(BTreeMap<u32, u32>, BTreeSet<u32>), NetlinkError> {
        self.bridge_ports.bridges(&self.rtnl)
    }

    /// Forgets every resolved path (a resync reads them all again).
    pub fn forget(&mut self) {
        self.cache.clear();
        self.bridge_ports.forget_links();
        self.bridge_ports.forget_hops();
    }

    /// Drains the kernel's link, route and neighbour notifications; true
    /// (and the cache dropped) if any may have changed a path. Our own host
    /// routes are not news, nor neighbours that do not move a next hop on a
    /// bridge to another port (`BridgePorts::is_news`).
    pub fn changed(&mut self) -> Result<bool, NetlinkError> {
        let ports = &mut self.bridge_ports;
        let mut links = false;
        let news = self.events.pending_events(|m| {
            if let Some(n) = neigh::notification(m.msg_type, m.payload) {
                return ports.is_news(&n);
            }
            links |= matches!(m.msg_type, libc::RTM_NEWLINK | libc::RTM_DELLINK);
            route::notification_protocol(m.msg_type, m.payload) != Some(ROUTE_PROTO)
        });
        // News not read may have moved anything: nothing cached is kept.
        let news = news.inspect_err(|_| {
            self.cache.clear();
            self.bridge_ports.forget_links();
            self.bridge_ports.forget_hops();
        })?;
        if links || news > 0 {
            // (An overrun counts as news: links may have changed too.)
            self.bridge_ports.forget_links();
        }
        if news > 0 {
            self.cache.clear();
            self.bridge_ports.forget_hops();
        }
        Ok(news > 0)
    }

    /// Our host routes as they are in the kernel.
    pub fn routes(&self) -> Result<BTreeMap<IpAddr, NextHop>, NetlinkError> {
        // Only a fresh install's steps leave routes in flight, and they
        // settle them before anything reads.
        debug_assert!(self.in_flight.is_none(), "routes read while changing");
        Ok(route::host_routes(&self.rtnl, ROUTE_PROTO)?
            .into_iter()
            .map(|(dst, via)| (dst, next_hop(&via)))
            .collect())
    }

    /// Applies a change of our routes (after any still in flight), now or
    /// overlapped (see [`Steering::apply_overlapped`]).
    pub fn apply(
        &mut self,
        change: &Change<(IpAddr, NextHop)>,
        when: Routes,
    ) -> Result<(), NetlinkError> {
        match when {
            Routes::Now => {
                self.settle()?;
                apply_routes(&self.rtnl, change)
            }
            Routes::Overlapped => self.apply_overlapped(change.clone()),
        }
    }

    /// Starts applying a change of our routes on another thread, after any
    /// still in flight, and returns: a fresh install's step has the kernel
    /// change one step's routes (a third of its time, in the kernel) while
    /// it writes the next step's tables. [`Steering::settle`] waits for
    /// it and tells how it went.
    fn apply_overlapped(&mut self, change: Change<(IpAddr, NextHop)>) -> Result<(), NetlinkError> {
        self.settle()?;
        if change.is_empty() {
            return Ok(());
        }
        let Some(sock) = self.spare.take() else {
            // Only a panic there loses it (and goes on as one).
            return apply_routes(&self.rtnl, &change);
        };
        self.in_flight = Some(std::thread::spawn(move || {
            let done = apply_routes(&sock, &change);
            (sock, done)
        }));
        Ok(())
    }

    /// Waits for the routes in flight, if any: their outcome.
    pub fn settle(&mut self) -> Result<(), NetlinkError> {
        let Some(flight) = self.in_flight.take() else {
            return Ok(());
        };
        match flight.join() {
            Ok((sock, done)) => {
                self.spare = Some(sock);
                done
            }
            // A panic there is a bug here: it goes on as one.
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Removes the routes `change` stops routing, before the datapath's
    /// tables change: an LB IP whose rewrite goes is no longer steered by
    /// then (else, for a moment, it would be routed on untranslated).
    /// [`Steering::apply`] adds and replaces the rest after the tables.
    pub fn withdraw(&mut self, change: &Change<(IpAddr, NextHop)>) -> Result<(), NetlinkError> {
        let gone = gone(change);
        if gone.is_empty() {
            return Ok(());
        }
        self.settle()?;
        route::delete_host_routes(&self.rtnl, ROUTE_PROTO, &gone)
    }

    /// Removes every route of ours.
    pub fn remove_all(&self) -> Result<(), NetlinkError> {
        let all: Vec<IpAddr> = self.routes()?.into_keys().collect();
        route::delete_host_routes(&self.rtnl, ROUTE_PROTO, &all)
    }
}

/// Of a change of our routes, the destinations it stops routing (a
/// route replaced is in both lists, and is not one of them).
fn gone(change: &Change<(IpAddr, NextHop)>) -> Vec<IpAddr> {
    let routed: BTreeSet<&IpAddr> = change.add.iter().map(|(d, _)| d).collect();
    change
        .remove
        .iter()
        .filter(|(dst, _)| !routed.contains(dst))
        .map(|(dst, _)| *dst)
        .collect()
}

/// Applies the additions and replacements of a change of our routes (many
/// per request); a destination where another agent's route already is
/// keeps that route, with a warning.
fn apply_routes(rtnl: &NlSocket, change: &Change<(IpAddr, NextHop)>) -> Result<(), NetlinkError> {
    let replaced: BTreeSet<&IpAddr> = change.remove.iter().map(|(d, _)| d).collect();
    let kept = route::set_host_routes(
        rtnl,
        ROUTE_PROTO,
        &change.add,
        |(d, h)| (*d, via(h)),
        |dst| replaced.contains(dst),
    )?;
    if kept.is_empty() {
        return Ok(());
    }
    // Ours already there (a belief behind the kernel) is replaced after all.
    let held = route::host_routes(rtnl, ROUTE_PROTO)?;
    let (stale, kept): (Vec<IpAddr>, Vec<IpAddr>) =
        kept.into_iter().partition(|d| held.contains_key(d));
    if !stale.is_empty() {
        let again: Vec<&(IpAddr, NextHop)> = change
            .add
            .iter()
            .filter(|(d, _)| stale.contains(d))
            .collect();
        route::set_host_routes(rtnl, ROUTE_PROTO, &again, |(d, h)| (*d, via(h)), |_| true)?;
    }
    if !kept.is_empty() {
        static FOREIGN: Mutex<Repeats> = Mutex::new(Repeats::new(REPEAT_EVERY));
        let mut repeats = FOREIGN.lock().unwrap_or_else(|e| e.into_inner());
        crate::warn_repeating!(repeats, routes = ?kept, "another agent's route to these addresses is kept: not steered by us");
    }
    Ok(())
}

/// The path of the route `found` toward `pod`. Only a specific route
/// counts: a pod reached only through the default route has no path.
fn path_of(pod: &IpAddr, found: &route::Lookup) -> Option<Path> {
    if found.prefix_len == 0 || found.via.unreachable || found.via.oif == 0 {
        warn!(pod = %pod, "no specific route to this pod: its LB IP is not steered here (unreachable)");
        return None;
    }
    Some(Path {
        oif: found.via.oif,
        gateway: found.via.gateway,
        onlink: found.via.onlink,
        entry: found.via.oif,
        src: found.via.src,
    })
}

fn next_hop(v: &Via) -> NextHop {
    // The kernel shows an IPv6 unreachable route on `lo`; we install it on
    // no interface (and compare it so).
    if v.unreachable {
        return NextHop::UNREACHABLE;
    }
    NextHop {
        gateway: v.gateway,
        oif: v.oif,
        onlink: v.onlink,
        src: v.src,
    }
}

fn via(h: &NextHop) -> Via {
    Via {
        gateway: h.gateway,
        oif: h.oif,
        onlink: h.onlink,
        unreachable: h.oif == 0,
        src: h.src,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_destinations_not_routed_again_are_gone() {
        let hop = |oif| NextHop {
            gateway: None,
            oif,
            onlink: false,
            src: None,
        };
        let ip = |s: &str| s.parse::<IpAddr>().expect("an address");
        let change = Change {
            remove: vec![(ip("203.0.113.1"), hop(1)), (ip("203.0.113.2"), hop(1))],
            add: vec![(ip("203.0.113.2"), hop(2)), (ip("203.0.113.3"), hop(2))],
        };
        assert_eq!(gone(&change), [ip("203.0.113.1")]);
    }
}
