//! The addresses of another network namespace, as the node sees it by its
//! id (a veth's `IFLA_LINK_NETNSID`): a pod's own addresses on its own
//! interface, which a neighbour on the same bridge cannot write (unlike
//! the node's neighbour table and the bridge's forwarding database).
//! `RTM_GETADDR` with `IFA_TARGET_NETNSID`, which the kernel reads only on
//! a socket that asked for strict checking (`NETLINK_GET_STRICT_CHK`).
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, Writer, NLM_F_DUMP};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const RTM_GETADDR: u16 = libc::RTM_GETADDR;
const IFADDRMSG_LEN: usize = 8;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
/// <linux/if_addr.h>
const IFA_TARGET_NETNSID: u16 = 10;

/// An address of an interface in the namespace asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IfAddr {
    /// The interface's index in that namespace.
    pub ifindex: u32,
    pub ip: IpAddr,
}

/// A routing socket that asked for strict checking when it was opened:
/// the only kind [`addresses_in`] takes, since on another the kernel
/// ignores the namespace's id and answers with the node's own addresses.
pub struct StrictSocket(NlSocket);

impl StrictSocket {
    pub fn open() -> Result<StrictSocket, NetlinkError> {
        let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
        sock.check_strictly()?;
        Ok(StrictSocket(sock))
    }
}

/// Every address of the namespace the node knows as `netnsid`.
pub fn addresses_in(
    StrictSocket(sock): &StrictSocket,
    netnsid: i32,
) -> Result<Vec<IfAddr>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let ifaddr = [0u8; IFADDRMSG_LEN];
    w.message(RTM_GETADDR, NLM_F_DUMP, seq, &ifaddr, |w| {
        w.put(IFA_TARGET_NETNSID, &netnsid.to_ne_bytes());
    });
    let answers = sock.dump(&w.into_bytes(), seq, "address dump")?;
    Ok(answers.iter().filter_map(|a| parse(a)).collect())
}

fn parse(a: &[u8]) -> Option<IfAddr> {
    let head = a.get(..IFADDRMSG_LEN)?;
    let family = head[0];
    let ifindex = u32::from_ne_bytes(head[4..8].try_into().ok()?);
    let body = &a[IFADDRMSG_LEN..];
    // IPv4 names the interface's own address IFA_LOCAL (IFA_ADDRESS is
    // the peer's on a point-to-point link); IPv6 gives IFA_ADDRESS only.
    let raw = attr(body, IFA_LOCAL).or_else(|| attr(body, IFA_ADDRESS))?;
    let ip = match (i32::from(family), raw.len()) {
        (libc::AF_INET, 4) => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(raw).ok()?)),
        (libc::AF_INET6, 16) => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(raw).ok()?)),
        _ => return None,
    };
    Some(IfAddr { ifindex, ip })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_answer_names_its_local_address_and_an_ipv6_one_its_address() {
        let mut v4 = vec![libc::AF_INET as u8, 32, 0, 0];
        v4.extend(7u32.to_ne_bytes());
        for (t, ip) in [(IFA_ADDRESS, [192, 0, 2, 1]), (IFA_LOCAL, [192, 0, 2, 11])] {
            v4.extend(8u16.to_ne_bytes());
            v4.extend(t.to_ne_bytes());
            v4.extend(ip);
        }
        assert_eq!(
            parse(&v4),
            Some(IfAddr {
                ifindex: 7,
                ip: "192.0.2.11".parse().expect("v4")
            })
        );
        let mut v6 = vec![libc::AF_INET6 as u8, 128, 0, 0];
        v6.extend(3u32.to_ne_bytes());
        v6.extend(20u16.to_ne_bytes());
        v6.extend(IFA_ADDRESS.to_ne_bytes());
        v6.extend("2001:db8:2::11".parse::<Ipv6Addr>().expect("v6").octets());
        assert_eq!(
            parse(&v6),
            Some(IfAddr {
                ifindex: 3,
                ip: "2001:db8:2::11".parse().expect("v6")
            })
        );
        assert_eq!(parse(&[0u8; 4]), None);
    }
}
