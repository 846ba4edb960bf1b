//! Values the desired-state model works with.
use super::Cidr;
use serde::Serialize;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

/// A Service, by namespace and name. Shared strings: the plan keeps a
/// Service's name in several places (its wish, its claims, its results),
/// each a pointer to one copy, never a String per place.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ServiceRef {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ServiceRef {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        ServiceRef {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// IP address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

/// The L4 protocols a port filter can list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IANA protocol number, as in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// One `(protocol, port)` a port-filtered Service lets through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct PortRule {
    pub protocol: Protocol,
    pub port: u16,
}

/// What traffic to the LoadBalancer IP reaches the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// Every protocol and port (`wholeIP: "true"` or absent).
    Passthrough,
    /// Only the listed ports, plus replies to the pod's own flows
    /// (`wholeIP: "false"`, or an invalid value: fail closed).
    PortFilter {
        ports: BTreeSet<PortRule>,
        allow_icmp: bool,
    },
}

/// One 1:1 NAT: `lb_ip` <-> `pod_ip`, both of one family.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mapping {
    pub service: ServiceRef,
    pub lb_ip: IpAddr,
    pub pod_ip: IpAddr,
    /// The Service's, shared.
    pub mode: Arc<Mode>,
    /// The nodes whose endpoints hold the pod IP (their `nodeName`s):
    /// where the pod may be delivered, and so which nodes translate it.
    pub hosts: Hosts,
    /// `spec.loadBalancerSourceRanges` of this family: only these sources
    /// reach the pod through the LB IP. `None`: no restriction; an empty
    /// set: nothing (an invalid range fails closed).
    pub source_ranges: Option<BTreeSet<Cidr>>,
}

/// The nodes whose endpoints hold a mapping's pod IP. Usually one; two
/// while a VM live-migrates (the source and the target pod share the IP):
/// one backend on two nodes, each of which may translate it (the kernel's
/// route to the pod IP tells which one the pod is delivered at now).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Hosts {
    /// No endpoint names a node (hand-written manifests): every node
    /// translates.
    Unnamed,
    One(Arc<str>),
    /// The nodes of the ready (or serving) endpoints first, sorted, then
    /// those of endpoints still starting (a migration's target, before its
    /// readiness gate is met). The first is where other nodes steer.
    Several(Arc<[Arc<str>]>),
}

impl Hosts {
    /// From the nodes of the serving endpoints and of those starting.
    pub fn of<'a>(
        serving: impl IntoIterator<Item = &'a Arc<str>>,
        starting: impl IntoIterator<Item = &'a Arc<str>>,
    ) -> Hosts {
        let mut nodes: Vec<Arc<str>> = serving.into_iter().cloned().collect();
        for n in starting {
            if !nodes.contains(n) {
                nodes.push(n.clone());
            }
        }
        match nodes.len() {
            0 => Hosts::Unnamed,
            1 => Hosts::One(nodes.remove(0)),
            _ => Hosts::Several(nodes.into()),
        }
    }

    /// Every node named, the one other nodes steer to first.
    pub fn nodes(&self) -> &[Arc<str>] {
        match self {
            Hosts::Unnamed => &[],
            Hosts::One(n) => std::slice::from_ref(n),
            Hosts::Several(n) => n,
        }
    }

    /// Where the other nodes steer the LB IP (`None`: no node named).
    pub fn primary(&self) -> Option<&str> {
        self.nodes().first().map(|n| &**n)
    }

    /// Is `node` one of them? (Every node is, when none is named.)
    pub fn include(&self, node: &str) -> bool {
        matches!(self, Hosts::Unnamed) || self.nodes().iter().any(|n| &**n == node)
    }
}

/// The whole desired NAT state of a node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Sorted by LoadBalancer IP; no LB IP and no pod IP appears twice.
    pub mappings: Vec<Mapping>,
    /// LoadBalancer IPs of managed Services that are not mapped to any pod
    /// (no ready endpoint, several, a lost conflict): traffic to them is
    /// dropped on the node instead of being routed back out (no loop).
    pub unmapped_lb_ips: BTreeMap<IpAddr, ServiceRef>,
}

/// What became of one LB IP a Service owns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum LbResult {
    Mapped(Mapping),
    /// No single ready endpoint, or its pod lost a conflict: traffic to
    /// the LB IP is dropped.
    Unmapped(ServiceRef),
}

impl LbResult {
    /// The Service owning the LB IP.
    pub fn service(&self) -> &ServiceRef {
        match self {
            LbResult::Mapped(m) => &m.service,
            LbResult::Unmapped(s) => s,
        }
    }
}

/// An object's uid, kept small: the 16 bytes of the UUID Kubernetes gives
/// every object, or the text itself where it is not one in canonical form
/// (lowercase, hyphenated), so that it always reads back as it came; not a
/// string per Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Uid {
    Uuid([u8; 16]),
    Text(Box<str>),
}

impl Uid {
    pub fn new(text: &str) -> Uid {
        Uid::uuid(text)
            .filter(|u| u.to_string() == text)
            .unwrap_or_else(|| Uid::Text(text.into()))
    }

    fn uuid(text: &str) -> Option<Uid> {
        let hex: String = text.chars().filter(|c| *c != '-').collect();
        let n = u128::from_str_radix(&hex, 16)
            .ok()
            .filter(|_| hex.len() == 32)?;
        Some(Uid::Uuid(n.to_be_bytes()))
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Uid::Uuid(b) => {
                for (i, byte) in b.iter().enumerate() {
                    if matches!(i, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            Uid::Text(t) => f.write_str(t),
        }
    }
}

#[cfg(test)]
mod uid_tests {
    use super::Uid;

    #[test]
    fn a_uid_reads_back_as_it_came() {
        let canonical = "0b6c3a52-5d1e-4f7a-9c2b-8e1d2f3a4b5c";
        assert!(matches!(Uid::new(canonical), Uid::Uuid(_)));
        for text in [
            canonical,
            "0B6C3A52-5D1E-4F7A-9C2B-8E1D2F3A4B5C",
            "0b6c3a525d1e4f7a9c2b8e1d2f3a4b5c",
            "+b6c3a52-5d1e-4f7a-9c2b-8e1d2f3a4b5c",
            "not-a-uuid",
            "",
        ] {
            assert_eq!(Uid::new(text).to_string(), text);
        }
        assert!(matches!(Uid::new("not-a-uuid"), Uid::Text(_)));
    }
}
