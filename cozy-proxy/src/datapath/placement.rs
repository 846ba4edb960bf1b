//! What a node does with each LB IP, and why, as `cozy-proxy dump` shows
//! it: from the state read back from the kernel (a translated LB IP, one
//! steered to another node, one dropped) and the controller's word on the
//! mappings several nodes' endpoints hold (a VM migrating), where the
//! reason is a route, not the endpoints alone.
use super::{DatapathState, SharedMapping};
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, net::IpAddr};

/// One LB IP as this node holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub lb_ip: IpAddr,
    /// Its pod (none for a dropped LB IP).
    pub pod_ip: Option<IpAddr>,
    /// `translated`, `steered` (to where its host route leads) or
    /// `dropped`.
    pub here: String,
    /// The nodes its endpoints name, where the controller said (the
    /// mappings on several nodes).
    pub nodes: Option<String>,
    pub why: String,
}

/// What the controller said, as `dump` got it.
#[derive(Clone, Debug)]
pub enum ControllerWord {
    /// Its mappings on several nodes.
    Shared(Vec<SharedMapping>),
    /// Not asked (`--controller ""`).
    NotAsked,
    /// It did not answer: why.
    Silent(String),
}

/// Every LB IP of `state`, in address order. A mapping the controller
/// reports as shared takes its reason from the controller; the others'
/// reasons follow from the state alone: a node translates the LB IPs
/// whose endpoint it hosts and steers the others to their node.
pub fn placements(state: &DatapathState, word: &ControllerWord) -> Vec<Placement> {
    let shared: BTreeMap<IpAddr, &SharedMapping> = match word {
        ControllerWord::Shared(s) => s.iter().map(|m| (m.lb_ip, m)).collect(),
        _ => BTreeMap::new(),
    };
    let unknown = match word {
        ControllerWord::Silent(e) => format!("; the controller did not say more ({e})"),
        _ => String::new(),
    };
    let placed = |lb: &IpAddr, pod: &IpAddr, translated: bool| {
        let here = match (translated, state.routes.get(lb)) {
            (true, _) => "translated".to_string(),
            (false, Some(hop)) => match hop.gateway {
                Some(gw) => format!("steered via {gw}"),
                None => "steered nowhere (unreachable)".to_string(),
            },
            (false, None) => "steered (no route yet)".to_string(),
        };
        let (nodes, why) = match shared.get(lb) {
            Some(s) => (Some(s.nodes.clone()), s.why.clone()),
            None if translated => (None, format!("its endpoint is on this node{unknown}")),
            None => (None, format!("its endpoint is on another node{unknown}")),
        };
        Placement {
            lb_ip: *lb,
            pod_ip: Some(*pod),
            here,
            nodes,
            why,
        }
    };
    let mut out: Vec<Placement> = (state.svc_pod.iter())
        .map(|(lb, pod)| placed(lb, pod, true))
        .chain(state.remote.iter().map(|(lb, pod)| placed(lb, pod, false)))
        .chain(state.unmapped_lbs.iter().map(|lb| Placement {
            lb_ip: *lb,
            pod_ip: None,
            here: "dropped".into(),
            nodes: None,
            why: "a managed Service with no mapping (see its Events)".into(),
        }))
        .collect();
    out.sort_by_key(|p| p.lb_ip);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::NextHop;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn state() -> DatapathState {
        let mut s = DatapathState::default();
        s.svc_pod.insert(ip("203.0.113.10"), ip("192.0.2.10"));
        s.remote.insert(ip("203.0.113.11"), ip("192.0.2.11"));
        s.remote.insert(ip("203.0.113.12"), ip("192.0.2.12"));
        s.unmapped_lbs.insert(ip("203.0.113.13"));
        for lb in ["203.0.113.11", "203.0.113.12"] {
            s.routes.insert(
                ip(lb),
                NextHop {
                    gateway: Some(ip("198.51.100.3")),
                    oif: 2,
                    onlink: false,
                    src: None,
                },
            );
        }
        s
    }

    /// A migrating VM's LB IP steered by this node says the route's
    /// reason, and which nodes hold it; the others say their endpoint's.
    #[test]
    fn each_lb_ip_says_what_this_node_does_and_why() {
        let word = ControllerWord::Shared(vec![SharedMapping {
            lb_ip: ip("203.0.113.12"),
            nodes: "node1,node2".into(),
            translated_here: false,
            why: "route via 198.51.100.3 (node2)".into(),
        }]);
        let got: Vec<(String, String, String)> = placements(&state(), &word)
            .into_iter()
            .map(|p| (p.lb_ip.to_string(), p.here, p.why))
            .collect();
        let want = [
            ("203.0.113.10", "translated", "its endpoint is on this node"),
            (
                "203.0.113.11",
                "steered via 198.51.100.3",
                "its endpoint is on another node",
            ),
            (
                "203.0.113.12",
                "steered via 198.51.100.3",
                "route via 198.51.100.3 (node2)",
            ),
            (
                "203.0.113.13",
                "dropped",
                "a managed Service with no mapping (see its Events)",
            ),
        ]
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()));
        assert_eq!(got, want);
        let shared = placements(&state(), &word);
        assert_eq!(shared[2].nodes.as_deref(), Some("node1,node2"));
    }

    /// A controller that does not answer leaves the reasons from the state,
    /// saying that more may be known.
    #[test]
    fn a_silent_controller_is_said() {
        let word = ControllerWord::Silent("connection refused".into());
        let p = placements(&state(), &word);
        assert_eq!(
            p[0].why,
            "its endpoint is on this node; the controller did not say more (connection refused)"
        );
    }
}
