//! The interfaces' roles for the anti-spoofing check (`ifaces`), from the
//! node's links: a guarded source arriving elsewhere than its own entry
//! interface is on its way there (a bridge or bond port, judged where it
//! goes next), or forged. Written at every upkeep where they changed.
use super::EbpfError;
use crate::netlink::route::Link;
use aya::maps::{HashMap, MapData};
use cozy_proxy_common::{iface, maps as names, IfRole};
use std::{collections::BTreeMap, path::Path};
use tracing::debug;

/// Masters whose ports hand frames to them (or to the host's stack through
/// another of their ports) without the host's routing: frames on their
/// ports are judged where they arrive next.
const DEFERRING_MASTERS: [&str; 3] = ["bond", "team", "openvswitch"];

/// The role of every interface that has one:
/// - a bridge: [`iface::DEFER`] (its frames all came in by a port, each
///   judged there);
/// - a bridge's port: its bridge, with [`iface::PORT_JUDGES`];
/// - a port of a bond, a team or an Open vSwitch datapath: `DEFER`; but not
///   an Open vSwitch internal port (Kube-OVN's `ovn0`), which is where the
///   host's stack receives what the datapath switched to it.
pub fn roles(links: &[Link]) -> BTreeMap<u32, IfRole> {
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
                    flags: iface::DEFER,
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
    out
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
    pub fn open(dir: &Path) -> Result<Self, EbpfError> {
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
            master,
            info_kind: kind.into(),
            slave_kind: slave_kind.into(),
            lower: None,
        }
    }

    #[test]
    fn bridges_defer_to_their_ports_and_bond_ports_to_the_bond() {
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
        let r = roles(&links);
        let role = |bridge, flags| IfRole { bridge, flags };
        assert_eq!(r.get(&2), Some(&role(0, iface::DEFER)));
        assert_eq!(r.get(&3), Some(&role(2, iface::PORT_JUDGES)));
        assert_eq!(r.get(&5), Some(&role(0, iface::DEFER)));
        assert_eq!(r.get(&7), Some(&role(0, iface::DEFER)));
        // A plain interface, a bond, a VRF and its port, an OVS internal
        // port (ovn0): judged where they are.
        for plain in [1, 4, 6, 8, 9, 10] {
            assert_eq!(r.get(&plain), None, "interface {plain}");
        }
    }
}
