//! Reading our tables back from the kernel: the table and its schema mark,
//! the sets' layouts, their elements, the chains' rules and counters.
use super::batch::dump;
use super::error::{DecodeError, NftError};
use super::schema::{self, Layout, SetDef, Table, TABLE};
use super::sys::*;
use crate::datapath::{AllowedPort, DatapathState};
use crate::model::IpRange;
use crate::netlink::wire::{attr, attr_data, attr_str, attr_u32, attr_u64, attrs};
use crate::netlink::NlSocket;
use serde_json::json;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// Length of the nfgenmsg header before an answer's attributes.
const NFGENMSG_LEN: usize = 4;

/// A set element as the kernel holds it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct RawElement {
    pub(super) key: Vec<u8>,
    /// A map element's value (empty for a plain set).
    value: Vec<u8>,
    /// A concatenated interval's inclusive end (empty otherwise).
    key_end: Vec<u8>,
    /// NFT_SET_ELEM_INTERVAL_END.
    interval_end: bool,
}

/// What one family's table looks like in the kernel.
pub struct LiveTable {
    /// Written by this schema version, with the sets we expect.
    pub current: bool,
    /// Every chain present with as many rules as we install.
    pub chains_intact: bool,
    /// The elements (empty unless `current`).
    pub state: DatapathState,
}

/// The payload of an nf_tables answer, after its nfgenmsg header.
fn body(payload: &[u8]) -> &[u8] {
    payload.get(NFGENMSG_LEN..).unwrap_or(&[])
}

/// The attributes of our table in family `nfproto`, if it exists.
pub fn our_table(sock: &NlSocket, nfproto: u8) -> Result<Option<Vec<u8>>, NftError> {
    let tables = dump(sock, NFT_MSG_GETTABLE, nfproto, |_| {})?;
    Ok(tables
        .iter()
        .map(|t| body(t))
        .find(|t| attr_str(t, NFTA_TABLE_NAME).as_deref() == Some(TABLE))
        .map(<[u8]>::to_vec))
}

fn read_sets(sock: &NlSocket, nfproto: u8) -> Result<Vec<SetDef>, NftError> {
    let answers = dump(sock, NFT_MSG_GETSET, nfproto, |w| {
        w.put_str(NFTA_SET_TABLE, TABLE)
    })?;
    Ok(answers
        .iter()
        .map(|a| body(a))
        .filter(|b| attr_str(b, NFTA_SET_TABLE).as_deref() == Some(TABLE))
        .map(|b| SetDef {
            name: attr_str(b, NFTA_SET_NAME).unwrap_or_default(),
            id: 0,
            flags: attr_u32(b, NFTA_SET_FLAGS).unwrap_or(0) & schema::SET_FLAGS,
            key_type: attr_u32(b, NFTA_SET_KEY_TYPE).unwrap_or(0),
            key_len: attr_u32(b, NFTA_SET_KEY_LEN).unwrap_or(0),
            data: attr_u32(b, NFTA_SET_DATA_TYPE).zip(attr_u32(b, NFTA_SET_DATA_LEN)),
            fields: attr(b, NFTA_SET_DESC)
                .and_then(|d| attr(d, NFTA_SET_DESC_CONCAT))
                .map(|c| {
                    attrs(c)
                        .filter_map(|(_, f)| attr_u32(f, NFTA_SET_FIELD_LEN))
                        .collect()
                })
                .unwrap_or_default(),
            size: attr(b, NFTA_SET_DESC)
                .and_then(|d| attr_u32(d, NFTA_SET_DESC_SIZE))
                .unwrap_or(0),
        })
        .collect())
}

