//! Node shapes the programs cannot serve, found at start: `--backend auto`
//! then takes nftables (and says why), `--backend ebpf` refuses to start.
use super::Interfaces;
use crate::netlink::route::{Link, ARPHRD_ETHER};

/// Why the programs cannot serve a node with these links, if they cannot:
/// a macvlan or ipvlan interface in the node's namespace stacked on an
/// interface the programs attach to. Its frames pass the parent's hooks
/// first, addressed to it by MAC only: a guarded source arriving for it
/// looks forged there (the route says it enters by the macvlan), and
/// nothing tells it from a forgery on the parent's own traffic. (Macvlan
/// interfaces in pods' namespaces, as Multus attaches them, are not in the
/// node's and do not count.)
pub fn unserved(links: &[Link], interfaces: &Interfaces) -> Option<String> {
    let attached = |l: &Link| match interfaces {
        Interfaces::Auto => l.kind == ARPHRD_ETHER && l.name != "lo",
        Interfaces::Named(names) => names.contains(&l.name),
    };
    links
        .iter()
        .filter(|l| {
            matches!(
                l.info_kind.as_str(),
                "macvlan" | "macvtap" | "ipvlan" | "ipvtap"
            )
        })
        .find_map(|upper| {
            let lower = links.iter().find(|l| Some(l.index) == upper.lower)?;
            attached(lower).then(|| {
                format!(
                    "{} is a {} on {}: its frames pass {}'s hooks first, where the eBPF programs \
                     cannot tell them from forged ones; the nft backend serves this node",
                    upper.name, upper.info_kind, lower.name, lower.name
                )
            })
        })
}

/// Kube-OVN's gateway port, through which the node reaches every pod.
pub const KUBE_OVN_GATEWAY: &str = "ovn0";

/// Why `auto` takes nftables on a node the programs do serve, but less
/// well: Kube-OVN's (its `ovn0`). An in-cluster client of an LB IP is
/// translated on its node and sent back through `ovn0`, and OVN's router
/// answers it directly from the pod IP unless the node masquerades the
/// hairpin, which the nft backend does and the programs do not
/// (docs/traffic.md). `--backend ebpf` still runs there, with a warning.
pub fn weaker(links: &[Link]) -> Option<String> {
    links.iter().any(|l| l.name == KUBE_OVN_GATEWAY).then(|| {
        format!(
            "{KUBE_OVN_GATEWAY} (Kube-OVN): the eBPF programs do not masquerade in-cluster \
                 clients' hairpins through it, so those clients of an LB IP get no answer; \
                 the nft backend serves this node"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, kind: &str, lower: Option<u32>) -> Link {
        Link {
            index,
            name: name.into(),
            kind: ARPHRD_ETHER,
            peer_elsewhere: false,
            master: None,
            info_kind: kind.into(),
            slave_kind: String::new(),
            lower,
        }
    }

    #[test]
    fn a_macvlan_on_an_attached_interface_is_a_shape_the_programs_cannot_serve() {
        let links = [
            link(2, "eth0", "", None),
            link(3, "eth0.100", "vlan", Some(2)),
            link(4, "veth1", "veth", None),
        ];
        assert_eq!(unserved(&links, &Interfaces::Auto), None);
        let mut with = links.to_vec();
        with.push(link(5, "mv0", "macvlan", Some(2)));
        let why = unserved(&with, &Interfaces::Auto).expect("unserved");
        assert!(why.contains("mv0 is a macvlan on eth0"), "{why}");
        // Not attached to its parent: nothing passes ours first.
        assert_eq!(
            unserved(&with, &Interfaces::Named(vec!["veth1".into()])),
            None
        );
    }

    #[test]
    fn kube_ovns_gateway_port_makes_the_programs_weaker() {
        let links = [link(2, "eth0", "", None), link(4, "veth1", "veth", None)];
        assert_eq!(weaker(&links), None);
        let mut with = links.to_vec();
        with.push(link(5, "ovn0", "openvswitch", None));
        let why = weaker(&with).expect("weaker");
        assert!(why.starts_with("ovn0 (Kube-OVN)"), "{why}");
    }
}
