//! The nftables datapath, spoken directly over netlink (NETLINK_NETFILTER).
//!
//! Why not through `rustables`' types: its message traits are crate-private,
//! so its `Batch` cannot carry what it lacks (maps, concatenated keys,
//! payload writes with checksum flags, inverted lookups, element dumps), and
//! one sync must be one atomic batch. The codec here is small ([`wire`],
//! [`socket`]) and `nft -j list table` checks it independently in the tests.
mod batch;
mod expr;
pub mod schema;
mod sys;

use crate::datapath::{
    AllowedPort, BackendKind, Change, Datapath, DatapathState, Dump, StateDiff, SyncReport,
};
use crate::netlink::wire::{
    attr, attr_data, attr_str, attr_u32, attr_u64, attrs, NLM_F_APPEND, NLM_F_CREATE,
};
pub use crate::netlink::NetlinkError;
use crate::netlink::NlSocket;
use batch::{dump, Batch};
use schema::{Layout, SetDef, LAYOUTS, TABLE};
use serde_json::json;
use std::net::IpAddr;
use sys::*;
use tracing::{debug, warn};

/// Length of the nfgenmsg header before an answer's attributes.
const NFGENMSG_LEN: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("unexpected {0} in the kernel's answer")]
    Decode(String),
}

/// At most this many elements per NEWSETELEM/DELSETELEM message: an
/// attribute length is 16 bits, so one message must stay under 64 KiB.
const ELEMENTS_PER_MESSAGE: usize = 800;

/// A set element as the kernel holds it: key bytes, and value bytes for a
/// map element (empty for a plain set).
type RawElement = (Vec<u8>, Vec<u8>);

pub struct NftBackend {
    sock: NlSocket,
    /// What the kernel holds, as of our last successful batch. `None` until
    /// the first sync, and after a failure: then the kernel is read again.
    known: Option<DatapathState>,
}

/// What one family's table looks like in the kernel.
struct LiveTable {
    /// Written by this schema version, with the sets we expect.
    current: bool,
    /// Every chain present with as many rules as we install.
    chains_intact: bool,
    /// The elements (empty unless `current`).
    state: DatapathState,
}

/// What the first sync must do to one family's table.
#[derive(Debug, PartialEq, Eq)]
enum Install {
    /// Nothing: the table is ours, current and intact.
    Nothing,
    /// Chains or rules were changed by hand: re-add them.
    Rules,
    /// Absent: create it.
    Create,
    /// Of another schema version or set layout: delete and create it (in
    /// one batch, so traffic never sees it missing).
    Replace,
}

impl NftBackend {
    pub fn new() -> Result<Self, NftError> {
        Ok(NftBackend {
            sock: NlSocket::open(libc::NETLINK_NETFILTER)?,
            known: None,
        })
    }

    /// The attributes of our table in family `l`, if it exists.
    fn our_table(&self, l: &Layout) -> Result<Option<Vec<u8>>, NftError> {
        let tables = dump(&self.sock, NFT_MSG_GETTABLE, l.nfproto, |_| {})?;
        Ok(tables
            .iter()
            .map(|t| body(t))
            .find(|t| attr_str(t, NFTA_TABLE_NAME).as_deref() == Some(TABLE))
            .map(<[u8]>::to_vec))
    }

