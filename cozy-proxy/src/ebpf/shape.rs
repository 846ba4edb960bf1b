//! Node shapes the programs cannot serve, found at start: `--backend auto`
//! then takes nftables (and says why), `--backend ebpf` refuses to start.
//! (Kube-OVN's `ovn0` is not one: the programs mark the hairpins it
//! carries for one masquerade rule, `hairpin.rs`.)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, kind: &str, lower: Option<u32>) -> Link {
        Link {
            index,
            name: name.into(),
            kind: ARPHRD_ETHER,
            peer_elsewhere: false,
            peer_ns: None,
            master: None,
            info_kind: kind.into(),
            slave_kind: String::new(),
            lower,
            xdp: None,
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
}
