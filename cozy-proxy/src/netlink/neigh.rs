//! Neighbours and bridge forwarding entries (RTM_GETNEIGH): which link-layer
//! address an IP has on an interface, and behind which port of a bridge that
//! address was learned. Together they say where a pod's frames enter a
//! bridge. Layouts from <linux/neighbour.h> (`struct ndmsg`, NDA_*, NTF_*).
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, Writer, NLM_F_DUMP};
use std::net::IpAddr;

const NDMSG_LEN: usize = 12;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = libc::NDA_LLADDR;
const NDA_MASTER: u16 = libc::NDA_MASTER;
const AF_BRIDGE: u8 = libc::AF_BRIDGE as u8;

pub type Mac = [u8; 6];

/// An IP neighbour: `ip` has `mac` on interface `ifindex`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Neighbour {
    pub ip: IpAddr,
    pub ifindex: u32,
    pub mac: Mac,
}

/// A bridge forwarding entry: frames to `mac` leave bridge `bridge` by
/// `port`, so frames from `mac` came in by it (a learned or static entry,
/// not one of the bridge's own addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdbEntry {
    pub mac: Mac,
    pub port: u32,
    pub bridge: u32,
}

fn dump(sock: &NlSocket, family: u8, what: &str) -> Result<Vec<Vec<u8>>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let mut ndmsg = [0u8; NDMSG_LEN];
    ndmsg[0] = family;
    w.message(libc::RTM_GETNEIGH, NLM_F_DUMP, seq, &ndmsg, |_| {});
    sock.dump(&w.into_bytes(), seq, what)
}

fn ifindex_of(a: &[u8]) -> u32 {
    u32::from_ne_bytes([a[4], a[5], a[6], a[7]])
}

fn state_of(a: &[u8]) -> u16 {
    u16::from_ne_bytes([a[8], a[9]])
}

fn mac_of(body: &[u8]) -> Option<Mac> {
    attr(body, NDA_LLADDR).and_then(|m| Mac::try_from(m).ok())
}

/// Every IP neighbour of both families with a link-layer address (failed
/// and incomplete entries have none).
pub fn neighbours(sock: &NlSocket) -> Result<Vec<Neighbour>, NetlinkError> {
    let mut out = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for a in dump(sock, family, "neighbour dump")? {
            out.extend(parse_neighbour(&a));
        }
    }
    Ok(out)
}

fn parse_neighbour(a: &[u8]) -> Option<Neighbour> {
    if a.len() < NDMSG_LEN || a[0] == AF_BRIDGE {
        return None;
    }
    let state = state_of(a);
    if state & (libc::NUD_FAILED | libc::NUD_INCOMPLETE) != 0 {
        return None;
    }
    let body = &a[NDMSG_LEN..];
    let ip = match attr(body, NDA_DST)? {
        b if b.len() == 4 => IpAddr::from(<[u8; 4]>::try_from(b).ok()?),
        b if b.len() == 16 => IpAddr::from(<[u8; 16]>::try_from(b).ok()?),
        _ => return None,
    };
    Some(Neighbour {
        ip,
        ifindex: ifindex_of(a),
        mac: mac_of(body)?,
    })
}

/// The forwarding entries of every bridge that point at one of its ports
/// (learned or added; the bridge's own addresses, NUD_PERMANENT, are not
/// where any pod is).
pub fn fdb(sock: &NlSocket) -> Result<Vec<FdbEntry>, NetlinkError> {
    Ok(dump(sock, AF_BRIDGE, "bridge fdb dump")?
        .iter()
        .filter_map(|a| parse_fdb(a))
        .collect())
}

fn parse_fdb(a: &[u8]) -> Option<FdbEntry> {
    if a.len() < NDMSG_LEN || a[0] != AF_BRIDGE || state_of(a) & libc::NUD_PERMANENT != 0 {
        return None;
    }
    let body = &a[NDMSG_LEN..];
    let bridge = attr(body, NDA_MASTER)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_ne_bytes)?;
    Some(FdbEntry {
        mac: mac_of(body)?,
        port: ifindex_of(a),
        bridge,
    })
}

