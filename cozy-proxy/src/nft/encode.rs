//! The pure half of the nft backend: what to install and which elements to
//! change become one nf_tables batch. No socket here; the golden tests
//! decode the batch with the project's own codec.
use super::batch::Batch;
use super::schema::{self, Layout, LAYOUTS, TABLE};
use super::sys::*;
use crate::datapath::{AllowedPort, Change, StateDiff};
use crate::netlink::wire::{ip_bytes, NLM_F_APPEND, NLM_F_CREATE};
use std::net::IpAddr;

/// At most this many elements per NEWSETELEM/DELSETELEM message: an
/// attribute length is 16 bits, so one message must stay under 64 KiB.
pub const ELEMENTS_PER_MESSAGE: usize = 800;

/// What a sync must do to one family's table before its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Install {
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

/// The whole transaction of one sync: per family, what to install (in
/// [`LAYOUTS`] order), then the element changes of `diff`.
pub fn sync_batch(installs: &[(Layout, Install)], diff: &StateDiff) -> Batch {
    let mut batch = Batch::new();
    for (l, how) in installs {
        install(&mut batch, l, *how);
    }
    elements(&mut batch, diff);
    batch
}

/// Deletes both families' tables (those that exist: `present`).
pub fn cleanup_batch(present: &[Layout]) -> Batch {
    let mut batch = Batch::new();
    for l in present {
        delete_table(&mut batch, l);
    }
    batch
}

fn delete_table(batch: &mut Batch, l: &Layout) {
    batch.add(
        NFT_MSG_DELTABLE,
        0,
        l.nfproto,
        format!("delete table {} {TABLE}", l.name),
        |w| w.put_str(NFTA_TABLE_NAME, TABLE),
    );
}

/// The messages that create (or adopt) one family's table, sets, chains
/// and rules. Tables, sets and chains are created without NLM_F_EXCL
/// (existing ones are kept); each chain is flushed and its rules re-added.
fn install(batch: &mut Batch, l: &Layout, how: Install) {
    let f = l.nfproto;
    if how == Install::Nothing {
        return;
    }
    if how == Install::Replace {
        delete_table(batch, l);
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
        // Flush and re-add the rules: an adopted table gets this version's
        // rules, atomically with the rest of the batch.
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

/// One set element: its address family's key (and map value).
struct Element {
    ip: IpAddr,
    key: Vec<u8>,
    value: Option<Vec<u8>>,
}

/// The removed or added side of a change, as elements.
trait Elements {
    fn elements(&self, remove: bool) -> Vec<Element>;
}

fn side<T>(c: &Change<T>, remove: bool) -> &[T] {
    if remove {
        &c.remove
    } else {
        &c.add
    }
}

impl Elements for Change<(IpAddr, IpAddr)> {
    fn elements(&self, remove: bool) -> Vec<Element> {
        side(self, remove)
            .iter()
            .map(|(k, v)| Element {
                ip: *k,
                key: ip_bytes(k),
                value: Some(ip_bytes(v)),
            })
            .collect()
    }
}

impl Elements for Change<IpAddr> {
    fn elements(&self, remove: bool) -> Vec<Element> {
        side(self, remove)
            .iter()
            .map(|k| Element {
                ip: *k,
                key: ip_bytes(k),
                value: None,
            })
            .collect()
    }
}

impl Elements for Change<AllowedPort> {
    fn elements(&self, remove: bool) -> Vec<Element> {
        side(self, remove)
            .iter()
            .map(|p| Element {
                ip: p.pod,
                key: Layout::port_key(&p.pod, p.proto, p.port),
                value: None,
            })
            .collect()
    }
}

/// The element changes of `diff`: every removal first, then every
/// addition (a changed map value is removed and added in the same batch).
fn elements(batch: &mut Batch, diff: &StateDiff) {
    for remove in [true, false] {
        let groups: [(&str, Vec<Element>); 6] = [
            (schema::POD_SVC, diff.pod_svc.elements(remove)),
            (schema::SVC_POD, diff.svc_pod.elements(remove)),
            (schema::FILTERED_PODS, diff.filtered_pods.elements(remove)),
            (schema::ALLOWED_PORTS, diff.allowed_ports.elements(remove)),
            (
                schema::ICMP_ALLOWED_PODS,
                diff.icmp_allowed_pods.elements(remove),
            ),
            (schema::UNMAPPED_LBS, diff.unmapped_lbs.elements(remove)),
        ];
        for (set, elems) in groups {
            for l in &LAYOUTS {
                let mine: Vec<&Element> = elems.iter().filter(|e| Layout::of(&e.ip) == l).collect();
                for chunk in mine.chunks(ELEMENTS_PER_MESSAGE) {
                    element_message(batch, l, set, chunk, remove);
                }
            }
        }
    }
}

fn element_message(batch: &mut Batch, l: &Layout, set: &str, elems: &[&Element], remove: bool) {
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
            for e in elems {
                w.nest(NFTA_LIST_ELEM, |w| {
                    w.put_data(NFTA_SET_ELEM_KEY, &e.key);
                    if let (Some(value), false) = (&e.value, remove) {
                        w.put_data(NFTA_SET_ELEM_DATA, value);
                    }
                });
            }
        });
    });
}