    fn read_sets(&self, l: &Layout) -> Result<Vec<SetDef>, NftError> {
        let answers = dump(&self.sock, NFT_MSG_GETSET, l.nfproto, |w| {
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

    /// `(key, value)` of every element of a set (value empty for sets).
    /// The elements of a set. A dump that runs while the kernel resizes the
    /// set's hash table (right after a large change) can miss elements, so
    /// the set is read twice and the union kept: a missed element shows in
    /// the other read; nothing absent can appear.
    fn read_elements(&self, l: &Layout, set: &str) -> Result<Vec<RawElement>, NftError> {
        let mut all: std::collections::BTreeSet<RawElement> =
            self.read_elements_once(l, set)?.into_iter().collect();
        all.extend(self.read_elements_once(l, set)?);
        Ok(all.into_iter().collect())
    }

    fn read_elements_once(&self, l: &Layout, set: &str) -> Result<Vec<RawElement>, NftError> {
        let answers = dump(&self.sock, NFT_MSG_GETSETELEM, l.nfproto, |w| {
            w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            w.put_str(NFTA_SET_ELEM_LIST_SET, set);
        })?;
        let mut out = Vec::new();
        for a in &answers {
            let Some(list) = attr(body(a), NFTA_SET_ELEM_LIST_ELEMENTS) else {
                continue;
            };
            for (_, elem) in attrs(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
                let key = attr_data(elem, NFTA_SET_ELEM_KEY)
                    .ok_or_else(|| NftError::Decode(format!("element of {set} without key")))?;
                let data = attr_data(elem, NFTA_SET_ELEM_DATA).unwrap_or(&[]);
                out.push((key.to_vec(), data.to_vec()));
            }
        }
        Ok(out)
    }

    fn read_table(&self, l: &Layout) -> Result<Option<LiveTable>, NftError> {
        let Some(table) = self.our_table(l)? else {
            return Ok(None);
        };
        let version_ok = attr(&table, NFTA_TABLE_USERDATA) == Some(schema::SCHEMA_MARK);
        let live_sets = self.read_sets(l)?;
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
            self.read_state_into(l, &mut state)?;
        }
        let mut chains_intact = true;
        for c in schema::chains(l) {
            let rules = self.chain_rules(l, c.name)?;
            chains_intact &= rules.is_some_and(|r| r.len() == c.rules.len());
        }
        Ok(Some(LiveTable {
            current,
            chains_intact,
            state,
        }))
    }

    /// The rules of one of our chains (`None`: no such chain).
    fn chain_rules(&self, l: &Layout, chain: &str) -> Result<Option<Vec<Vec<u8>>>, NftError> {
        match dump(&self.sock, NFT_MSG_GETRULE, l.nfproto, |w| {
            w.put_str(NFTA_RULE_TABLE, TABLE);
            w.put_str(NFTA_RULE_CHAIN, chain);
        }) {
            Ok(r) => Ok(Some(r)),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn read_state_into(&self, l: &Layout, s: &mut DatapathState) -> Result<(), NftError> {
        let bad = |what: &str| {
            NftError::Decode(format!("{what} element of size other than {}", l.addr_len))
        };
        let addr = |b: &[u8], what: &str| l.addr_from_bytes(b).ok_or_else(|| bad(what));
        for (k, v) in self.read_elements(l, schema::POD_SVC)? {
            s.pod_svc.insert(addr(&k, "pod_svc")?, addr(&v, "pod_svc")?);
        }
        for (k, v) in self.read_elements(l, schema::SVC_POD)? {
            s.svc_pod.insert(addr(&k, "svc_pod")?, addr(&v, "svc_pod")?);
        }
        for (set, out) in [
            (schema::FILTERED_PODS, &mut s.filtered_pods),
            (schema::ICMP_ALLOWED_PODS, &mut s.icmp_allowed_pods),
            (schema::UNMAPPED_LBS, &mut s.unmapped_lbs),
        ] {
            for (k, _) in self.read_elements(l, set)? {
                out.insert(addr(&k, set)?);
            }
        }
        for (k, _) in self.read_elements(l, schema::ALLOWED_PORTS)? {
            let (pod, proto, port) = l
                .parse_port_key(&k)
                .ok_or_else(|| NftError::Decode("allowed_ports key".into()))?;
            s.allowed_ports.insert(AllowedPort { pod, proto, port });
        }
        Ok(())
    }

    /// Adds the messages that create (or adopt) one family's table, sets,
    /// chains and rules. `replace` deletes an incompatible table first; in
    /// one batch with the rest, so traffic never sees the table missing.
    fn install(batch: &mut Batch, l: &Layout, how: Install) {
        let f = l.nfproto;
        if how == Install::Nothing {
            return;
        }
        let replace = how == Install::Replace;
        if replace {
            batch.add(
                NFT_MSG_DELTABLE,
                0,
                f,
                format!("delete table {} {TABLE}", l.name),
                |w| w.put_str(NFTA_TABLE_NAME, TABLE),
            );
        }
        batch.add(
            NFT_MSG_NEWTABLE,
            NLM_F_CREATE,
            f,
            format!("table {} {TABLE}", l.name),
            |w| {
                w.put_str(NFTA_TABLE_NAME, TABLE);
                w.put_u32(NFTA_TABLE_FLAGS, 0);
                w.put(NFTA_TABLE_USERDATA, schema::SCHEMA_MARK);
            },
        );
        for s in schema::sets(l) {
            batch.add(
                NFT_MSG_NEWSET,
                NLM_F_CREATE,
                f,
                format!("set {}", s.name),
                |w| {
                    w.put_str(NFTA_SET_TABLE, TABLE);
                    w.put_str(NFTA_SET_NAME, &s.name);
                    w.put_u32(NFTA_SET_FLAGS, s.flags);
                    w.put_u32(NFTA_SET_KEY_TYPE, s.key_type);
                    w.put_u32(NFTA_SET_KEY_LEN, s.key_len);
                    if let Some((t, len)) = s.data {
                        w.put_u32(NFTA_SET_DATA_TYPE, t);
                        w.put_u32(NFTA_SET_DATA_LEN, len);
                    }
                    w.put_u32(NFTA_SET_ID, s.id);
                },
            );
        }
        for c in schema::chains(l) {
            batch.add(
                NFT_MSG_NEWCHAIN,
                NLM_F_CREATE,
                f,
                format!("chain {}", c.name),
                |w| {
                    w.put_str(NFTA_CHAIN_TABLE, TABLE);
                    w.put_str(NFTA_CHAIN_NAME, c.name);
                    w.nest(NFTA_CHAIN_HOOK, |w| {
                        w.put_u32(NFTA_HOOK_HOOKNUM, NF_INET_PRE_ROUTING);
                        w.put_u32(NFTA_HOOK_PRIORITY, c.priority as u32);
                    });
                    w.put_str(NFTA_CHAIN_TYPE, "filter");
                    w.put_u32(NFTA_CHAIN_POLICY, NF_ACCEPT);
                },
            );
            // Flush and re-add the rules: an adopted table gets this
            // version's rules, atomically with the rest of the batch.
            batch.add(
                NFT_MSG_DELRULE,
                0,
                f,
                format!("flush chain {}", c.name),
                |w| {
                    w.put_str(NFTA_RULE_TABLE, TABLE);
                    w.put_str(NFTA_RULE_CHAIN, c.name);
                },
            );
            for r in &c.rules {
                batch.add(
                    NFT_MSG_NEWRULE,
                    NLM_F_CREATE | NLM_F_APPEND,
                    f,
                    format!("rule in {}: {}", c.name, r.comment),
                    |w| {
                        w.put_str(NFTA_RULE_TABLE, TABLE);
                        w.put_str(NFTA_RULE_CHAIN, c.name);
                        w.nest(NFTA_RULE_EXPRESSIONS, |w| {
                            for e in &r.exprs {
                                e.encode(w);
                            }
                        });
                        let mut udata = vec![UDATA_RULE_COMMENT, (r.comment.len() + 1) as u8];
                        udata.extend_from_slice(r.comment.as_bytes());
                        udata.push(0);
                        w.put(NFTA_RULE_USERDATA, &udata);
                    },
                );
            }
        }
    }

    /// Adds the element changes of `diff` (deletes first, then adds).
    fn encode_diff(batch: &mut Batch, diff: &StateDiff) {
        type Elem = (Vec<u8>, Option<Vec<u8>>);
        let addr = |ip: &IpAddr| Layout::addr_bytes(ip);
        let pairs = |c: &Change<(IpAddr, IpAddr)>, remove: bool| -> Vec<(IpAddr, Elem)> {
            let v = if remove { &c.remove } else { &c.add };
            v.iter()
                .map(|(k, val)| (*k, (addr(k), Some(addr(val)))))
                .collect()
        };
        let singles = |c: &Change<IpAddr>, remove: bool| -> Vec<(IpAddr, Elem)> {
            let v = if remove { &c.remove } else { &c.add };
            v.iter().map(|k| (*k, (addr(k), None))).collect()
        };
        let ports = |c: &Change<AllowedPort>, remove: bool| -> Vec<(IpAddr, Elem)> {
            let v = if remove { &c.remove } else { &c.add };
            v.iter()
                .map(|p| (p.pod, (Layout::port_key(&p.pod, p.proto, p.port), None)))
                .collect()
        };
        for remove in [true, false] {
            let groups: [(&'static str, Vec<(IpAddr, Elem)>); 6] = [
                (schema::POD_SVC, pairs(&diff.pod_svc, remove)),
                (schema::SVC_POD, pairs(&diff.svc_pod, remove)),
                (schema::FILTERED_PODS, singles(&diff.filtered_pods, remove)),
                (schema::ALLOWED_PORTS, ports(&diff.allowed_ports, remove)),
                (
                    schema::ICMP_ALLOWED_PODS,
                    singles(&diff.icmp_allowed_pods, remove),
                ),
                (schema::UNMAPPED_LBS, singles(&diff.unmapped_lbs, remove)),
            ];
            for (set, elems) in groups {
                for l in &LAYOUTS {
                    let mine: Vec<&Elem> = elems
                        .iter()
                        .filter(|(ip, _)| Layout::of(ip) == l)
                        .map(|(_, e)| e)
                        .collect();
                    for chunk in mine.chunks(ELEMENTS_PER_MESSAGE) {
                        Self::encode_elements(batch, l, set, chunk, remove);
                    }
                }
            }
        }
    }

    fn encode_elements(
        batch: &mut Batch,
        l: &Layout,
        set: &str,
        elems: &[&(Vec<u8>, Option<Vec<u8>>)],
        remove: bool,
    ) {
        let (msg, flags, verb) = if remove {
            (NFT_MSG_DELSETELEM, 0, "delete")
        } else {
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE, "add")
        };
        let what = format!("{verb} {} element(s) of {} {set}", elems.len(), l.name);
        batch.add(msg, flags, l.nfproto, what, |w| {
            w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            w.put_str(NFTA_SET_ELEM_LIST_SET, set);
            w.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |w| {
                for (key, data) in elems {
                    w.nest(NFTA_LIST_ELEM, |w| {
                        w.put_data(NFTA_SET_ELEM_KEY, key);
                        if let (Some(data), false) = (data, remove) {
                            w.put_data(NFTA_SET_ELEM_DATA, data);
                        }
                    });
                }
            });
        });
    }

    fn try_sync(&mut self, desired: &DatapathState) -> Result<SyncReport, NftError> {
        let mut batch = Batch::new();
        let mut report = SyncReport::default();
        let known = match self.known.take() {
            Some(known) => known,
            None => {
                // First sync, or recovery: read what the kernel holds and
                // (re)install the schema in the same batch as the elements.
                let mut live = DatapathState::default();
                for l in &LAYOUTS {
                    let how = match self.read_table(l)? {
                        None => Install::Create,
                        Some(t) if !t.current => {
                            warn!(family = l.name, "table {TABLE} is of another schema version; replacing it atomically");
                            Install::Replace
                        }
                        Some(t) => {
                            merge(&mut live, t.state);
                            if t.chains_intact {
                                Install::Nothing
                            } else {
                                warn!(
                                    family = l.name,
                                    "chains of {TABLE} were changed; restoring them"
                                );
                                Install::Rules
                            }
                        }
                    };
                    report.installed_schema |= how != Install::Nothing;
                    Self::install(&mut batch, l, how);
                }
                crate::datapath::adopt(BackendKind::Nft, live)
            }
        };
        let diff = known.diff(desired);
        report.changed_elements = diff.size();
        Self::encode_diff(&mut batch, &diff);
        debug!(
            messages = batch.message_count(),
            changed = report.changed_elements,
            "nft batch"
        );
        batch.apply(&self.sock)?;
        self.known = Some(desired.clone());
        Ok(report)
    }

    fn chain_details(&self, l: &Layout) -> Result<serde_json::Value, NftError> {
        let mut chains = Vec::new();
        for c in schema::chains(l) {
            let Some(rules) = self.chain_rules(l, c.name)? else {
                continue;
            };
            let rules: Vec<_> = rules
                .iter()
                .map(|r| {
                    let b = body(r);
                    let counter = attr(b, NFTA_RULE_EXPRESSIONS).and_then(|exprs| {
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
                    let comment = attr(b, NFTA_RULE_USERDATA)
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
                })
                .collect();
            chains.push(json!({ "name": c.name, "priority": c.priority, "rules": rules }));
        }
        Ok(json!({ "table": format!("{} {TABLE}", l.name), "chains": chains }))
    }
}

/// The payload of an nf_tables answer, after its nfgenmsg header.
fn body(payload: &[u8]) -> &[u8] {
    payload.get(NFGENMSG_LEN..).unwrap_or(&[])
}

fn merge(into: &mut DatapathState, from: DatapathState) {
    into.pod_svc.extend(from.pod_svc);
    into.svc_pod.extend(from.svc_pod);
    into.filtered_pods.extend(from.filtered_pods);
    into.allowed_ports.extend(from.allowed_ports);
    into.icmp_allowed_pods.extend(from.icmp_allowed_pods);
    into.unmapped_lbs.extend(from.unmapped_lbs);
}

impl Datapath for NftBackend {
    type Error = NftError;

    fn kind(&self) -> BackendKind {
        BackendKind::Nft
    }

    fn forget(&mut self) {
        self.known = None;
    }

    fn sync(&mut self, desired: &DatapathState) -> Result<SyncReport, NftError> {
        match self.try_sync(desired) {
            Ok(r) => Ok(r),
            Err(e) if self.known.is_none() && matches!(e, NftError::Netlink(_)) => {
                // Someone changed the table behind our back (an element or
                // the whole table removed by hand): read it again and retry.
                warn!(error = %e, "nft sync failed; re-reading the kernel's state and retrying");
                self.try_sync(desired)
            }
            Err(e) => Err(e),
        }
    }

    fn dump(&self) -> Result<Dump, NftError> {
        let mut state = DatapathState::default();
        let mut installed = false;
        let mut tables = Vec::new();
        for l in &LAYOUTS {
            if let Some(t) = self.read_table(l)? {
                installed = true;
                merge(&mut state, t.state);
                tables.push(self.chain_details(l)?);
            }
        }
        Ok(Dump {
            backend: BackendKind::Nft,
            installed,
            state,
            details: json!({ "tables": tables }),
        })
    }

    fn cleanup(&mut self) -> Result<(), NftError> {
        let mut batch = Batch::new();
        for l in &LAYOUTS {
            if self.our_table(l)?.is_some() {
                batch.add(
                    NFT_MSG_DELTABLE,
                    0,
                    l.nfproto,
                    format!("delete table {} {TABLE}", l.name),
                    |w| w.put_str(NFTA_TABLE_NAME, TABLE),
                );
            }
        }
        batch.apply(&self.sock)?;
        self.known = None;
        Ok(())
    }
}
