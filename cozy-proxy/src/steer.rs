//! Kernel plumbing both backends share: the kernel's own paths toward the
//! mapped pods (which interface a guarded address may arrive on, where an
//! LB IP is steered), and the LB IPs' host routes (`proto 249`).
use crate::datapath::{Change, NextHop, Path, Paths};
use crate::netlink::{
    route::{self, Via},
    NetlinkError, NlSocket,
};
use cozy_proxy_common::ROUTE_PROTO;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};
use tracing::warn;

pub struct Steering {
    rtnl: NlSocket,
    /// Link and route notifications: a pod's path may have changed.
    events: NlSocket,
    /// Paths resolved since the last change the kernel announced (`None`:
    /// the pod has no specific route).
    cache: Paths,
}

impl Steering {
    pub fn open() -> Result<Self, NetlinkError> {
        let groups = libc::RTMGRP_LINK | libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE;
        Ok(Steering {
            rtnl: NlSocket::open(libc::NETLINK_ROUTE)?,
            events: NlSocket::subscribe(libc::NETLINK_ROUTE, groups as u32)?,
            cache: BTreeMap::new(),
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
        for (pod, found) in route::lookup_many(&self.rtnl, &unknown)? {
            // No route at all (ENETUNREACH, EHOSTUNREACH): no path.
            let path = found.ok().and_then(|l| path_of(&pod, &l));
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

    /// Forgets every resolved path (a resync reads them all again).
    pub fn forget(&mut self) {
        self.cache.clear();
    }

    /// Drains the kernel's link and route notifications; true (and the
    /// cache dropped) if any may have changed a path. Our own host routes
    /// are not news.
    pub fn changed(&mut self) -> Result<bool, NetlinkError> {
        let news = self.events.pending_events(|m| {
            route::notification_protocol(m.msg_type, m.payload) != Some(ROUTE_PROTO)
        })?;
        if news > 0 {
            self.cache.clear();
        }
        Ok(news > 0)
    }

    /// Our host routes as they are in the kernel.
    pub fn routes(&self) -> Result<BTreeMap<IpAddr, NextHop>, NetlinkError> {
        Ok(route::host_routes(&self.rtnl, ROUTE_PROTO)?
            .into_iter()
            .map(|(dst, via)| (dst, next_hop(&via)))
            .collect())
    }

    /// Applies a change of our routes: removals first, then additions and
    /// replacements (many per request).
    pub fn apply(&self, change: &Change<(IpAddr, NextHop)>) -> Result<(), NetlinkError> {
        if !change.remove.is_empty() {
            // A route replaced is in both lists: not deleted first.
            let replaced: BTreeSet<&IpAddr> = change.add.iter().map(|(d, _)| d).collect();
            let gone: Vec<IpAddr> = change
                .remove
                .iter()
                .filter(|(dst, _)| !replaced.contains(dst))
                .map(|(dst, _)| *dst)
                .collect();
            route::delete_host_routes(&self.rtnl, ROUTE_PROTO, &gone)?;
        }
        route::set_host_routes(&self.rtnl, ROUTE_PROTO, &change.add, |(d, h)| (*d, via(h)))
    }

    /// Removes every route of ours.
    pub fn remove_all(&self) -> Result<(), NetlinkError> {
        let all: Vec<IpAddr> = self.routes()?.into_keys().collect();
        route::delete_host_routes(&self.rtnl, ROUTE_PROTO, &all)
    }
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
    }
}

fn via(h: &NextHop) -> Via {
    Via {
        gateway: h.gateway,
        oif: h.oif,
        onlink: h.onlink,
        unreachable: h.oif == 0,
    }
}
