//! Golden tests of the pure encoder: a batch decoded with the project's own
//! codec into one line per message, rules in `nft` syntax read back from
//! their expressions (fields from payload offsets, concatenations from
//! registers, the set each lookup names), compared with the text it must
//! be: a wrong set, register or offset shows. As kube-proxy checks its transactions against
//! `knftables.Fake`, without root and without a kernel; the real `nft -j`
//! tests (tests/nft_ruleset.rs) check the same encoder against the kernel.
use super::encode::{cleanup_batch, sync_batch, Install, ELEMENTS_PER_MESSAGE};
use super::schema::{IPV4, IPV6, LAYOUTS};
use super::sys::*;
use crate::datapath::{AllowedPort, DatapathState};
use crate::netlink::wire::{attr, attr_data, attr_str, attr_u32, attrs, messages};
use std::{collections::BTreeMap, net::IpAddr};

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

/// A register's contents while a rule is read: its text and its length.
type Regs = BTreeMap<u32, (String, u32)>;

/// The first 32-bit slot of register `r` (the four 16-byte registers are
/// four slots each).
fn slot(r: u32) -> u32 {
    if r >= NFT_REG32_00 {
        r - NFT_REG32_00
    } else {
        r.saturating_sub(1) * 4
    }
}

/// The concatenation of `len` bytes from register `r` on, as loaded.
fn key_of(regs: &Regs, r: u32, len: u32) -> String {
    let (mut at, mut covered, mut parts) = (slot(r), 0, Vec::new());
    while covered < len.max(1) {
        let Some((text, n)) = regs.get(&at) else {
            parts.push(format!("reg{at}"));
            break;
        };
        parts.push(text.clone());
        covered += n.div_ceil(4) * 4;
        at += n.div_ceil(4);
    }
    parts.join(" . ")
}

/// A header field in `nft` words: addresses and ports by name, the rest as
/// raw payload (`@nh` / `@th`, offset and length in bits).
fn field(base: u32, offset: u32, len: u32) -> String {
    match (base, offset, len) {
        (NFT_PAYLOAD_NETWORK_HEADER, 12, 4) => "ip saddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 16, 4) => "ip daddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 8, 16) => "ip6 saddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 24, 16) => "ip6 daddr".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2) => "th sport".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2) => "th dport".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1) => "icmp type".into(),
        _ => {
            let header = match base {
                NFT_PAYLOAD_NETWORK_HEADER => "nh",
                NFT_PAYLOAD_TRANSPORT_HEADER => "th",
                _ => "ll",
            };
            format!("@{header},{},{}", offset * 8, len * 8)
        }
    }
}

fn meta_key(key: u32) -> String {
    match key {
        NFT_META_PROTOCOL => "meta protocol".into(),
        NFT_META_MARK => "meta mark".into(),
        NFT_META_IIF => "iif".into(),
        NFT_META_L4PROTO => "meta l4proto".into(),
        NFT_META_OIFKIND => "meta oifkind".into(),
        other => format!("meta key{other}"),
    }
}

fn ct_key(key: u32, original: bool) -> String {
    let dir = if original { "original " } else { "" };
    match key {
        NFT_CT_STATE => "ct state".into(),
        NFT_CT_STATUS => "ct status".into(),
        NFT_CT_DST_IP => format!("ct {dir}ip daddr"),
        NFT_CT_DST_IP6 => format!("ct {dir}ip6 daddr"),
        other => format!("ct key{other}"),
    }
}

fn hex(b: &[u8]) -> String {
    let digits: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("0x{digits}")
}

/// The names of the bits of `v` set (`names`), or its hex.
fn flags(v: u32, names: &[(u32, &str)]) -> String {
    let set: Vec<&str> = (names.iter())
        .filter(|(bit, _)| v & bit != 0)
        .map(|(_, n)| *n)
        .collect();
    let known = names.iter().fold(0, |acc, (bit, _)| acc | bit);
    match (v, v & !known) {
        (0, _) => "0".into(),
        (_, 0) => set.join("|"),
        _ => format!("{v:#x}"),
    }
}