/// What a neighbour notification (RTM_NEWNEIGH / RTM_DELNEIGH) says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeighNews {
    /// An IP neighbour on `ifindex`: its link-layer address, if it has one
    /// now (a deletion or a failed resolution has none).
    Ip {
        ip: IpAddr,
        ifindex: u32,
        mac: Option<Mac>,
    },
    /// A bridge's forwarding entry for `mac` on `port` was learned or
    /// added (`gone`: deleted or aged out).
    Fdb {
        mac: Mac,
        port: u32,
        bridge: Option<u32>,
        gone: bool,
    },
}

pub fn notification(msg_type: u16, payload: &[u8]) -> Option<NeighNews> {
    if !matches!(msg_type, libc::RTM_NEWNEIGH | libc::RTM_DELNEIGH) || payload.len() < NDMSG_LEN {
        return None;
    }
    let gone = msg_type == libc::RTM_DELNEIGH;
    let body = &payload[NDMSG_LEN..];
    if payload[0] == AF_BRIDGE {
        let bridge = attr(body, NDA_MASTER)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_ne_bytes);
        return Some(NeighNews::Fdb {
            mac: mac_of(body)?,
            port: ifindex_of(payload),
            bridge,
            gone,
        });
    }
    let ip = match attr(body, NDA_DST)? {
        b if b.len() == 4 => IpAddr::from(<[u8; 4]>::try_from(b).ok()?),
        b if b.len() == 16 => IpAddr::from(<[u8; 16]>::try_from(b).ok()?),
        _ => return None,
    };
    let unresolved = state_of(payload) & (libc::NUD_FAILED | libc::NUD_INCOMPLETE) != 0;
    Some(NeighNews::Ip {
        ip,
        ifindex: ifindex_of(payload),
        mac: (!gone && !unresolved).then(|| mac_of(body)).flatten(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ndmsg(family: u8, ifindex: u32, state: u16) -> [u8; NDMSG_LEN] {
        let mut m = [0u8; NDMSG_LEN];
        m[0] = family;
        m[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        m[8..10].copy_from_slice(&state.to_ne_bytes());
        m
    }

    fn payload(header: &[u8], body: impl FnOnce(&mut Writer)) -> Vec<u8> {
        let mut w = Writer::new();
        w.message(libc::RTM_NEWNEIGH, 0, 1, header, body);
        let bytes = w.into_bytes();
        let m = super::super::wire::messages(&bytes)
            .next()
            .expect("one message");
        m.payload.to_vec()
    }

    const MAC: Mac = [2, 0, 0, 0, 0, 0x11];

    #[test]
    fn a_neighbour_and_a_learned_bridge_entry_are_read() {
        let n = payload(&ndmsg(libc::AF_INET as u8, 7, libc::NUD_STALE), |w| {
            w.put(NDA_DST, &[192, 0, 2, 11]);
            w.put(NDA_LLADDR, &MAC);
        });
        assert_eq!(
            parse_neighbour(&n),
            Some(Neighbour {
                ip: "192.0.2.11".parse().expect("ip"),
                ifindex: 7,
                mac: MAC
            })
        );
        assert_eq!(
            notification(libc::RTM_NEWNEIGH, &n),
            Some(NeighNews::Ip {
                ip: "192.0.2.11".parse().expect("ip"),
                ifindex: 7,
                mac: Some(MAC)
            })
        );
        let f = payload(&ndmsg(AF_BRIDGE, 9, libc::NUD_REACHABLE), |w| {
            w.put(NDA_LLADDR, &MAC);
            w.put_u32_ne(NDA_MASTER, 7);
        });
        assert_eq!(
            parse_fdb(&f),
            Some(FdbEntry {
                mac: MAC,
                port: 9,
                bridge: 7
            })
        );
        assert_eq!(
            notification(libc::RTM_DELNEIGH, &f),
            Some(NeighNews::Fdb {
                mac: MAC,
                port: 9,
                bridge: Some(7),
                gone: true
            })
        );
    }

    #[test]
    fn unresolved_neighbours_and_the_bridges_own_addresses_are_skipped() {
        let failed = payload(&ndmsg(libc::AF_INET as u8, 7, libc::NUD_FAILED), |w| {
            w.put(NDA_DST, &[192, 0, 2, 11]);
        });
        assert_eq!(parse_neighbour(&failed), None);
        let own = payload(&ndmsg(AF_BRIDGE, 9, libc::NUD_PERMANENT), |w| {
            w.put(NDA_LLADDR, &MAC);
            w.put_u32_ne(NDA_MASTER, 7);
        });
        assert_eq!(parse_fdb(&own), None);
    }
}
