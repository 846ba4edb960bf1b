//! Reading our tables back from the kernel: the table and its schema mark,
//! the sets' layouts, their elements, the chains' rules and counters.
use super::batch::dump;
use super::schema::{self, Layout, SetDef, TABLE};
use super::sys::*;
use super::{DecodeError, NftError};
use crate::datapath::{AllowedPort, DatapathState};
use crate::netlink::wire::{attr, attr_data, attr_str, attr_u32, attr_u64, attrs};
use crate::netlink::NlSocket;
use serde_json::json;
use std::collections::BTreeSet;

/// Length of the nfgenmsg header before an answer's attributes.
const NFGENMSG_LEN: usize = 4;

/// A set element as the kernel holds it: key bytes, and value bytes for a
/// map element (empty for a plain set).
type RawElement = (Vec<u8>, Vec<u8>);

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

/// The attributes of our table in family `l`, if it exists.
pub fn our_table(sock: &NlSocket, l: &Layout) -> Result<Option<Vec<u8>>, NftError> {
    let tables = dump(sock, NFT_MSG_GETTABLE, l.nfproto, |_| {})?;
    Ok(tables
        .iter()
        .map(|t| body(t))
        .find(|t| attr_str(t, NFTA_TABLE_NAME).as_deref() == Some(TABLE))
        .map(<[u8]>::to_vec))
}

fn read_sets(sock: &NlSocket, l: &Layout) -> Result<Vec<SetDef>, NftError> {
    let answers = dump(sock, NFT_MSG_GETSET, l.nfproto, |w| {
        w.put_str(NFTA_SET_TABLE, TABLE)
    })?;
    Ok(answers
        .iter()
        .map(|a| body(a))
        .filter(|b| attr_str(b, NFTA_SET_TABLE).as_deref() == Some(TABLE))
        .map(|b| SetDef {
            name: attr_str(b, NFTA_SET_NAME).unwrap_or_default(),
            id: 0,
            flags: attr_u32(b, NFTA_SET_FLAGS).unwrap_or(0) & NFT_SET_MAP,
            key_type: attr_u32(b, NFTA_SET_KEY_TYPE).unwrap_or(0),
            key_len: attr_u32(b, NFTA_SET_KEY_LEN).unwrap_or(0),
            data: attr_u32(b, NFTA_SET_DATA_TYPE).zip(attr_u32(b, NFTA_SET_DATA_LEN)),
        })
        .collect())
}

/// The elements of a set. A dump that runs while the kernel resizes the
/// set's hash table (right after a large change) can miss elements, so the
/// set is read twice and the union kept: a missed element shows in the
/// other read; nothing absent can appear.
fn read_elements(sock: &NlSocket, l: &Layout, set: &str) -> Result<Vec<RawElement>, NftError> {
    let mut all: BTreeSet<RawElement> = read_elements_once(sock, l, set)?.into_iter().collect();
    all.extend(read_elements_once(sock, l, set)?);
    Ok(all.into_iter().collect())
}

fn read_elements_once(sock: &NlSocket, l: &Layout, set: &str) -> Result<Vec<RawElement>, NftError> {
    let answers = dump(sock, NFT_MSG_GETSETELEM, l.nfproto, |w| {
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
            let data = attr_data(elem, NFTA_SET_ELEM_DATA).unwrap_or(&[]);
            out.push((key.to_vec(), data.to_vec()));
        }
    }
    Ok(out)
}

pub fn read_table(sock: &NlSocket, l: &Layout) -> Result<Option<LiveTable>, NftError> {
    let Some(table) = our_table(sock, l)? else {
        return Ok(None);
    };
    let version_ok = attr(&table, NFTA_TABLE_USERDATA) == Some(schema::SCHEMA_MARK);
    let live_sets = read_sets(sock, l)?;
    let sets_ok = schema::sets(l).iter().all(|want| {
        live_sets.iter().any(|have| {
            SetDef {
                id: want.id,
                ..have.clone()
            } == *want
        })
    });
    let current = version_ok && sets_ok;
    let mut state = DatapathState::default();
    if current {
        read_state_into(sock, l, &mut state)?;
    }
    let mut chains_intact = true;
    for c in schema::chains(l) {
        let rules = chain_rules(sock, l, c.name)?;
        chains_intact &= rules.is_some_and(|r| r.len() == c.rules.len());
    }
    Ok(Some(LiveTable {
        current,
        chains_intact,
        state,
    }))
}

/// The rules of one of our chains (`None`: no such chain).
fn chain_rules(sock: &NlSocket, l: &Layout, chain: &str) -> Result<Option<Vec<Vec<u8>>>, NftError> {
    match dump(sock, NFT_MSG_GETRULE, l.nfproto, |w| {
        w.put_str(NFTA_RULE_TABLE, TABLE);
        w.put_str(NFTA_RULE_CHAIN, chain);
    }) {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn read_state_into(sock: &NlSocket, l: &Layout, s: &mut DatapathState) -> Result<(), NftError> {
    let addr = |b: &[u8], set: &'static str| {
        l.addr_from_bytes(b).ok_or(DecodeError::ElementSize {
            set,
            len: b.len(),
            expected: l.addr_len as usize,
        })
    };
    for (k, v) in read_elements(sock, l, schema::POD_SVC)? {
        s.pod_svc
            .insert(addr(&k, schema::POD_SVC)?, addr(&v, schema::POD_SVC)?);
    }
    for (k, v) in read_elements(sock, l, schema::SVC_POD)? {
        s.svc_pod
            .insert(addr(&k, schema::SVC_POD)?, addr(&v, schema::SVC_POD)?);
    }
    for (set, out) in [
        (schema::FILTERED_PODS, &mut s.filtered_pods),
        (schema::ICMP_ALLOWED_PODS, &mut s.icmp_allowed_pods),
        (schema::UNMAPPED_LBS, &mut s.unmapped_lbs),
    ] {
        for (k, _) in read_elements(sock, l, set)? {
            out.insert(addr(&k, set)?);
        }
    }
    for (k, _) in read_elements(sock, l, schema::ALLOWED_PORTS)? {
        let (pod, proto, port) = l
            .parse_port_key(&k)
            .ok_or(DecodeError::PortKey { len: k.len() })?;
        s.allowed_ports.insert(AllowedPort { pod, proto, port });
    }
    Ok(())
}

/// Chains with their rules' comments and counters, for `dump`.
pub fn chain_details(sock: &NlSocket, l: &Layout) -> Result<serde_json::Value, NftError> {
    let mut chains = Vec::new();
    for c in schema::chains(l) {
        let Some(rules) = chain_rules(sock, l, c.name)? else {
            continue;
        };
        let rules: Vec<_> = rules.iter().map(|r| rule_details(body(r))).collect();
        chains.push(json!({ "name": c.name, "priority": c.priority, "rules": rules }));
    }
    Ok(json!({ "table": format!("{} {TABLE}", l.name), "chains": chains }))
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
    let comment = attr(rule, NFTA_RULE_USERDATA)
        .filter(|u| u.len() > 2 && u[0] == UDATA_RULE_COMMENT)
        .map(|u| {
            String::from_utf8_lossy(&u[2..])
                .trim_end_matches('\0')
                .to_string()
        });
    json!({
        "comment": comment,
        "packets": counter.and_then(|c| c.0),
        "bytes": counter.and_then(|c| c.1),
    })
}