/// A value compared with (or masking) `left`, in the words `nft` prints.
fn value(left: &str, data: &[u8]) -> String {
    let host = || data.try_into().map(u32::from_ne_bytes).ok();
    if left.ends_with("addr") && matches!(data.len(), 4 | 16) {
        return address(data);
    }
    match (left, data, host()) {
        ("meta l4proto", [p], _) => match p {
            6 => "tcp".into(),
            17 => "udp".into(),
            1 => "icmp".into(),
            58 => "ipv6-icmp".into(),
            132 => "sctp".into(),
            other => other.to_string(),
        },
        ("icmp type", [t], _) => t.to_string(),
        ("th sport" | "th dport", [hi, lo], _) => u16::from_be_bytes([*hi, *lo]).to_string(),
        ("fib daddr type", _, Some(RTN_UNICAST)) => "unicast".into(),
        ("ct state", _, Some(v)) => flags(v, &[(2, "established"), (4, "related"), (8, "new")]),
        ("ct status", _, Some(v)) => flags(v, &[(0x10, "snat"), (0x20, "dnat")]),
        ("meta mark" | "fib daddr . iif oif", _, Some(v)) => format!("{v:#x}"),
        ("meta oifkind", _, _) => {
            let name: String = (data.iter())
                .take_while(|b| **b != 0)
                .map(|b| *b as char)
                .collect();
            format!("\"{name}\"")
        }
        _ => hex(data),
    }
}

fn verdict(code: u32) -> String {
    match code as i32 {
        0 => "drop".into(),
        1 => "accept".into(),
        -1 => "continue".into(),
        -2 => "break".into(),
        -5 => "return".into(),
        other => format!("verdict {other}"),
    }
}