/// The elements of a set. A dump that runs while the kernel resizes the
/// set's hash table (right after a large change) can miss elements, so the
/// set is read twice and the union kept: a missed element shows in the
/// other read; nothing absent can appear.
pub(super) fn read_elements(
    sock: &NlSocket,
    nfproto: u8,
    set: &str,
) -> Result<Vec<RawElement>, NftError> {
    let mut all: BTreeSet<RawElement> = read_elements_once(sock, nfproto, set)?
        .into_iter()
        .collect();
    all.extend(read_elements_once(sock, nfproto, set)?);
    Ok(all.into_iter().collect())
}

fn read_elements_once(
    sock: &NlSocket,
    nfproto: u8,
    set: &str,
) -> Result<Vec<RawElement>, NftError> {
    let answers = dump(sock, NFT_MSG_GETSETELEM, nfproto, |w| {
        w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
        w.put_str(NFTA_SET_ELEM_LIST_SET, set);
    })?;
    let mut out = Vec::new();
    for a in &answers {
        let Some(list) = attr(body(a), NFTA_SET_ELEM_LIST_ELEMENTS) else {
            continue;
        };
        for (_, elem) in attrs(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
            let key = attr_data(elem, NFTA_SET_ELEM_KEY).ok_or_else(|| {
                DecodeError::ElementWithoutKey {
                    set: set.to_string(),
                }
            })?;
            out.push(RawElement {
                key: key.to_vec(),
                value: attr_data(elem, NFTA_SET_ELEM_DATA).unwrap_or(&[]).to_vec(),
                key_end: attr_data(elem, NFTA_SET_ELEM_KEY_END)
                    .unwrap_or(&[])
                    .to_vec(),
                interval_end: attr_u32(elem, NFTA_SET_ELEM_FLAGS)
                    .is_some_and(|f| f & NFT_SET_ELEM_INTERVAL_END != 0),
            });
        }
    }
    Ok(out)
}

/// Whether our table `t` is in the kernel, of this version (its mark and
/// sets as we create them), and with its chains as we install them (`None`:
/// absent).
pub(super) fn check_table(sock: &NlSocket, t: &Table) -> Result<Option<(bool, bool)>, NftError> {
    let Some(table) = our_table(sock, t.nfproto)? else {
        return Ok(None);
    };
    let version_ok = attr(&table, NFTA_TABLE_USERDATA) == Some(t.mark);
    let live_sets = read_sets(sock, t.nfproto)?;
    let sets_ok = t.sets.iter().all(|want| {
        live_sets.iter().any(|have| {
            SetDef {
                id: want.id,
                ..have.clone()
            } == *want
        })
    });
    // Each chain holds our rules, in order, with their contents: a rule
    // replaced by someone else has no fingerprint, or another.
    let mut chains_intact = true;
    for c in &t.chains {
        let rules = chain_rules(sock, t.nfproto, c.name)?;
        chains_intact &= rules.is_some_and(|live| {
            live.len() == c.rules.len()
                && live
                    .iter()
                    .zip(&c.rules)
                    .all(|(have, want)| rule_fingerprint(body(have)) == Some(want.fingerprint()))
        });
    }
    Ok(Some((version_ok && sets_ok, chains_intact)))
}

pub fn read_table(sock: &NlSocket, l: &Layout) -> Result<Option<LiveTable>, NftError> {
    let Some((current, chains_intact)) = check_table(sock, &l.table())? else {
        return Ok(None);
    };
    let state = match current {
        true => read_state(sock, l)?,
        false => DatapathState::default(),
    };
    Ok(Some(LiveTable {
        current,
        chains_intact,
        state,
    }))
}

