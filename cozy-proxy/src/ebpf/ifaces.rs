//! The interfaces' roles for the anti-spoofing check (`ifaces`), from the
//! node's links: a guarded source arriving elsewhere than its own entry
//! interface is on its way there (a bridge or bond port, judged where it
//! goes next), or forged. Written at every upkeep where they changed.
use super::EbpfError;
use crate::datapath::{Desired, Path, StateDiff};
use crate::netlink::route::Link;
use aya::maps::{HashMap, MapData};
use cozy_proxy_common::{iface, maps as names, IfRole, HAIRPIN_SEVERAL};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};
use tracing::debug;

/// Masters whose ports hand frames to them (or to the host's stack through
/// another of their ports) without the host's routing: frames on their
/// ports are judged where they arrive next.
const DEFERRING_MASTERS: [&str; 3] = ["bond", "team", "openvswitch"];

/// The role of every interface that has one:
/// - a bridge: [`iface::BRIDGE`] (what it hands up came in by a port:
///   judged there where the route names the bridge, else forged here),
///   with [`iface::DEFER`] for programs that know only that (an upgrade's
///   old programs until their links are replaced);
/// - a bridge's port: its bridge, with [`iface::PORT_JUDGES`];
/// - a port of a bond, a team or an Open vSwitch datapath: `DEFER`; but not
///   an Open vSwitch internal port (Kube-OVN's `ovn0`), which is where the
///   host's stack receives what the datapath switched to it.
///
/// And [`iface::HAIRPIN`] on those of `hairpin` (interfaces through which
/// a pod of this node's mappings is reached via a router) that are none
/// of these: only there may an in-cluster client's flow to an LB IP leave
/// by the interface it came in on.
pub fn roles(links: &[Link], hairpin: &BTreeSet<u32>) -> BTreeMap<u32, IfRole> {
    let kind_of = |index: u32| {
        links
            .iter()
            .find(|l| l.index == index)
            .map(|l| l.info_kind.as_str())
    };
    let mut out = BTreeMap::new();
    for l in links {
        if l.is_bridge() {
            out.insert(
                l.index,
                IfRole {
                    bridge: 0,
                    flags: iface::DEFER | iface::BRIDGE,
                },
            );
        }
        let Some(master) = l.master else { continue };
        if l.is_bridge_port() && kind_of(master) == Some("bridge") {
            out.insert(
                l.index,
                IfRole {
                    bridge: master,
                    flags: iface::PORT_JUDGES,
                },
            );
        } else if DEFERRING_MASTERS.contains(&l.slave_kind.as_str()) && l.info_kind != "openvswitch"
        {
            out.insert(
                l.index,
                IfRole {
                    bridge: 0,
                    flags: iface::DEFER,
                },
            );
        }
    }
    for index in hairpin {
        if links.iter().any(|l| l.index == *index) && !out.contains_key(index) {
            out.insert(
                *index,
                IfRole {
                    bridge: 0,
                    flags: iface::HAIRPIN,
                },
            );
        }
    }
    out
}

/// [`cozy_proxy_common::Config::hairpin_iface`] for these roles: the one
/// interface with [`iface::HAIRPIN`], none, or several.
pub fn hairpin_config(roles: &BTreeMap<u32, IfRole>) -> u32 {
    let mut marked = roles
        .iter()
        .filter(|(_, r)| r.flags & iface::HAIRPIN != 0)
        .map(|(i, _)| *i);
    match (marked.next(), marked.next()) {
        (None, _) => 0,
        (Some(one), None) => one,
        (Some(_), Some(_)) => HAIRPIN_SEVERAL,
    }
}

/// The interfaces through which a pod of one of the node's mappings is
/// reached via a router: a gateway that is neither an `onlink` tunnel's far
/// end nor, for a pod on another node, that node (Kube-OVN's `ovn0`, where
/// in-cluster clients' hairpins leave; `roles` drops bridges and ports).
/// Kept per pod and changed with the pods and their paths, so that a round
/// looks only at what it touched.
#[derive(Debug)]
pub struct HairpinPaths {
    by_pod: BTreeMap<IpAddr, u32>,
    /// Every pod is to be looked at again (at start, after a read).
    whole: bool,
}

impl Default for HairpinPaths {
    fn default() -> Self {
        HairpinPaths {
            by_pod: BTreeMap::new(),
            whole: true,
        }
    }
}

impl HairpinPaths {
    /// Every pod is looked at again at the next change.
    pub fn forget(&mut self) {
        self.by_pod.clear();
        self.whole = true;
    }

