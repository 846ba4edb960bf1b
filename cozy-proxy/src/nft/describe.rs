//! Golden tests of the pure encoder: a batch decoded with the project's own
//! codec into one line per message, in `nft`-like words, compared with the
//! text it must be. As kube-proxy checks its transactions against
//! `knftables.Fake`, without root and without a kernel; the real `nft -j`
//! tests (tests/nft_ruleset.rs) check the same encoder against the kernel.
use super::encode::{cleanup_batch, sync_batch, Install, ELEMENTS_PER_MESSAGE};
use super::schema::{IPV4, IPV6, LAYOUTS};
use super::sys::*;
use crate::datapath::{AllowedPort, DatapathState};
use crate::netlink::wire::{attr, attr_data, attr_str, attr_u32, attrs, messages};
use std::net::IpAddr;

fn family(f: u8) -> &'static str {
    match f {
        NFPROTO_IPV4 => "ip",
        NFPROTO_IPV6 => "ip6",
        super::ports::NFPROTO_BRIDGE => "bridge",
        _ => "unspec",
    }
}

fn address(b: &[u8]) -> String {
    match b.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(b).expect("4 bytes")).to_string(),
        16 => IpAddr::from(<[u8; 16]>::try_from(b).expect("16 bytes")).to_string(),
        _ => format!("{b:?}"),
    }
}

/// `addr . proto . port` for a port key, `addr . ifN` for a path key,
/// `addr . addr` for a range key, the address otherwise.
fn key_text(set: &str, k: &[u8]) -> String {
    for l in LAYOUTS {
        let n = l.addr_len as usize;
        match set {
            super::schema::ALLOWED_PORTS => {
                if let Some((ip, proto, port)) = l.parse_port_key(k) {
                    return format!("{ip} . {proto} . {port}");
                }
            }
            super::schema::GUARD_PATHS | "guard_ports4" | "guard_ports6" if k.len() == n + 4 => {
                if let Some((ip, index)) = l.parse_path_key(k) {
                    return format!("{ip} . if{index}");
                }
            }
            super::schema::SOURCE_RANGES if k.len() == 2 * n => {
                return format!("{} . {}", address(&k[..n]), address(&k[n..]));
            }
            _ => {}
        }
    }
    address(k)
}