/// The rules of one of our chains (`None`: no such chain).
fn chain_rules(
    sock: &NlSocket,
    nfproto: u8,
    chain: &str,
) -> Result<Option<Vec<Vec<u8>>>, NftError> {
    match dump(sock, NFT_MSG_GETRULE, nfproto, |w| {
        w.put_str(NFTA_RULE_TABLE, TABLE);
        w.put_str(NFTA_RULE_CHAIN, chain);
    }) {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The elements of one family's table. The state is built as a literal
/// naming every table, so a table added to the declaration and not read
/// here does not compile.
fn read_state(sock: &NlSocket, l: &Layout) -> Result<DatapathState, NftError> {
    let addr = |b: &[u8], set| element_addr(l, b, set);
    let map = |set: &'static str| -> Result<BTreeMap<IpAddr, IpAddr>, NftError> {
        read_elements(sock, l.nfproto, set)?
            .iter()
            .map(|e| Ok((addr(&e.key, set)?, addr(&e.value, set)?)))
            .collect()
    };
    let set = |set: &'static str| -> Result<BTreeSet<IpAddr>, NftError> {
        read_elements(sock, l.nfproto, set)?
            .iter()
            .map(|e| Ok(addr(&e.key, set)?))
            .collect()
    };
    let allowed_ports = read_elements(sock, l.nfproto, schema::ALLOWED_PORTS)?
        .iter()
        .map(|e| {
            let (pod, proto, port) = l
                .parse_port_key(&e.key)
                .ok_or(DecodeError::PortKey { len: e.key.len() })?;
            Ok(AllowedPort { pod, proto, port })
        })
        .collect::<Result<_, NftError>>()?;
    Ok(DatapathState {
        pod_svc: map(schema::POD_SVC)?,
        svc_pod: map(schema::SVC_POD)?,
        remote: map(schema::REMOTE)?,
        filtered_pods: set(schema::FILTERED_PODS)?,
        allowed_ports,
        icmp_allowed_pods: set(schema::ICMP_ALLOWED_PODS)?,
        unmapped_lbs: set(schema::UNMAPPED_LBS)?,
        cluster: intervals(read_elements(sock, l.nfproto, schema::CLUSTER)?, l)?
            .into_iter()
            .collect(),
        ranged_lbs: set(schema::RANGED_LBS)?,
        source_ranges: source_ranges(sock, l)?,
        guard: guard(sock, l)?,
        // Routes are the backend's, not a table's (`Nft::read`); the
        // planned-only tables are never held.
        routes: BTreeMap::new(),
        remote_hosts: BTreeMap::new(),
    })
}

/// An address of an element of `set`, of the layout's family.
pub(super) fn element_addr(
    l: &Layout,
    bytes: &[u8],
    set: &'static str,
) -> Result<IpAddr, DecodeError> {
    l.addr_from_bytes(bytes).ok_or(DecodeError::ElementSize {
        set,
        len: bytes.len(),
        expected: l.addr_len as usize,
    })
}

/// `source_ranges`: each element an `LB IP . first` key up to `LB IP . last`.
fn source_ranges(sock: &NlSocket, l: &Layout) -> Result<BTreeSet<(IpAddr, IpRange)>, NftError> {
    let n = l.addr_len as usize;
    let mut out = BTreeSet::new();
    for e in read_elements(sock, l.nfproto, schema::SOURCE_RANGES)? {
        let bad = DecodeError::ElementSize {
            set: schema::SOURCE_RANGES,
            len: e.key.len(),
            expected: 2 * n,
        };
        let part = |b: &[u8], range: std::ops::RangeFrom<usize>| {
            b.get(range).and_then(|b| l.addr_from_bytes(b))
        };
        let (Some(lb), Some(first), Some(last)) = (
            e.key.get(..n).and_then(|b| l.addr_from_bytes(b)),
            part(&e.key, n..),
            part(&e.key_end, n..),
        ) else {
            return Err(bad.into());
        };
        out.insert((lb, IpRange { first, last }));
    }
    Ok(out)
}

/// `guard`: the guarded addresses, each with its interface from
/// `guard_paths` (0: none).
fn guard(sock: &NlSocket, l: &Layout) -> Result<BTreeMap<IpAddr, u32>, NftError> {
    let mut paths = BTreeMap::new();
    for e in read_elements(sock, l.nfproto, schema::GUARD_PATHS)? {
        let (ip, index) = l
            .parse_path_key(&e.key)
            .ok_or(DecodeError::PathKey { len: e.key.len() })?;
        paths.insert(ip, index);
    }
    let mut out = BTreeMap::new();
    for e in read_elements(sock, l.nfproto, schema::GUARDED)? {
        let ip = element_addr(l, &e.key, schema::GUARDED)?;
        out.insert(ip, paths.get(&ip).copied().unwrap_or(0));
    }
    Ok(out)
}

