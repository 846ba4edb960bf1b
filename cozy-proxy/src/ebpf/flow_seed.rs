//! The flows filtered pods started before the programs acted, taken from
//! conntrack when the programs take a node over from nftables (a backend
//! switch). nftables' port filter lets a pod's replies in by conntrack's
//! `established`; the programs by their own memory of the pod's flows
//! (`flows`). A flow the pod started while nftables served is in
//! conntrack only, so without this its replies would be dropped from the
//! moment the programs act until the pod sent on it again (a held
//! connection the far end speaks on next would stall for good).
//!
//! A pod's flow is a conntrack entry whose original direction leaves from
//! the pod: from its own IP (toward the cluster, which it reaches
//! untranslated) or from its LB IP (both backends translate a pod's
//! packets to the outside before conntrack). The flows the pod starts
//! while the programs stand by, they remember themselves (see
//! `Config::standby`), so the two together leave no gap.
use super::apply_plan::key;
use super::maps::{named, Maps, BPF_NOEXIST};
use super::EbpfError;
use crate::netlink::conntrack::{tcp_state, Ends, Tracked};
use aya::maps::MapError;
use cozy_proxy_common::{addr, flow, limits, maps as names, AddrInfo, FlowKey, FlowState, IpKey};
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

/// A flow to remember, and the counter slot of its pod (its quota).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodFlow {
    pub key: FlowKey,
    pub state: u8,
    pub slot: u16,
}

/// A pod of this node whose replies the programs filter (its port filter
/// or its LB IP's source ranges): the pods whose flows are remembered.
pub fn guarded_local_pod(i: &AddrInfo) -> bool {
    i.flags & (addr::POD | addr::LOCAL) == addr::POD | addr::LOCAL
        && i.flags & (addr::FILTERED | addr::RANGED) != 0
}

/// The filtered or ranged pod of this node whose flow `t` is, if any:
/// `t` leaves from the pod's IP or from its LB IP.
fn pod_of(t: &Tracked, addrs: &HashMap<IpAddr, AddrInfo>) -> Option<(IpAddr, u16)> {
    let src = addrs.get(&t.src)?;
    let pod = if src.flags & addr::POD != 0 {
        t.src
    } else if src.flags & (addr::LB | addr::LOCAL | addr::UNMAPPED) == addr::LB | addr::LOCAL {
        IpAddr::from(src.peer)
    } else {
        return None;
    };
    let info = addrs.get(&pod).filter(|i| guarded_local_pod(i))?;
    Some((pod, info.slot))
}

/// The state the programs would have given the flow (see the programs'
/// `state_of`), from what conntrack saw of it.
fn state_of(t: &Tracked) -> u8 {
    match (t.ends, t.tcp_state) {
        (Ends::Ports(..), Some(s)) => match s {
            tcp_state::SYN_SENT | tcp_state::SYN_SENT2 => flow::TCP_OPENING,
            // SYN_RECV (the far end answered) and a flow conntrack
            // picked up midway: both ways speak.
            0 | tcp_state::SYN_RECV | tcp_state::ESTABLISHED => flow::TCP_ESTABLISHED,
            _ => flow::TCP_CLOSING,
        },
        (Ends::Ports(..), None) if t.seen_reply => flow::UDP_REPLIED,
        (Ends::Ports(..), None) => flow::UDP,
        (Ends::Icmp { .. }, _) => flow::OTHER,
    }
}

/// The flows of `tracked` that filtered or ranged pods of this node
/// started, keyed as the programs key them (`addrs`: what the `addrs` map
/// holds). An ICMP entry counts only if it began with the pod's echo
/// request.
pub fn pod_flows(tracked: &[Tracked], addrs: &HashMap<IpAddr, AddrInfo>) -> Vec<PodFlow> {
    tracked
        .iter()
        .filter_map(|t| {
            let (pod, slot) = pod_of(t, addrs)?;
            let (pod_port, peer_port) = match t.ends {
                Ends::Ports(s, d) => (s, d),
                Ends::Icmp { icmp_type, id } => {
                    let request = if pod.is_ipv4() { 8 } else { 128 };
                    if icmp_type != request {
                        return None;
                    }
                    (id, 0)
                }
            };
            Some(PodFlow {
                key: FlowKey {
                    pod: key(&pod),
                    peer: key(&t.dst),
                    proto: t.proto,
                    pod_port,
                    peer_port,
                    ..Default::default()
                },
                state: state_of(t),
                slot,
            })
        })
        .collect()
}

impl Maps {
    /// Remembers `flows` (seen at `now_ns`, the programs' clock) where the
    /// programs have not, each pod within its quota, and recounts. Returns
    /// how many were added.
    pub fn remember_flows(&mut self, flows: &[PodFlow], now_ns: u64) -> Result<usize, EbpfError> {
        let mut per_pod: BTreeMap<IpKey, usize> = BTreeMap::new();
        for k in self.flows.keys() {
            *per_pod
                .entry(k.map_err(named(names::FLOWS))?.pod)
                .or_default() += 1;
        }
        let mut added = 0;
        for f in flows {
            let n = per_pod.entry(f.key.pod).or_default();
            if *n >= limits::FLOWS_PER_POD {
                continue;
            }
            let state = FlowState {
                last_seen_ns: now_ns,
                state: f.state,
                ..Default::default()
            };
            match self.flows.insert(f.key, state, BPF_NOEXIST) {
                Ok(()) => {
                    *n += 1;
                    added += 1;
                }
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(named(names::FLOWS)(e)),
            }
        }
        self.count_flows(true, &Default::default())?;
        Ok(added)
    }