/// A rule's expressions in `nft` syntax: loads fill registers, the
/// statements that read them are printed (`ip saddr @guarded ip saddr .
/// iif != @guard_paths counter drop`). `key_lens`: each set's key length,
/// for concatenations.
fn expressions(rule: &[u8], key_lens: &BTreeMap<String, u32>) -> String {
    let Some(exprs) = attr(rule, NFTA_RULE_EXPRESSIONS) else {
        return String::new();
    };
    let mut regs = Regs::new();
    let mut out: Vec<String> = Vec::new();
    for (_, e) in attrs(exprs) {
        let name = attr_str(e, NFTA_EXPR_NAME).unwrap_or_default();
        let d = attr(e, NFTA_EXPR_DATA).unwrap_or(&[]);
        let u = |a| attr_u32(d, a).unwrap_or(0);
        let text_of = |regs: &Regs, r: u32| {
            regs.get(&slot(r))
                .map_or_else(|| format!("reg{r}"), |(t, _)| t.clone())
        };
        match name.as_str() {
            "payload" if attr(d, NFTA_PAYLOAD_DREG).is_some() => {
                let len = u(NFTA_PAYLOAD_LEN);
                let f = field(u(NFTA_PAYLOAD_BASE), u(NFTA_PAYLOAD_OFFSET), len);
                regs.insert(slot(u(NFTA_PAYLOAD_DREG)), (f, len));
            }
            "payload" => {
                let f = field(
                    u(NFTA_PAYLOAD_BASE),
                    u(NFTA_PAYLOAD_OFFSET),
                    u(NFTA_PAYLOAD_LEN),
                );
                out.push(format!("{f} set {}", text_of(&regs, u(NFTA_PAYLOAD_SREG))));
            }
            "meta" if attr(d, NFTA_META_SREG).is_some() => {
                let value = text_of(&regs, u(NFTA_META_SREG));
                out.push(format!("{} set {value}", meta_key(u(NFTA_META_KEY))));
            }
            "meta" => {
                let key = meta_key(u(NFTA_META_KEY));
                let len = if key == "meta l4proto" { 1 } else { 4 };
                regs.insert(slot(u(NFTA_META_DREG)), (key, len));
            }
            "ct" => {
                let original = attr(d, NFTA_CT_DIRECTION).is_some();
                let key = ct_key(u(NFTA_CT_KEY), original);
                let len = if key.ends_with("ip6 daddr") { 16 } else { 4 };
                regs.insert(slot(u(NFTA_CT_DREG)), (key, len));
            }
            "fib" => {
                let key = if u(NFTA_FIB_FLAGS) & NFTA_FIB_F_IIF != 0 {
                    "fib daddr . iif oif"
                } else {
                    "fib daddr type"
                };
                regs.insert(slot(u(NFTA_FIB_DREG)), (key.into(), 4));
            }
            "bitwise" => {
                let r = u(NFTA_BITWISE_SREG);
                let mask = attr_data(d, NFTA_BITWISE_MASK).unwrap_or(&[]);
                let xor = attr_data(d, NFTA_BITWISE_XOR).unwrap_or(&[]);
                let source = text_of(&regs, r);
                let mut t = format!("{source} & {}", value(&source, mask));
                if xor.iter().any(|b| *b != 0) {
                    t += &format!(" ^ {}", value(&source, xor));
                }
                let len = u(NFTA_BITWISE_LEN);
                regs.insert(slot(u(NFTA_BITWISE_DREG)), (t, len));
            }
            "cmp" => {
                let left = text_of(&regs, u(NFTA_CMP_SREG));
                let data = attr_data(d, NFTA_CMP_DATA).unwrap_or(&[]);
                let op = match u(NFTA_CMP_OP) {
                    NFT_CMP_EQ => "",
                    NFT_CMP_NEQ => "!= ",
                    NFT_CMP_LTE => "<= ",
                    NFT_CMP_GTE => ">= ",
                    other => return format!("cmp op {other}"),
                };
                let base = left.split(" & ").next().unwrap_or(&left).to_string();
                out.push(format!("{left} {op}{}", value(&base, data)));
            }
            "lookup" => {
                let set = attr_str(d, NFTA_LOOKUP_SET).unwrap_or_default();
                let len = key_lens.get(&set).copied().unwrap_or(4);
                let key = key_of(&regs, u(NFTA_LOOKUP_SREG), len);
                match attr(d, NFTA_LOOKUP_DREG) {
                    Some(_) => {
                        let r = u(NFTA_LOOKUP_DREG);
                        regs.insert(slot(r), (format!("{key} map @{set}"), 16));
                    }
                    None if u(NFTA_LOOKUP_FLAGS) & NFT_LOOKUP_F_INV != 0 => {
                        out.push(format!("{key} != @{set}"))
                    }
                    None => out.push(format!("{key} @{set}")),
                }
            }
            "counter" => out.push("counter".into()),
            "immediate" => {
                let code = attr(d, NFTA_IMMEDIATE_DATA)
                    .and_then(|v| attr(v, NFTA_DATA_VERDICT))
                    .and_then(|v| attr_u32(v, NFTA_VERDICT_CODE));
                match code {
                    Some(c) => out.push(verdict(c)),
                    None => out.push("immediate".into()),
                }
            }
            "nat" => {
                let fam = if u(NFTA_NAT_FAMILY) == NFPROTO_IPV6 as u32 {
                    "ip6"
                } else {
                    "ip"
                };
                let to = text_of(&regs, u(NFTA_NAT_REG_ADDR_MIN));
                out.push(format!("dnat {fam} to {to}"));
            }
            "masq" => out.push("masquerade".into()),
            other => out.push(other.to_string()),
        }
    }
    out.join(" ")
}