/// The ranges of an rbtree interval set: each start element, up to the
/// element that ends it (exclusive), or to the family's end.
fn intervals(mut elems: Vec<RawElement>, l: &Layout) -> Result<Vec<IpRange>, NftError> {
    elems.sort_by(|a, b| a.key.cmp(&b.key));
    let addr = |b: &[u8]| element_addr(l, b, schema::CLUSTER);
    let mut out = Vec::new();
    let mut iter = elems.into_iter().peekable();
    while let Some(e) = iter.next() {
        if e.interval_end {
            continue;
        }
        let first = addr(&e.key)?;
        let last = match iter.peek() {
            Some(end) if end.interval_end => {
                let end = addr(&end.key)?;
                before(&end)
            }
            _ => max_of(&first),
        };
        out.push(IpRange { first, last });
    }
    Ok(out)
}

fn before(ip: &IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(a) => IpAddr::from(u32::from(*a).wrapping_sub(1).to_be_bytes()),
        IpAddr::V6(a) => IpAddr::from(u128::from(*a).wrapping_sub(1).to_be_bytes()),
    }
}

fn max_of(ip: &IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::from([255u8; 4]),
        IpAddr::V6(_) => IpAddr::from([255u8; 16]),
    }
}

/// Chains with their rules' comments and counters, for `dump`.
pub fn chain_details(sock: &NlSocket, t: &Table) -> Result<serde_json::Value, NftError> {
    let mut chains = Vec::new();
    for c in &t.chains {
        let Some(rules) = chain_rules(sock, t.nfproto, c.name)? else {
            continue;
        };
        let rules: Vec<_> = rules.iter().map(|r| rule_details(body(r))).collect();
        chains.push(json!({ "name": c.name, "priority": c.priority, "rules": rules }));
    }
    Ok(json!({ "table": format!("{} {TABLE}", t.family), "chains": chains }))
}

/// The value of type `kind` in a rule's userdata (libnftnl's TLVs:
/// type, length, value).
fn rule_udata(rule: &[u8], kind: u8) -> Option<&[u8]> {
    let mut udata = attr(rule, NFTA_RULE_USERDATA)?;
    while let [k, len, rest @ ..] = udata {
        let (value, next) = rest.split_at_checked(usize::from(*len))?;
        if *k == kind {
            return Some(value);
        }
        udata = next;
    }
    None
}

/// The fingerprint stored with a rule (see `RuleDef::fingerprint`).
fn rule_fingerprint(rule: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(
        rule_udata(rule, UDATA_RULE_FINGERPRINT)?.try_into().ok()?,
    ))
}

fn rule_details(rule: &[u8]) -> serde_json::Value {
    let counter = attr(rule, NFTA_RULE_EXPRESSIONS).and_then(|exprs| {
        attrs(exprs)
            .map(|(_, e)| e)
            .find(|e| attr_str(e, NFTA_EXPR_NAME).as_deref() == Some("counter"))
            .and_then(|e| attr(e, NFTA_EXPR_DATA))
            .map(|d| {
                (
                    attr_u64(d, NFTA_COUNTER_PACKETS),
                    attr_u64(d, NFTA_COUNTER_BYTES),
                )
            })
    });
    let comment = rule_udata(rule, UDATA_RULE_COMMENT).map(|u| {
        String::from_utf8_lossy(u)
            .trim_end_matches('\0')
            .to_string()
    });
    json!({
        "comment": comment,
        "packets": counter.and_then(|c| c.0),
        "bytes": counter.and_then(|c| c.1),
    })
}