    /// What `addrs` holds, by address.
    pub fn addr_infos(&self) -> Result<HashMap<IpAddr, AddrInfo>, EbpfError> {
        Ok((self.entries()?.into_iter())
            .map(|(k, v)| (IpAddr::from(k), v))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    fn info(flags: u16, peer: &str, slot: u16) -> AddrInfo {
        AddrInfo {
            peer: key(&ip(peer)),
            flags,
            slot,
            ..Default::default()
        }
    }

    /// One filtered pod (192.0.2.10 behind 203.0.113.10, slot 3), one
    /// whole-IP pod (192.0.2.11 behind 203.0.113.11) and another node's
    /// filtered pod (192.0.2.12 behind 203.0.113.12).
    fn addrs() -> HashMap<IpAddr, AddrInfo> {
        let (pod, lb, local) = (addr::POD, addr::LB, addr::LOCAL);
        HashMap::from([
            (
                ip("192.0.2.10"),
                info(pod | local | addr::FILTERED, "203.0.113.10", 3),
            ),
            (
                ip("203.0.113.10"),
                info(lb | local | addr::FILTERED, "192.0.2.10", 3),
            ),
            (ip("192.0.2.11"), info(pod | local, "203.0.113.11", 4)),
            (ip("203.0.113.11"), info(lb | local, "192.0.2.11", 4)),
            (
                ip("192.0.2.12"),
                info(pod | addr::FILTERED, "203.0.113.12", 0),
            ),
            (
                ip("203.0.113.12"),
                info(lb | addr::FILTERED, "192.0.2.12", 0),
            ),
        ])
    }

    fn tracked(src: &str, dst: &str, proto: u8, ends: Ends) -> Tracked {
        Tracked {
            proto,
            src: ip(src),
            dst: ip(dst),
            ends,
            tcp_state: (proto == 6).then_some(tcp_state::ESTABLISHED),
            seen_reply: true,
        }
    }

    #[test]
    fn a_filtered_pods_flows_are_taken_from_its_lb_ip_and_its_own_ip() {
        let out = tracked("203.0.113.10", "198.51.100.1", 17, Ends::Ports(40000, 53));
        let inside = tracked("192.0.2.10", "192.0.2.20", 6, Ends::Ports(40001, 443));
        let got = pod_flows(&[out, inside], &addrs());
        let want = |peer: &str, proto, pod_port, peer_port, state| PodFlow {
            key: FlowKey {
                pod: key(&ip("192.0.2.10")),
                peer: key(&ip(peer)),
                proto,
                pod_port,
                peer_port,
                ..Default::default()
            },
            state,
            slot: 3,
        };
        assert_eq!(
            got,
            [
                want("198.51.100.1", 17, 40000, 53, flow::UDP_REPLIED),
                want("192.0.2.20", 6, 40001, 443, flow::TCP_ESTABLISHED),
            ]
        );
    }

    #[test]
    fn flows_toward_a_pod_and_other_pods_flows_are_not_taken() {
        let cases = [
            // From outside to the filtered pod's LB IP: not the pod's own.
            tracked("198.51.100.1", "203.0.113.10", 6, Ends::Ports(50000, 22)),
            // A whole-IP pod: nothing filters its replies.
            tracked("203.0.113.11", "198.51.100.1", 17, Ends::Ports(40000, 53)),
            // Another node's pod, and its LB IP.
            tracked("192.0.2.12", "198.51.100.1", 17, Ends::Ports(40000, 53)),
            tracked("203.0.113.12", "198.51.100.1", 17, Ends::Ports(40000, 53)),
            // The pod's echo reply to someone else's ping.
            tracked(
                "203.0.113.10",
                "198.51.100.1",
                1,
                Ends::Icmp {
                    icmp_type: 0,
                    id: 9,
                },
            ),
        ];
        assert_eq!(pod_flows(&cases, &addrs()), []);
    }

    #[test]
    fn an_echo_request_and_tcp_states_are_kept_as_the_programs_keep_them() {
        let ping = tracked(
            "203.0.113.10",
            "198.51.100.1",
            1,
            Ends::Icmp {
                icmp_type: 8,
                id: 9,
            },
        );
        let got = pod_flows(&[ping], &addrs());
        assert_eq!(
            got.iter()
                .map(|f| (f.key.pod_port, f.key.peer_port, f.state))
                .collect::<Vec<_>>(),
            [(9, 0, flow::OTHER)]
        );
        let tcp = |s| Tracked {
            tcp_state: Some(s),
            ..tracked("203.0.113.10", "198.51.100.1", 6, Ends::Ports(1, 2))
        };
        let states: Vec<u8> = [tcp_state::SYN_SENT, tcp_state::ESTABLISHED, 7]
            .into_iter()
            .map(|s| state_of(&tcp(s)))
            .collect();
        assert_eq!(
            states,
            [flow::TCP_OPENING, flow::TCP_ESTABLISHED, flow::TCP_CLOSING]
        );
        let quiet = Tracked {
            seen_reply: false,
            ..tracked("203.0.113.10", "198.51.100.1", 17, Ends::Ports(1, 2))
        };
        assert_eq!(state_of(&quiet), flow::UDP);
    }
}