/// One line per message of the batch (BATCH_BEGIN/END left out).
pub fn describe(bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut key_lens = BTreeMap::new();
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
            NFT_MSG_NEWSET => {
                key_lens.insert(
                    name(NFTA_SET_NAME),
                    attr_u32(body, NFTA_SET_KEY_LEN).unwrap_or(4),
                );
                format!(
                    "add set {fam} {} key {}/{} data {:?} flags {}",
                    name(NFTA_SET_NAME),
                    attr_u32(body, NFTA_SET_KEY_TYPE).unwrap_or(0),
                    attr_u32(body, NFTA_SET_KEY_LEN).unwrap_or(0),
                    attr_u32(body, NFTA_SET_DATA_TYPE).zip(attr_u32(body, NFTA_SET_DATA_LEN)),
                    attr_u32(body, NFTA_SET_FLAGS).unwrap_or(0),
                )
            }
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
                expressions(body, &key_lens)
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
        "add rule ip egress_snat: meta l4proto icmp icmp type >= 3 icmp type <= 5 ip daddr != @cluster fib daddr type unicast @th,192,32 set @th,192,32 map @pod_svc",
        "add rule ip egress_snat: meta l4proto icmp icmp type >= 11 icmp type <= 12 ip daddr != @cluster fib daddr type unicast @th,192,32 set @th,192,32 map @pod_svc",
        "add rule ip egress_snat: ip saddr != @guarded accept",
        "add rule ip egress_snat: ip saddr . iif != @guard_paths counter drop",
        "add rule ip egress_snat: ip daddr != @cluster fib daddr type unicast ip saddr set ip saddr map @pod_svc counter",
        "add chain ip ingress_dnat hook 0 priority -150 type filter",
        "flush chain ip ingress_dnat",
        "add rule ip ingress_dnat: meta l4proto icmp icmp type >= 3 icmp type <= 5 ip saddr != @cluster @th,160,32 set @th,160,32 map @svc_pod",
        "add rule ip ingress_dnat: meta l4proto icmp icmp type >= 11 icmp type <= 12 ip saddr != @cluster @th,160,32 set @th,160,32 map @svc_pod",
        "add rule ip ingress_dnat: ip saddr != @cluster ip daddr set ip daddr map @svc_pod counter accept",
        "add rule ip ingress_dnat: ip daddr @svc_pod ip saddr != @cluster counter drop",
        "add rule ip ingress_dnat: ip daddr @unmapped_lbs counter drop",
        // NF_INET_LOCAL_OUT
        "add chain ip node_errors hook 3 priority -300 type filter",
        "flush chain ip node_errors",
        "add rule ip node_errors: meta l4proto icmp icmp type >= 3 icmp type <= 5 ip daddr != @cluster fib daddr type unicast @th,192,32 set @th,192,32 map @pod_svc",
        "add rule ip node_errors: meta l4proto icmp icmp type >= 11 icmp type <= 12 ip daddr != @cluster fib daddr type unicast @th,192,32 set @th,192,32 map @pod_svc",
        "add chain ip cluster_dnat hook 0 priority -100 type nat",
        "flush chain ip cluster_dnat",
        "add rule ip cluster_dnat: ip saddr @cluster dnat ip to ip daddr map @svc_pod",
        "add rule ip cluster_dnat: ip saddr @cluster dnat ip to ip daddr map @remote",
        // NF_INET_LOCAL_OUT
        "add chain ip local_dnat hook 3 priority -100 type nat",
        "flush chain ip local_dnat",
        "add rule ip local_dnat: dnat ip to ip daddr map @svc_pod",
        "add rule ip local_dnat: dnat ip to ip daddr map @remote",
        "add chain ip port_filter hook 0 priority 0 type filter",
        "flush chain ip port_filter",
        "add rule ip port_filter: ct state & established|related != 0 accept",
        "add rule ip port_filter: ct original ip daddr @ranged_lbs ct original ip daddr . ip saddr != @source_ranges counter drop",
        "add rule ip port_filter: ip daddr != @filtered_pods accept",
        "add rule ip port_filter: meta l4proto icmp ip daddr @icmp_allowed_pods accept",
        "add rule ip port_filter: ip daddr . meta l4proto . th dport @allowed_ports accept",
        "add rule ip port_filter: ip daddr @filtered_pods counter drop",
        "add chain ip hairpin_mark hook 2 priority 0 type filter",
        "flush chain ip hairpin_mark",
        "add rule ip hairpin_mark: ct status & dnat != 0 ct original ip daddr @svc_pod meta oifkind != \"bridge\" fib daddr . iif oif != 0x0 meta mark set meta mark & 0xffffefff ^ 0x1000",
        "add rule ip hairpin_mark: ct status & dnat != 0 ct original ip daddr @remote meta oifkind != \"bridge\" fib daddr . iif oif != 0x0 meta mark set meta mark & 0xffffefff ^ 0x1000",
        "add chain ip hairpin_masq hook 4 priority 100 type nat",
        "flush chain ip hairpin_masq",
        "add rule ip hairpin_masq: meta mark & 0x1000 != 0x0 masquerade",
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

/// The element messages `plan` makes of `guard`: the IP tables' guard
/// elements, then the bridge table's.
fn guard_lines(
    guard: &crate::datapath::Change<(IpAddr, u32)>,
    placed: &mut super::ports::Placed,
    place: impl Fn(u32) -> super::ports::Place,
) -> Vec<String> {
    let (ip_guard, at_ports) = super::ports::plan(guard, placed, place);
    let mut batch = crate::nft::batch::Batch::new();
    super::ports::write(&mut batch, &at_ports);
    let diff = crate::datapath::StateDiff::default();
    let mut lines = describe(sync_batch(&[], &diff, &ip_guard, false).bytes());
    lines.extend(describe(batch.bytes()));
    lines
}

/// A pod behind bridge port 9 of bridge 7, a pod whose port is not known
/// yet (entry: bridge 7), a pod on an interface of its own (5), a local LB
/// IP (no entry): the IP tables get the bridge for the first two; the
/// bridge table checks only the first, at its port (the others' routes
/// name no bridge port, and a bridge their route does not name does not
/// judge them). A change of port takes out exactly what was put in.
#[test]
fn guards_behind_bridge_ports_are_checked_at_the_port() {
    use super::ports::{Place, Placed};
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
    let lines = guard_lines(&guard, &mut placed, place);
    assert_eq!(placed.keys().collect::<Vec<_>>(), [&ip("192.0.2.11")]);
    assert_eq!(
        lines,
        [
            "add element ip guarded { 192.0.2.11, 192.0.2.12, 192.0.2.13, 203.0.113.10 }",
            "add element ip guard_paths { 192.0.2.11 . if7, 192.0.2.12 . if7, 192.0.2.13 . if5 }",
            "add element bridge guarded4 { 192.0.2.11 }",
            "add element bridge guard_ports4 { 192.0.2.11 . if9 }",
        ]
    );
    // The pod moved to port 10: out with port 9, in with port 10.
    let moved = Change {
        remove: vec![(ip("192.0.2.11"), 9)],
        add: vec![(ip("192.0.2.11"), 10)],
    };
    let lines = guard_lines(&moved, &mut placed, place);
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

/// Only the places behind bridge ports are kept: an address written at
/// its own interface is taken out at that interface, also after the
/// interface became a bridge's port (the links are read at each change,
/// what was written is not).
#[test]
fn an_address_written_at_its_interface_is_removed_there_after_it_joins_a_bridge() {
    use super::ports::{Place, Placed};
    use crate::datapath::Change;
    let mut placed = Placed::new();
    let no_bridges = |e: u32| Place::of(e, &Default::default(), &Default::default());
    let added = Change {
        remove: vec![],
        add: vec![(ip("192.0.2.13"), 5), (ip("203.0.113.10"), 0)],
    };
    guard_lines(&added, &mut placed, no_bridges);
    assert!(placed.is_empty(), "direct places kept: {placed:?}");
    let bridge_of = [(5u32, 7u32)].into_iter().collect();
    let bridges = [7u32].into_iter().collect();
    let now_a_port = |e: u32| Place::of(e, &bridge_of, &bridges);
    let removed = Change {
        remove: vec![(ip("192.0.2.13"), 5)],
        add: vec![],
    };
    let lines = guard_lines(&removed, &mut placed, now_a_port);
    assert_eq!(
        lines,
        [
            "delete element ip guarded { 192.0.2.13 }",
            "delete element ip guard_paths { 192.0.2.13 . if5 }",
        ]
    );
}

#[test]
fn ipv6_rules_read_with_their_own_fields_and_sets() {
    let diff = DatapathState::default().diff(&DatapathState::default());
    let batch = sync_batch(
        &[
            (IPV4.table(), Install::Nothing),
            (IPV6.table(), Install::Create),
        ],
        &diff,
        &diff.guard,
        false,
    );
    let rules: Vec<String> = describe(batch.bytes())
        .into_iter()
        .filter(|l| l.starts_with("add rule"))
        .collect();
    for want in [
        "add rule ip6 egress_snat: ip6 saddr . iif != @guard_paths counter drop",
        "add rule ip6 ingress_dnat: ip6 saddr != @cluster ip6 daddr set ip6 daddr map @svc_pod counter accept",
        "add rule ip6 cluster_dnat: ip6 saddr @cluster dnat ip6 to ip6 daddr map @svc_pod",
        "add rule ip6 port_filter: ip6 daddr . meta l4proto . th dport @allowed_ports accept",
        "add rule ip6 port_filter: ct original ip6 daddr @ranged_lbs ct original ip6 daddr . ip6 saddr != @source_ranges counter drop",
    ] {
        assert!(rules.iter().any(|r| r == want), "{want}\nnot in {rules:#?}");
    }
}