fn expressions(rule: &[u8]) -> String {
    let Some(exprs) = attr(rule, NFTA_RULE_EXPRESSIONS) else {
        return String::new();
    };
    attrs(exprs)
        .filter_map(|(_, e)| attr_str(e, NFTA_EXPR_NAME))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line per message of the batch (BATCH_BEGIN/END left out).
pub fn describe(bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for m in messages(bytes) {
        if m.msg_type >> 8 != NFNL_SUBSYS_NFTABLES {
            continue;
        }
        let fam = family(m.payload[0]);
        let body = &m.payload[4..];
        let name = |a| attr_str(body, a).unwrap_or_default();
        let line = match m.msg_type & 0xff {
            NFT_MSG_NEWTABLE => format!(
                "add table {fam} {} (mark {}{})",
                name(NFTA_TABLE_NAME),
                attr(body, NFTA_TABLE_USERDATA).is_some_and(|u| u == super::schema::SCHEMA_MARK),
                match attr_u32(body, NFTA_TABLE_FLAGS) {
                    Some(f) if f & NFT_TABLE_F_DORMANT != 0 => ", dormant",
                    _ => "",
                }
            ),
            NFT_MSG_DELTABLE => format!("delete table {fam} {}", name(NFTA_TABLE_NAME)),
            NFT_MSG_NEWSET => format!(
                "add set {fam} {} key {}/{} data {:?} flags {}",
                name(NFTA_SET_NAME),
                attr_u32(body, NFTA_SET_KEY_TYPE).unwrap_or(0),
                attr_u32(body, NFTA_SET_KEY_LEN).unwrap_or(0),
                attr_u32(body, NFTA_SET_DATA_TYPE).zip(attr_u32(body, NFTA_SET_DATA_LEN)),
                attr_u32(body, NFTA_SET_FLAGS).unwrap_or(0),
            ),
            NFT_MSG_NEWCHAIN => {
                let hook = attr(body, NFTA_CHAIN_HOOK).unwrap_or(&[]);
                format!(
                    "add chain {fam} {} hook {} priority {} type {}",
                    name(NFTA_CHAIN_NAME),
                    attr_u32(hook, NFTA_HOOK_HOOKNUM).unwrap_or(99),
                    attr_u32(hook, NFTA_HOOK_PRIORITY).unwrap_or(0) as i32,
                    name(NFTA_CHAIN_TYPE)
                )
            }
            NFT_MSG_DELRULE => format!("flush chain {fam} {}", name(NFTA_RULE_CHAIN)),
            NFT_MSG_NEWRULE => format!(
                "add rule {fam} {}: {}",
                name(NFTA_RULE_CHAIN),
                expressions(body)
            ),
            t @ (NFT_MSG_NEWSETELEM | NFT_MSG_DELSETELEM) => {
                let set = name(NFTA_SET_ELEM_LIST_SET);
                let list = attr(body, NFTA_SET_ELEM_LIST_ELEMENTS).unwrap_or(&[]);
                let elems: Vec<String> = attrs(list)
                    .map(|(_, e)| {
                        let mut text =
                            key_text(&set, attr_data(e, NFTA_SET_ELEM_KEY).unwrap_or(&[]));
                        if let Some(end) = attr_data(e, NFTA_SET_ELEM_KEY_END) {
                            text += &format!(" - {}", key_text(&set, end));
                        }
                        if attr_u32(e, NFTA_SET_ELEM_FLAGS)
                            .is_some_and(|f| f & NFT_SET_ELEM_INTERVAL_END != 0)
                        {
                            text += " (end)";
                        }
                        match attr_data(e, NFTA_SET_ELEM_DATA) {
                            Some(v) => format!("{text} : {}", address(v)),
                            None => text,
                        }
                    })
                    .collect();
                let verb = if t == NFT_MSG_NEWSETELEM {
                    "add"
                } else {
                    "delete"
                };
                format!("{verb} element {fam} {set} {{ {} }}", elems.join(", "))
            }
            other => format!("message {other}"),
        };
        out.push(line);
    }
    out
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test constant")
}

fn state(entries: &[(&str, &str)], filtered: &[(&str, u8, u16)]) -> DatapathState {
    let mut s = DatapathState::default();
    for (lb, pod) in entries {
        s.svc_pod.insert(ip(lb), ip(pod));
        s.pod_svc.insert(ip(pod), ip(lb));
    }
    for (pod, proto, port) in filtered {
        s.filtered_pods.insert(ip(pod));
        s.allowed_ports.insert(AllowedPort {
            pod: ip(pod),
            proto: *proto,
            port: *port,
        });
    }
    s
}

#[test]
fn a_first_sync_creates_both_tables_and_their_elements_in_one_batch() {
    let desired = state(
        &[
            ("203.0.113.10", "192.0.2.11"),
            ("2001:db8:203::10", "2001:db8:2::11"),
        ],
        &[("192.0.2.11", 6, 22)],
    );
    let diff = DatapathState::default().diff(&desired);
    let batch = sync_batch(
        &[
            (IPV4.table(), Install::Create),
            (IPV6.table(), Install::Nothing),
        ],
        &diff,
        &diff.guard,
        false,
    );
    let lines = describe(batch.bytes());
    let want = [
        "add table ip cozy_proxy (mark true)",
        "add set ip pod_svc key 7/4 data Some((7, 4)) flags 8",
        "add set ip svc_pod key 7/4 data Some((7, 4)) flags 8",
        "add set ip remote key 7/4 data Some((7, 4)) flags 8",
        "add set ip filtered_pods key 7/4 data None flags 0",
        "add set ip allowed_ports key 29453/12 data None flags 0",
        "add set ip icmp_allowed_pods key 7/4 data None flags 0",
        "add set ip unmapped_lbs key 7/4 data None flags 0",
        // interval
        "add set ip cluster key 7/4 data None flags 4",
        "add set ip ranged_lbs key 7/4 data None flags 0",
        // ipv4_addr . ipv4_addr, interval and concatenated (pipapo)
        "add set ip source_ranges key 455/8 data None flags 132",
        "add set ip guarded key 7/4 data None flags 0",
        // ipv4_addr . iface_index
        "add set ip guard_paths key 468/8 data None flags 0",
        "add chain ip egress_snat hook 0 priority -300 type filter",
        "flush chain ip egress_snat",
        "add rule ip egress_snat: meta cmp payload cmp cmp payload lookup payload lookup fib cmp payload",
        "add rule ip egress_snat: meta cmp payload cmp cmp payload lookup payload lookup fib cmp payload",
        "add rule ip egress_snat: payload lookup immediate",
        "add rule ip egress_snat: payload meta lookup counter immediate",
        "add rule ip egress_snat: payload lookup payload lookup fib cmp payload counter",
        "add chain ip ingress_dnat hook 0 priority -150 type filter",
        "flush chain ip ingress_dnat",
        "add rule ip ingress_dnat: meta cmp payload cmp cmp payload lookup payload lookup payload",
        "add rule ip ingress_dnat: meta cmp payload cmp cmp payload lookup payload lookup payload",
        "add rule ip ingress_dnat: payload lookup payload lookup payload counter immediate",
        "add rule ip ingress_dnat: payload lookup payload lookup counter immediate",
        "add rule ip ingress_dnat: payload lookup counter immediate",
        // NF_INET_LOCAL_OUT
        "add chain ip node_errors hook 3 priority -300 type filter",
        "flush chain ip node_errors",
        "add rule ip node_errors: meta cmp payload cmp cmp payload lookup payload lookup fib cmp payload",
        "add rule ip node_errors: meta cmp payload cmp cmp payload lookup payload lookup fib cmp payload",
        "add chain ip cluster_dnat hook 0 priority -100 type nat",
        "flush chain ip cluster_dnat",
        "add rule ip cluster_dnat: payload lookup payload lookup nat",
        "add rule ip cluster_dnat: payload lookup payload lookup nat",
        // NF_INET_LOCAL_OUT
        "add chain ip local_dnat hook 3 priority -100 type nat",
        "flush chain ip local_dnat",
        "add rule ip local_dnat: payload lookup nat",
        "add rule ip local_dnat: payload lookup nat",
        "add chain ip port_filter hook 0 priority 0 type filter",
        "flush chain ip port_filter",
        "add rule ip port_filter: ct bitwise cmp immediate",
        "add rule ip port_filter: ct lookup payload lookup counter immediate",
        "add rule ip port_filter: payload lookup immediate",
        "add rule ip port_filter: meta cmp payload lookup immediate",
        "add rule ip port_filter: payload meta payload lookup immediate",
        "add rule ip port_filter: payload lookup counter immediate",
        "add chain ip hairpin_mark hook 2 priority 0 type filter",
        "flush chain ip hairpin_mark",
        "add rule ip hairpin_mark: ct bitwise cmp ct lookup meta cmp fib cmp meta bitwise meta",
        "add rule ip hairpin_mark: ct bitwise cmp ct lookup meta cmp fib cmp meta bitwise meta",
        "add chain ip hairpin_masq hook 4 priority 100 type nat",
        "flush chain ip hairpin_masq",
        "add rule ip hairpin_masq: meta bitwise cmp masq",
        "add element ip pod_svc { 192.0.2.11 : 203.0.113.10 }",
        "add element ip6 pod_svc { 2001:db8:2::11 : 2001:db8:203::10 }",
        "add element ip svc_pod { 203.0.113.10 : 192.0.2.11 }",
        "add element ip6 svc_pod { 2001:db8:203::10 : 2001:db8:2::11 }",
        "add element ip filtered_pods { 192.0.2.11 }",
        "add element ip allowed_ports { 192.0.2.11 . 6 . 22 }",
    ];
    assert_eq!(lines, want);
}

#[test]
fn a_moved_endpoint_deletes_before_it_adds_and_a_replaced_table_goes_first() {
    let before = state(&[("203.0.113.10", "192.0.2.11")], &[]);
    let after = state(&[("203.0.113.10", "192.0.2.12")], &[]);
    let diff = before.diff(&after);
    let batch = sync_batch(
        &[
            (IPV4.table(), Install::Nothing),
            (IPV6.table(), Install::Nothing),
        ],
        &diff,
        &diff.guard,
        false,
    );
    assert_eq!(
        describe(batch.bytes()),
        [
            "delete element ip pod_svc { 192.0.2.11 }",
            "delete element ip svc_pod { 203.0.113.10 }",
            "add element ip pod_svc { 192.0.2.12 : 203.0.113.10 }",
            "add element ip svc_pod { 203.0.113.10 : 192.0.2.12 }",
        ]
    );
    let none = before.diff(&before);
    let replaced = sync_batch(
        &[(IPV6.table(), Install::Replace)],
        &none,
        &none.guard,
        false,
    );
    let lines = describe(replaced.bytes());
    assert_eq!(lines[0], "delete table ip6 cozy_proxy");
    assert_eq!(lines[1], "add table ip6 cozy_proxy (mark true)");
    // A switch's standby: created dormant in the creating message itself,
    // an adopted table made dormant; woken in one batch.
    let dormant = sync_batch(
        &[
            (IPV4.table(), Install::Create),
            (IPV6.table(), Install::Nothing),
        ],
        &none,
        &none.guard,
        true,
    );
    let lines = describe(dormant.bytes());
    assert_eq!(lines[0], "add table ip cozy_proxy (mark true, dormant)");
    assert_eq!(
        lines.last().map(String::as_str),
        Some("add table ip6 cozy_proxy (mark false, dormant)")
    );
    let woken = describe(super::encode::wake_batch(&[IPV4.table(), IPV6.table()]).bytes());
    assert_eq!(
        woken,
        [
            "add table ip cozy_proxy (mark false)",
            "add table ip6 cozy_proxy (mark false)"
        ]
    );
    let rules = sync_batch(&[(IPV4.table(), Install::Rules)], &none, &none.guard, false);
    assert!(describe(rules.bytes())
        .iter()
        .any(|l| l == "flush chain ip port_filter"));
}

#[test]
fn elements_are_split_into_messages_that_fit_a_netlink_attribute() {
    let many: Vec<(String, String)> = (0..ELEMENTS_PER_MESSAGE + 5)
        .map(|i| {
            (
                format!("2001:db8:203::{:x}", i + 1),
                format!("2001:db8:2::{:x}", i + 1),
            )
        })
        .collect();
    let pairs: Vec<(&str, &str)> = many.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    let desired = state(&pairs, &[]);
    let diff = DatapathState::default().diff(&desired);
    let batch = sync_batch(&[], &diff, &diff.guard, false);
    let lines = describe(batch.bytes());
    // pod_svc and svc_pod: 800 + 5 elements each.
    assert_eq!(
        lines.len(),
        4,
        "{:?}",
        lines.iter().map(|l| l.len()).collect::<Vec<_>>()
    );
    assert_eq!(lines[0].matches(" : ").count(), ELEMENTS_PER_MESSAGE);
    assert_eq!(lines[1].matches(" : ").count(), 5);
}

#[test]
fn ranges_and_guards_are_encoded_as_the_kernel_takes_them() {
    use crate::model::IpRange;
    let mut desired = DatapathState::default();
    // An rbtree interval: its start, and the address after its end
    // flagged as the interval's end; one ending the family has no end.
    desired.cluster.insert(IpRange {
        first: ip("10.0.0.0"),
        last: ip("10.255.255.255"),
    });
    desired.cluster.insert(IpRange {
        first: ip("fe80::"),
        last: ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
    });
    desired.ranged_lbs.insert(ip("203.0.113.10"));
    desired.source_ranges.insert((
        ip("203.0.113.10"),
        IpRange {
            first: ip("198.51.100.0"),
            last: ip("198.51.100.255"),
        },
    ));
    desired.guard.insert(ip("192.0.2.11"), 7);
    desired.guard.insert(ip("203.0.113.10"), 0);
    let diff = DatapathState::default().diff(&desired);
    let lines = describe(sync_batch(&[], &diff, &diff.guard, false).bytes());
    assert_eq!(
        lines,
        [
            "add element ip cluster { 10.0.0.0, 11.0.0.0 (end) }",
            "add element ip6 cluster { fe80:: }",
            "add element ip ranged_lbs { 203.0.113.10 }",
            "add element ip source_ranges { 203.0.113.10 . 198.51.100.0 - 203.0.113.10 . 198.51.100.255 }",
            "add element ip guarded { 192.0.2.11, 203.0.113.10 }",
            "add element ip guard_paths { 192.0.2.11 . if7 }",
        ]
    );
}

#[test]
fn cleanup_deletes_only_the_tables_present() {
    let lines = describe(cleanup_batch(&[IPV6.table(), super::ports::table()]).bytes());
    assert_eq!(
        lines,
        [
            "delete table ip6 cozy_proxy",
            "delete table bridge cozy_proxy"
        ]
    );
}

/// A pod behind bridge port 9 of bridge 7, a pod whose port is not known
/// yet (entry: bridge 7), a pod on an interface of its own (5), a local LB
/// IP (no entry): the IP tables get the bridge for the first two; the
/// bridge table checks every address but the second, and gives the first
/// its port. A change of port takes out exactly what was put in.
#[test]
fn guards_behind_bridge_ports_are_checked_at_the_port() {
    use super::ports::{plan, write, Place, Placed};
    use crate::datapath::Change;
    let bridge_of = [(9u32, 7u32), (10, 7)].into_iter().collect();
    let bridges = [7u32].into_iter().collect();
    let place = |e: u32| Place::of(e, &bridge_of, &bridges);
    let guard = Change {
        remove: vec![],
        add: vec![
            (ip("192.0.2.11"), 9),
            (ip("192.0.2.12"), 7),
            (ip("192.0.2.13"), 5),
            (ip("203.0.113.10"), 0),
        ],
    };
    let mut placed = Placed::new();
    let (ip_guard, at_ports) = plan(&guard, &mut placed, place);
    let mut batch = crate::nft::batch::Batch::new();
    write(&mut batch, &at_ports);
    let diff = crate::datapath::StateDiff::default();
    let mut lines = describe(sync_batch(&[], &diff, &ip_guard, false).bytes());
    lines.extend(describe(batch.bytes()));
    assert_eq!(
        lines,
        [
            "add element ip guarded { 192.0.2.11, 192.0.2.12, 192.0.2.13, 203.0.113.10 }",
            "add element ip guard_paths { 192.0.2.11 . if7, 192.0.2.12 . if7, 192.0.2.13 . if5 }",
            "add element bridge guarded4 { 192.0.2.11, 192.0.2.13, 203.0.113.10 }",
            "add element bridge guard_ports4 { 192.0.2.11 . if9 }",
        ]
    );
    // The pod moved to port 10: out with port 9, in with port 10.
    let moved = Change {
        remove: vec![(ip("192.0.2.11"), 9)],
        add: vec![(ip("192.0.2.11"), 10)],
    };
    let (ip_guard, at_ports) = plan(&moved, &mut placed, place);
    let mut batch = crate::nft::batch::Batch::new();
    write(&mut batch, &at_ports);
    let mut lines = describe(sync_batch(&[], &diff, &ip_guard, false).bytes());
    lines.extend(describe(batch.bytes()));
    assert_eq!(
        lines,
        [
            "delete element ip guarded { 192.0.2.11 }",
            "delete element ip guard_paths { 192.0.2.11 . if7 }",
            "add element ip guarded { 192.0.2.11 }",
            "add element ip guard_paths { 192.0.2.11 . if7 }",
            "delete element bridge guarded4 { 192.0.2.11 }",
            "delete element bridge guard_ports4 { 192.0.2.11 . if9 }",
            "add element bridge guarded4 { 192.0.2.11 }",
            "add element bridge guard_ports4 { 192.0.2.11 . if10 }",
        ]
    );
}
