//! The pure half of the nft backend: what to install and which elements to
//! change become one nf_tables batch. No socket here; the golden tests
//! decode the batch with the project's own codec.
use super::batch::Batch;
use super::schema::{self, Layout, Table, LAYOUTS, TABLE};
use super::sys::*;
use crate::datapath::{AllowedPort, Change, StateDiff};
use crate::model::IpRange;
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

/// The whole transaction of one sync: per table, what to install, then the
/// element changes of `diff`, its guard as `ip_guard` places it in the IP
/// tables (see `ports.rs`). More element messages may follow (the bridge
/// table's).
pub fn sync_batch(
    installs: &[(Table, Install)],
    diff: &StateDiff,
    ip_guard: &Change<(IpAddr, u32)>,
    dormant: bool,
) -> Batch {
    // Room for every element from the start: a buffer grown by doubling
    // holds its old and new copies at once (tens of MiB at 50 000
    // Services). Up to 52 bytes per element (an IPv6 key and value with
    // their attribute headers), 32 on average at 50 000 IPv6 Services; the
    // guard writes two elements per change. Room not written to is never
    // made resident.
    let mut batch = Batch::with_capacity((diff.size() + diff.guard.size()) * 40 + 64 * 1024);
    for (t, how) in installs {
        install(&mut batch, t, *how, dormant);
    }
    elements(&mut batch, diff, ip_guard);
    batch
}

/// Deletes our tables (those that exist: `present`).
pub fn cleanup_batch(present: &[Table]) -> Batch {
    let mut batch = Batch::new();
    for t in present {
        delete_table(&mut batch, t);
    }
    batch
}

fn delete_table(batch: &mut Batch, t: &Table) {
    batch.add(
        NFT_MSG_DELTABLE,
        0,
        t.nfproto,
        format!("delete table {} {TABLE}", t.family),
        |w| w.put_str(NFTA_TABLE_NAME, TABLE),
    );
}

/// Wakes our tables `present` (their base chains go on their hooks), in
/// one transaction.
pub fn wake_batch(present: &[Table]) -> Batch {
    let mut batch = Batch::new();
    for t in present {
        batch.add(
            NFT_MSG_NEWTABLE,
            0,
            t.nfproto,
            format!("wake table {} {TABLE}", t.family),
            |w| {
                w.put_str(NFTA_TABLE_NAME, TABLE);
                w.put_u32(NFTA_TABLE_FLAGS, 0);
            },
        );
    }
    batch
}

/// The messages that create (or adopt) one family's table, sets, chains
/// and rules. Tables, sets and chains are created without NLM_F_EXCL
/// (existing ones are kept); each chain is flushed and its rules re-added.
/// A `dormant` table (a backend switch, while the other backend serves)
/// is filled with its base chains off their hooks: created so, in the
/// same message, never on them for an instant.
fn install(batch: &mut Batch, t: &Table, how: Install, dormant: bool) {
    let f = t.nfproto;
    let flags = if dormant { NFT_TABLE_F_DORMANT } else { 0 };
    if how == Install::Nothing {
        if dormant {
            batch.add(
                NFT_MSG_NEWTABLE,
                0,
                f,
                format!("dormant table {} {TABLE}", t.family),
                |w| {
                    w.put_str(NFTA_TABLE_NAME, TABLE);
                    w.put_u32(NFTA_TABLE_FLAGS, flags);
                },
            );
        }
        return;
    }
    if how == Install::Replace {
        delete_table(batch, t);
    }
    batch.add(
        NFT_MSG_NEWTABLE,
        NLM_F_CREATE,
        f,
        format!("table {} {TABLE}", t.family),
        |w| {
            w.put_str(NFTA_TABLE_NAME, TABLE);
            w.put_u32(NFTA_TABLE_FLAGS, flags);
            w.put(NFTA_TABLE_USERDATA, t.mark);
        },
    );
    for s in &t.sets {
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
                if s.size != 0 || !s.fields.is_empty() {
                    w.nest(NFTA_SET_DESC, |w| {
                        if s.size != 0 {
                            w.put_u32(NFTA_SET_DESC_SIZE, s.size);
                        }
                        // A concatenated interval key: the kernel picks the
                        // pipapo backend from the field lengths.
                        if !s.fields.is_empty() {
                            w.nest(NFTA_SET_DESC_CONCAT, |w| {
                                for len in &s.fields {
                                    w.nest(NFTA_LIST_ELEM, |w| w.put_u32(NFTA_SET_FIELD_LEN, *len));
                                }
                            });
                        }
                    });
                }
            },
        );
    }
    for c in &t.chains {
        batch.add(
            NFT_MSG_NEWCHAIN,
            NLM_F_CREATE,
            f,
            format!("chain {}", c.name),
            |w| {
                w.put_str(NFTA_CHAIN_TABLE, TABLE);
                w.put_str(NFTA_CHAIN_NAME, c.name);
                w.nest(NFTA_CHAIN_HOOK, |w| {
                    w.put_u32(NFTA_HOOK_HOOKNUM, c.hook);
                    w.put_u32(NFTA_HOOK_PRIORITY, c.priority as u32);
                });
                w.put_str(NFTA_CHAIN_TYPE, c.kind);
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
                    udata.extend_from_slice(&[UDATA_RULE_FINGERPRINT, 8]);
                    udata.extend_from_slice(&r.fingerprint().to_le_bytes());
                    w.put(NFTA_RULE_USERDATA, &udata);
                },
            );
        }
    }
}