    /// The pods whose paths `diff` brings to look at (every pod of
    /// `desired` after [`HairpinPaths::forget`]), each with the address
    /// of the node that hosts it when that is another node; those gone
    /// are dropped.
    pub fn touched_pods(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
    ) -> BTreeMap<IpAddr, Option<IpAddr>> {
        let s = desired.state;
        let host_of = |lb: &IpAddr| s.remote_hosts.get(lb).copied();
        if std::mem::take(&mut self.whole) {
            self.by_pod.clear();
            let local = s.pod_svc.keys().map(|p| (*p, None));
            let remote = s.remote.iter().map(|(lb, p)| (*p, host_of(lb)));
            return local.chain(remote).collect();
        }
        for pod in (diff.pod_svc.remove.iter().map(|(p, _)| p))
            .chain(diff.remote.remove.iter().map(|(_, p)| p))
        {
            self.by_pod.remove(pod);
        }
        let mut look = BTreeMap::new();
        let touched = (diff.pod_svc.add.iter().map(|(p, _)| p))
            .chain(diff.remote.add.iter().map(|(_, p)| p))
            .chain(diff.guard.add.iter().map(|(a, _)| a));
        for a in touched {
            if s.pod_svc.contains_key(a) {
                look.insert(*a, None);
            } else if let Some(lb) = desired.remote_pods.lb_of(a) {
                look.insert(*a, host_of(lb));
            }
        }
        look
    }

    /// Takes `pod`'s path as it is now (`host`: the node hosting it, when
    /// another); `true` if the interfaces changed.
    pub fn take(&mut self, pod: IpAddr, path: Option<&Path>, host: Option<IpAddr>) -> bool {
        let before = self.interfaces();
        let via_router = |p: &&Path| p.gateway.is_some() && !p.onlink && p.gateway != host;
        match path.filter(via_router) {
            Some(p) => self.by_pod.insert(pod, p.oif),
            None => self.by_pod.remove(&pod),
        };
        before != self.interfaces()
    }

    pub fn interfaces(&self) -> BTreeSet<u32> {
        self.by_pod.values().copied().collect()
    }
}

pub struct Ifaces {
    map: HashMap<MapData, u32, IfRole>,
    /// The roles as last written (`None`: read the map).
    written: Option<BTreeMap<u32, IfRole>>,
}

fn err(source: aya::maps::MapError) -> EbpfError {
    EbpfError::Map {
        name: names::IFACES,
        source,
    }
}

impl Ifaces {
    pub fn open(dir: &std::path::Path) -> Result<Self, EbpfError> {
        let data = MapData::from_pin(super::layouts::pin_path(dir, names::IFACES)).map_err(err)?;
        let map = HashMap::try_from(aya::maps::Map::HashMap(data)).map_err(err)?;
        Ok(Ifaces { map, written: None })
    }

    /// The roles the map holds.
    pub fn read(&self) -> BTreeMap<u32, IfRole> {
        self.map.iter().filter_map(Result::ok).collect()
    }

    /// Makes the map hold `roles`: what changed is written, what went is
    /// removed.
    pub fn sync(&mut self, roles: BTreeMap<u32, IfRole>) -> Result<(), EbpfError> {
        let held = match self.written.take() {
            Some(w) => w,
            None => self.read(),
        };
        for (index, role) in &roles {
            if held.get(index) != Some(role) {
                self.map.insert(index, role, 0).map_err(err)?;
            }
        }
        for index in held.keys().filter(|i| !roles.contains_key(i)) {
            // Gone already (its interface deleted, say): nothing to do.
            let _ = self.map.remove(index);
        }
        if held != roles {
            debug!(interfaces = roles.len(), "interface roles written");
        }
        self.written = Some(roles);
        Ok(())
    }

    /// Forgets what was written (the next sync reads the map).
    pub fn forget(&mut self) {
        self.written = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, kind: &str, master: Option<u32>, slave_kind: &str) -> Link {
        Link {
            index,
            name: format!("if{index}"),
            kind: crate::netlink::route::ARPHRD_ETHER,
            peer_elsewhere: false,
            peer_ns: None,
            master,
            info_kind: kind.into(),
            slave_kind: slave_kind.into(),
            lower: None,
            xdp: None,
        }
    }

