//! One host route per mapping (`proto 249`): the LB IP goes where the
//! kernel sends the pod IP (its own route: the pod's veth on this node, or
//! the next hop toward the pod's node), so the egress program on that
//! interface rewrites it.
use super::EbpfError;
use crate::datapath::{DatapathState, StateDiff};
use crate::netlink::{route, NlSocket};
use cozy_proxy_common::ROUTE_PROTO;
use std::{collections::BTreeSet, net::IpAddr};
use tracing::warn;

/// Brings the routes from `have` to one per mapping of `desired`; returns
/// the LB IPs steered now and how many routes changed. `all` re-resolves
/// every mapping (after a read of the kernel: a pod's path may have
/// changed meanwhile), else only new or moved ones. A mapping whose pod
/// cannot be routed to is reported and retried at the next resync; it
/// does not hold up the others.
pub fn sync(
    rtnl: &NlSocket,
    have: BTreeSet<IpAddr>,
    diff: &StateDiff,
    desired: &DatapathState,
    all: bool,
) -> Result<(BTreeSet<IpAddr>, usize), EbpfError> {
    let remove: Vec<IpAddr> = have
        .iter()
        .filter(|lb| !desired.svc_pod.contains_key(lb))
        .copied()
        .collect();
    route::delete_host_routes(rtnl, ROUTE_PROTO, &remove)?;
    let changed: BTreeSet<IpAddr> = diff.svc_pod.add.iter().map(|(lb, _)| *lb).collect();
    let mut installed: BTreeSet<IpAddr> = have
        .into_iter()
        .filter(|lb| desired.svc_pod.contains_key(lb))
        .collect();
    let mut count = remove.len();
    for (lb, pod) in &desired.svc_pod {
        if !all && installed.contains(lb) && !changed.contains(lb) {
            continue;
        }
        // On the pod's own link (no gateway), the pod itself is the next
        // hop: the frame gets its MAC.
        let result = route::lookup(rtnl, pod).and_then(|via| {
            let via = route::NextHop {
                gateway: via.gateway.or(Some(*pod)),
                ..via
            };
            route::set_host_route(rtnl, ROUTE_PROTO, lb, &via)
        });
        match result {
            Ok(()) => {
                installed.insert(*lb);
                count += 1;
            }
            Err(e) => {
                installed.remove(lb);
                warn!(lb = %lb, pod = %pod, error = %e, "no route to the pod; this LB IP is not steered until the next resync");
            }
        }
    }
    Ok((installed, count))
}