/// One set element: its address family's key (and map value, interval
/// end, flags).
pub(super) struct Element {
    pub(super) ip: IpAddr,
    pub(super) key: Vec<u8>,
    pub(super) value: Option<Vec<u8>>,
    /// The inclusive end of a concatenated interval (pipapo).
    pub(super) key_end: Option<Vec<u8>>,
    /// NFT_SET_ELEM_INTERVAL_END: the element closes an interval (rbtree).
    pub(super) interval_end: bool,
}

impl Element {
    pub(super) fn key(ip: IpAddr, key: Vec<u8>) -> Element {
        Element {
            ip,
            key,
            value: None,
            key_end: None,
            interval_end: false,
        }
    }
}

fn side<T>(c: &Change<T>, remove: bool) -> &[T] {
    if remove {
        &c.remove
    } else {
        &c.add
    }
}

/// A set's element changes, made as they are encoded.
pub(super) type Elements<'a> = Box<dyn Iterator<Item = Element> + 'a>;

fn pairs(c: &Change<(IpAddr, IpAddr)>, remove: bool) -> Elements<'_> {
    Box::new(side(c, remove).iter().map(|(k, v)| Element {
        value: Some(ip_bytes(v)),
        ..Element::key(*k, ip_bytes(k))
    }))
}

fn singles(c: &Change<IpAddr>, remove: bool) -> Elements<'_> {
    Box::new(
        side(c, remove)
            .iter()
            .map(|k| Element::key(*k, ip_bytes(k))),
    )
}

fn ports(c: &Change<AllowedPort>, remove: bool) -> Elements<'_> {
    Box::new(
        side(c, remove)
            .iter()
            .map(|p| Element::key(p.pod, Layout::port_key(&p.pod, p.proto, p.port))),
    )
}

/// A range in an rbtree interval set: its first address, and the address
/// after its last as the interval's end (none when it ends the family).
fn intervals(c: &Change<IpRange>, remove: bool) -> Elements<'_> {
    Box::new(side(c, remove).iter().flat_map(|r| {
        let start = Element::key(r.first, ip_bytes(&r.first));
        let end = r.after().map(|after| Element {
            interval_end: true,
            ..Element::key(after, ip_bytes(&after))
        });
        std::iter::once(start).chain(end)
    }))
}

/// `(LB IP, range)` in the concatenated interval set: LB . first to
/// LB . last.
fn lb_ranges(c: &Change<(IpAddr, IpRange)>, remove: bool) -> Elements<'_> {
    Box::new(side(c, remove).iter().map(|(lb, r)| {
        let mut key = ip_bytes(lb);
        key.extend(ip_bytes(&r.first));
        let mut end = ip_bytes(lb);
        end.extend(ip_bytes(&r.last));
        Element {
            key_end: Some(end),
            ..Element::key(*lb, key)
        }
    }))
}

/// The guard as two sets: every guarded address (`paths` false), and the
/// (address, interface) pairs it may arrive on (none for 0).
fn guard(c: &Change<(IpAddr, u32)>, remove: bool, paths: bool) -> Elements<'_> {
    let all = side(c, remove).iter();
    match paths {
        false => Box::new(all.map(|(ip, _)| Element::key(*ip, ip_bytes(ip)))),
        true => Box::new(
            all.filter(|(_, index)| *index != 0)
                .map(|(ip, index)| Element::key(*ip, Layout::path_key(ip, *index))),
        ),
    }
}