    #[test]
    fn bridges_judge_what_they_hand_up_and_bond_ports_defer_to_the_bond() {
        let links = [
            link(1, "", None, ""),
            link(2, "bridge", None, ""),
            link(3, "veth", Some(2), "bridge"),
            link(4, "bond", None, ""),
            link(5, "", Some(4), "bond"),
            link(6, "openvswitch", None, ""),
            link(7, "veth", Some(6), "openvswitch"),
            link(8, "vrf", None, ""),
            link(9, "veth", Some(8), "vrf"),
            link(10, "openvswitch", Some(6), "openvswitch"),
        ];
        let r = roles(&links, &BTreeSet::new());
        let role = |bridge, flags| IfRole { bridge, flags };
        assert_eq!(r.get(&2), Some(&role(0, iface::DEFER | iface::BRIDGE)));
        assert_eq!(r.get(&3), Some(&role(2, iface::PORT_JUDGES)));
        assert_eq!(r.get(&5), Some(&role(0, iface::DEFER)));
        assert_eq!(r.get(&7), Some(&role(0, iface::DEFER)));
        // A plain interface, a bond, a VRF and its port, an OVS internal
        // port (ovn0): judged where they are.
        for plain in [1, 4, 6, 8, 9, 10] {
            assert_eq!(r.get(&plain), None, "interface {plain}");
        }
    }

    /// A pod behind a router (a gateway, not onlink, not the node hosting
    /// it) marks its route's interface, unless that is a bridge; one such
    /// interface is written to `config` itself, several as "look at the
    /// flags". A pod of another node routed via that node marks nothing.
    #[test]
    fn interfaces_toward_pods_behind_a_router_may_hairpin() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("an address");
        let path = |oif, gateway: Option<&str>, onlink| Path {
            oif,
            gateway: gateway.map(ip),
            onlink,
            entry: oif,
            src: None,
        };
        let links = [
            link(2, "bridge", None, ""),
            link(5, "", None, ""),
            link(6, "", None, ""),
        ];
        let (p1, p2, p3, remote) = (
            ip("192.0.2.11"),
            ip("192.0.2.12"),
            ip("192.0.2.13"),
            ip("192.0.2.75"),
        );
        let mut state = crate::datapath::DatapathState::default();
        for (i, pod) in [p1, p2, p3].into_iter().enumerate() {
            let lb = ip(&format!("203.0.113.{}", 10 + i));
            state.pod_svc.insert(pod, lb);
            state.svc_pod.insert(lb, pod);
        }
        state.remote.insert(ip("203.0.113.30"), remote);
        state
            .remote_hosts
            .insert(ip("203.0.113.30"), ip("198.51.100.3"));
        let remote_pods = crate::datapath::RemotePods::of(&state);
        let desired = Desired {
            state: &state,
            remote_pods: &remote_pods,
        };
        let mut h = HairpinPaths::default();
        let none = StateDiff::default();
        let look = h.touched_pods(&none, desired);
        assert_eq!(look.len(), 4, "all of them after a read: {look:?}");
        assert_eq!(look[&remote], Some(ip("198.51.100.3")));
        // Behind a router on 5 (Kube-OVN's ovn0); on its own link (6);
        // behind an overlay's far end on 5; another node's pod via that
        // node on 6.
        assert!(h.take(p1, Some(&path(5, Some("192.0.2.193"), false)), None));
        assert!(!h.take(p2, Some(&path(6, None, false)), None));
        assert!(!h.take(p3, Some(&path(5, Some("192.0.2.64"), true)), None));
        let host = look[&remote];
        assert!(!h.take(remote, Some(&path(6, Some("198.51.100.3"), false)), host));
        let r = roles(&links, &h.interfaces());
        assert_eq!(r.get(&5).map(|r| r.flags), Some(iface::HAIRPIN));
        assert_eq!(hairpin_config(&r), 5);
        // Another node's pod behind a router on 6 (Kube-OVN's), and a pod
        // routed into a bridge, which is no hairpin.
        assert!(h.take(remote, Some(&path(6, Some("192.0.2.193"), false)), host));
        assert!(h.take(p3, Some(&path(2, Some("192.0.2.1"), false)), None));
        let r = roles(&links, &h.interfaces());
        assert_eq!(hairpin_config(&r), HAIRPIN_SEVERAL);
        assert_eq!(
            r.get(&2).map(|r| r.flags),
            Some(iface::DEFER | iface::BRIDGE)
        );
        // The pods on 6 and 5 go: only what the change touches is looked at.
        let mut gone = StateDiff::default();
        gone.pod_svc.remove.push((p1, ip("203.0.113.10")));
        gone.remote.remove.push((ip("203.0.113.30"), remote));
        state.pod_svc.remove(&p1);
        state.remote.clear();
        let remote_pods = crate::datapath::RemotePods::of(&state);
        let desired = Desired {
            state: &state,
            remote_pods: &remote_pods,
        };
        assert!(h.touched_pods(&gone, desired).is_empty());
        assert_eq!(hairpin_config(&roles(&links, &h.interfaces())), 0);
    }
}