/// A set's name and its element changes (`true`: the removals).
pub(super) type Group<'a> = (&'a str, Box<dyn Fn(bool) -> Elements<'a> + 'a>);

/// Every set's element changes in `diff`, in the order they are written.
pub(super) fn groups<'a>(
    diff: &'a StateDiff,
    ip_guard: &'a Change<(IpAddr, u32)>,
) -> [Group<'a>; 12] {
    // Every table of the diff, named: a table added to the state does not
    // compile until it has its sets here. `guard` arrives per family
    // (`ip_guard`), `routes` are the host's (`steer.rs`), `remote_hosts`
    // is planned only.
    let StateDiff {
        pod_svc,
        svc_pod,
        remote,
        filtered_pods,
        allowed_ports,
        icmp_allowed_pods,
        unmapped_lbs,
        cluster,
        ranged_lbs,
        source_ranges,
        guard: _,
        routes: _,
        remote_hosts: _,
    } = diff;
    [
        (schema::POD_SVC, Box::new(|r| pairs(pod_svc, r))),
        (schema::SVC_POD, Box::new(|r| pairs(svc_pod, r))),
        (schema::REMOTE, Box::new(|r| pairs(remote, r))),
        (
            schema::FILTERED_PODS,
            Box::new(|r| singles(filtered_pods, r)),
        ),
        (schema::ALLOWED_PORTS, Box::new(|r| ports(allowed_ports, r))),
        (
            schema::ICMP_ALLOWED_PODS,
            Box::new(|r| singles(icmp_allowed_pods, r)),
        ),
        (schema::UNMAPPED_LBS, Box::new(|r| singles(unmapped_lbs, r))),
        (schema::CLUSTER, Box::new(|r| intervals(cluster, r))),
        (schema::RANGED_LBS, Box::new(|r| singles(ranged_lbs, r))),
        (
            schema::SOURCE_RANGES,
            Box::new(|r| lb_ranges(source_ranges, r)),
        ),
        (schema::GUARDED, Box::new(|r| guard(ip_guard, r, false))),
        (schema::GUARD_PATHS, Box::new(|r| guard(ip_guard, r, true))),
    ]
}

/// The element changes of `diff`: every removal first, then every
/// addition (a changed map value is removed and added in the same batch).
/// One message's elements at a time: at a full sync they are hundreds of
/// thousands.
fn elements(batch: &mut Batch, diff: &StateDiff, ip_guard: &Change<(IpAddr, u32)>) {
    let groups = groups(diff, ip_guard);
    for remove in [true, false] {
        for (set, make) in &groups {
            for l in &LAYOUTS {
                let mut mine = make(remove).filter(|e| Layout::of(&e.ip) == l);
                loop {
                    let chunk: Vec<Element> = mine.by_ref().take(ELEMENTS_PER_MESSAGE).collect();
                    if chunk.is_empty() {
                        break;
                    }
                    element_message(batch, (l.nfproto, l.name), set, &chunk, remove);
                }
            }
        }
    }
}

/// One message of element changes to set `set` of our table in family
/// `(nfproto, name)`.
pub(super) fn element_message(
    batch: &mut Batch,
    (nfproto, family): (u8, &str),
    set: &str,
    elems: &[Element],
    remove: bool,
) {
    let (msg, flags, verb) = if remove {
        (NFT_MSG_DELSETELEM, 0, "delete")
    } else {
        (NFT_MSG_NEWSETELEM, NLM_F_CREATE, "add")
    };
    let what = format!("{verb} {} element(s) of {family} {set}", elems.len());
    batch.add(msg, flags, nfproto, what, |w| {
        w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
        w.put_str(NFTA_SET_ELEM_LIST_SET, set);
        w.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |w| {
            for e in elems {
                w.nest(NFTA_LIST_ELEM, |w| {
                    w.put_data(NFTA_SET_ELEM_KEY, &e.key);
                    if let Some(end) = &e.key_end {
                        w.put_data(NFTA_SET_ELEM_KEY_END, end);
                    }
                    if e.interval_end {
                        w.put_u32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
                    }
                    if let (Some(value), false) = (&e.value, remove) {
                        w.put_data(NFTA_SET_ELEM_DATA, value);
                    }
                });
            }
        });
    });
}
