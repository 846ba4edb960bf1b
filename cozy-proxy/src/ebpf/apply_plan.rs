//! An apply of the maps as ordered steps, decided without the kernel from
//! the diff, the desired state and what this process believes the maps
//! hold. [`Maps`](super::maps::Maps) only executes the steps.
//!
//! The order is the rule that traffic never passes unfiltered, kept in one
//! place, [`ApplyPlan::steps`]:
//! - an address's prefilter bit goes up before its `addrs` entry, and down
//!   after the entry left (the programs skip an address without its bit),
//!   as do the in-cluster ranges' hint bits around the `cluster` trie;
//! - a filtered pod's ports, and an LB IP's source and cluster ranges, go
//!   in before the entries that apply them, and out after;
//! - a pod's remembered flows are forgotten before its entry is written
//!   where they would be consulted;
//! - a counter slot given anew is zeroed before an address counting in it
//!   is written; a pod mapped anew starts its flow count at zero.
use super::addr_bits::AddrBits;
use super::slots::{Slots, Written};
use super::EbpfError;
use crate::datapath::{AllowedPort, Change, DatapathState, Desired, RemotePods, StateDiff};
use crate::model::{Cidr, IpRange};
use cozy_proxy_common::{addr, prefilter, AddrInfo, IpKey, PortKey};
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
};

pub fn key(ip: &IpAddr) -> IpKey {
    IpKey::from(*ip)
}

pub fn ip(k: &IpKey) -> IpAddr {
    IpAddr::from(*k)
}

pub fn port_key(p: &AllowedPort) -> PortKey {
    PortKey {
        pod: key(&p.pod),
        proto: p.proto,
        _pad: 0,
        port: p.port,
    }
}

/// What this process believes the maps hold, kept from one apply to the
/// next so that a change costs what it touches, not a read of every entry.
/// Read again from the kernel after a resync or a failure.
pub struct Belief {
    /// `addrs` as written.
    pub addrs: BTreeMap<IpAddr, Written>,
    /// The counter slots in use.
    pub slots: Slots,
    /// The prefilter's address bits, those of `addrs`' entries.
    pub bits: AddrBits,
    /// The prefilter was written in full since the belief was read: the
    /// first apply after a read rewrites it, repairing one lost or stale.
    pub prefilter_written: bool,
}

impl Belief {
    /// The belief of maps whose `addrs` holds `addrs`.
    pub fn of(addrs: BTreeMap<IpAddr, Written>) -> Belief {
        Belief {
            bits: AddrBits::of(addrs.iter().map(|(a, w)| (key(a), w.flags))),
            slots: Slots::of(&addrs),
            addrs,
            prefilter_written: false,
        }
    }
}

/// Prefixes of the `cluster` and `src_ranges` tries.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Ranges {
    pub cluster: Vec<Cidr>,
    /// `(LB IP, source prefix)`.
    pub sources: Vec<(IpAddr, Cidr)>,
}

impl Ranges {
    fn is_empty(&self) -> bool {
        self.cluster.is_empty() && self.sources.is_empty()
    }
}

/// The `addrs` writes of an apply, in their own order: deletions (a slot
/// they free may serve an entry written after), the counters of slots
/// freed or given anew zeroed, then the entries written.
#[derive(Default, Debug)]
pub struct AddrWrites {
    /// Entries known to be in the map (deleted in batches).
    pub gone: Vec<IpKey>,
    /// Entries that may be in the map (deleted one by one, absence being
    /// no error).
    pub gone_unknown: Vec<IpKey>,
    pub zero_slots: Vec<u16>,
    pub keys: Vec<IpKey>,
    pub infos: Vec<AddrInfo>,
}

impl AddrWrites {
    fn is_empty(&self) -> bool {
        self.gone.is_empty() && self.gone_unknown.is_empty() && self.keys.is_empty()
    }
}

/// One apply, phase by phase; [`ApplyPlan::steps`] gives their order.
#[derive(Default, Debug)]
pub struct ApplyPlan {
    /// Addresses taking prefilter roles; the prefilter is written before
    /// the entries when they or the cluster ranges entering are not empty
    /// (the ranges' hint bits).
    pub bits_up: Vec<(IpKey, u8)>,
    pub ports_in: Vec<PortKey>,
    pub ranges_in: Ranges,
    /// Pods whose remembered flows are forgotten before their entries.
    pub forget_flows: BTreeSet<IpKey>,
    pub addrs: AddrWrites,
    /// Flow-count slots of pods mapped anew, zeroed.
    pub flow_counts_zeroed: Vec<u32>,
    pub ranges_out: Ranges,
    pub ports_out: Vec<PortKey>,
    /// Addresses losing prefilter roles.
    pub bits_down: Vec<(IpKey, u8)>,
    /// The prefilter is written after the rest: something left, or it has
    /// not been written in full since the belief was read.
    pub rewrite_prefilter: bool,
}

/// One phase of an apply, with its elements.
#[derive(Debug)]
pub enum Step<'p> {
    PrefilterUp {
        addrs: &'p [(IpKey, u8)],
        cluster: &'p [Cidr],
    },
    PortsIn(&'p [PortKey]),
    RangesIn(&'p Ranges),
    ForgetFlows(&'p BTreeSet<IpKey>),
    Addrs(&'p AddrWrites),
    ZeroFlowCounts(&'p [u32]),
    RangesOut(&'p Ranges),
    PortsOut(&'p [PortKey]),
    PrefilterDown(&'p [(IpKey, u8)]),
}

impl ApplyPlan {
    /// The phases that have work, in the order they run (see the module's
    /// rule).
    pub fn steps(&self) -> Vec<Step<'_>> {
        let mut out = Vec::new();
        if !self.bits_up.is_empty() || !self.ranges_in.cluster.is_empty() {
            out.push(Step::PrefilterUp {
                addrs: &self.bits_up,
                cluster: &self.ranges_in.cluster,
            });
        }
        if !self.ports_in.is_empty() {
            out.push(Step::PortsIn(&self.ports_in));
        }
        if !self.ranges_in.is_empty() {
            out.push(Step::RangesIn(&self.ranges_in));
        }
        if !self.forget_flows.is_empty() {
            out.push(Step::ForgetFlows(&self.forget_flows));
        }
        if !self.addrs.is_empty() {
            out.push(Step::Addrs(&self.addrs));
        }
        if !self.flow_counts_zeroed.is_empty() {
            out.push(Step::ZeroFlowCounts(&self.flow_counts_zeroed));
        }
        if !self.ranges_out.is_empty() {
            out.push(Step::RangesOut(&self.ranges_out));
        }
        if !self.ports_out.is_empty() {
            out.push(Step::PortsOut(&self.ports_out));
        }
        if !self.bits_down.is_empty() || self.rewrite_prefilter {
            out.push(Step::PrefilterDown(&self.bits_down));
        }
        out
    }
}

/// Plans the apply of `diff` (from what the maps hold to `desired`),
/// updating `belief` to what the maps hold once the plan ran (the caller
/// forgets it when a step fails) and `sweep` with the flows and reverse
/// translations left to the next sweep. `peer_links`: interfaces whose
/// peer is a pod's end (see [`addr::PATH_PEER`]).
pub fn plan(
    diff: &StateDiff,
    desired: Desired<'_>,
    belief: &mut Belief,
    sweep: &mut FlowSweep,
    peer_links: &BTreeSet<u32>,
) -> Result<ApplyPlan, EbpfError> {
    let Desired {
        state: desired,
        remote_pods,
    } = desired;
    // Every table of the diff, and where it goes: a table added to the
    // state does not compile until it has its place here.
    let StateDiff {
        pod_svc: _,           // `addrs` (pods), flows forgotten, flow counts
        svc_pod: _,           // `addrs` (LB IPs), reverse translations
        remote: _,            // `addrs` (LB IPs and their pods)
        filtered_pods: _,     // `addrs` flags, flows forgotten
        allowed_ports: _,     // `allowed_ports`
        icmp_allowed_pods: _, // `addrs` flags
        unmapped_lbs: _,      // `addrs`
        cluster: _,           // `cluster` trie, prefilter hint bits
        ranged_lbs: _,        // `addrs` flags, flows forgotten
        source_ranges: _,     // `src_ranges` trie
        guard: _,             // `addrs` (`src_ifindex`)
        routes: _,            // `addrs` (`path_ifindex`); the routes: `steer.rs`
        remote_hosts: _,      // planned only
    } = diff;
    // What `addrs` is to say of each address the diff touches, decided
    // once (a full sync's step asks it of 8 000 addresses).
    let wanted: Vec<(IpAddr, Option<AddrInfo>)> = touched_addresses(diff, desired)
        .into_iter()
        .map(|a| (a, entry(&a, desired, remote_pods, peer_links)))
        .collect();
    let mut plan = ApplyPlan::default();
    // The addresses with a bit are those `addrs` holds, in the bitmaps of
    // their entries' roles.
    for (a, info) in &wanted {
        let had = belief.addrs.get(a).map_or(0, |w| prefilter::roles(w.flags));
        let has = info.as_ref().map_or(0, |i| prefilter::roles(i.flags));
        if has & !had != 0 {
            plan.bits_up.push((key(a), has & !had));
        }
        if had & !has != 0 {
            plan.bits_down.push((key(a), had & !has));
        }
    }
    plan.ports_in = diff.allowed_ports.add.iter().map(port_key).collect();
    plan.ports_out = diff.allowed_ports.remove.iter().map(port_key).collect();
    plan.ranges_in = Ranges {
        cluster: diff.cluster.add.iter().flat_map(IpRange::cidrs).collect(),
        sources: (diff.source_ranges.add.iter())
            .flat_map(|(lb, r)| r.cidrs().into_iter().map(move |c| (*lb, c)))
            .collect(),
    };
    plan.ranges_out = ranges_out(diff, desired);
    plan.forget_flows = forget_flows(diff, desired, &wanted, sweep);
    plan.addrs = addr_writes(wanted, belief)?;
    // A pod mapped here anew starts with no flows (a reused IP's were
    // forgotten before): its count too, whatever its slot held before.
    plan.flow_counts_zeroed = (diff.pod_svc.add.iter())
        .filter_map(|(pod, _)| belief.addrs.get(pod).map(|w| u32::from(w.slot)))
        .collect();
    // Rewritten in full at every sync that follows a read (startup,
    // resync): a prefilter lost or stale is repaired there.
    plan.rewrite_prefilter =
        !plan.bits_down.is_empty() || !diff.cluster.remove.is_empty() || !belief.prefilter_written;
    belief.prefilter_written = true;
    Ok(plan)
}

/// The prefixes `diff` removes that `desired` no longer needs: a prefix
/// two ranges share stays while either does. What stays is computed only
/// when something goes.
fn ranges_out(diff: &StateDiff, desired: &DatapathState) -> Ranges {
    let want_cluster: BTreeSet<Cidr> = match diff.cluster.remove.is_empty() {
        true => BTreeSet::new(),
        false => desired.cluster.iter().flat_map(IpRange::cidrs).collect(),
    };
    let leaving: BTreeSet<&IpAddr> = diff.source_ranges.remove.iter().map(|(lb, _)| lb).collect();
    let want_sources: BTreeSet<(IpAddr, Cidr)> = (desired.source_ranges.iter())
        .filter(|(lb, _)| leaving.contains(lb))
        .flat_map(|(lb, r)| r.cidrs().into_iter().map(move |c| (*lb, c)))
        .collect();
    Ranges {
        cluster: (diff.cluster.remove.iter())
            .flat_map(IpRange::cidrs)
            .filter(|c| !want_cluster.contains(c))
            .collect(),
        sources: (diff.source_ranges.remove.iter())
            .flat_map(|(lb, r)| r.cidrs().into_iter().map(move |c| (*lb, c)))
            .filter(|pair| !want_sources.contains(pair))
            .collect(),
    }
}

/// The pods whose flows are forgotten before their entries are written;
/// the others that no longer remember theirs are left to the sweep.
fn forget_flows(
    diff: &StateDiff,
    desired: &DatapathState,
    wanted: &[(IpAddr, Option<AddrInfo>)],
    sweep: &mut FlowSweep,
) -> BTreeSet<IpKey> {
    // The flows of pods that no longer remember them, and of a pod mapped
    // anew (its IP reused by another pod).
    let mut forgotten: BTreeSet<IpKey> = diff.pod_svc.remove.iter().map(|(p, _)| key(p)).collect();
    forgotten.extend(
        (diff.filtered_pods.remove.iter())
            .filter(|p| !remembers(p, desired))
            .map(key),
    );
    for lb in &diff.ranged_lbs.remove {
        if let Some(pod) = desired.svc_pod.get(lb).filter(|p| !remembers(p, desired)) {
            forgotten.insert(key(pod));
        }
    }
    sweep.stale_flows.extend(forgotten);
    let pairs = |c: &Change<(IpAddr, IpAddr)>, add: bool| -> Vec<(IpKey, IpKey)> {
        (c.side(add).iter())
            .map(|(lb, pod)| (key(lb), key(pod)))
            .collect()
    };
    for c in [&diff.svc_pod, &diff.remote] {
        sweep.stale_rev.extend(pairs(c, false));
    }
    for c in [&diff.svc_pod, &diff.remote] {
        for pair in pairs(c, true) {
            sweep.stale_rev.remove(&pair);
        }
    }
    // A stale pod is consulted once it remembers flows again, which takes
    // a change of its entry: only touched pods are asked (after an
    // emptying every pod is stale).
    (wanted.iter())
        .map(|(a, _)| key(a))
        .filter(|k| sweep.stale_flows.contains(k) && remembers(&ip(k), desired))
        .collect()
}

/// The `addrs` writes that give each `wanted` address its entry (one to
/// have none is deleted), with counter slots: a local mapping keeps its
/// slot while it lives, one freed is zeroed and may serve a mapping added
/// in the same apply.
fn addr_writes(
    wanted: Vec<(IpAddr, Option<AddrInfo>)>,
    belief: &mut Belief,
) -> Result<AddrWrites, EbpfError> {
    let mut out = AddrWrites::default();
    if wanted.is_empty() {
        return Ok(out);
    }
    let (known, slots) = (&mut belief.addrs, &mut belief.slots);
    let all_new = known.is_empty();
    slots.begin();
    for (a, info) in wanted {
        match info {
            None => match known.remove(&a) {
                Some(old) => {
                    slots.release(&old);
                    out.gone.push(key(&a));
                }
                None => out.gone_unknown.push(key(&a)),
            },
            Some(info) => {
                out.keys.push(key(&a));
                out.infos.push(info);
            }
        }
    }
    for (k, info) in out.keys.iter().zip(out.infos.iter_mut()) {
        let a = ip(k);
        if let Some(old) = known
            .get(&a)
            .filter(|old| old.local_lb() && !Written::of(info).local_lb())
        {
            // No longer a local mapping (its pod went elsewhere): its slot
            // is free again.
            slots.release(old);
        }
        if info.flags & addr::LOCAL != 0 {
            // The LB IP and its pod share the mapping's slot.
            let lb = if info.flags & addr::LB != 0 {
                a
            } else {
                ip(&info.peer)
            };
            info.slot = slots.of_lb(&lb, known)?;
        }
        known.insert(a, Written::of(info));
    }
    out.zero_slots = slots.take_zeroed();
    if all_new {
        crate::datapath::repack(known);
    }
    Ok(out)
}

/// The addresses whose `addrs` entry `diff` may change: those it names,
/// and the other half of a local mapping whose policy it changes (a
/// filtered pod's policy is on its LB IP too, an LB IP's ranges on its pod).
fn touched_addresses(diff: &StateDiff, desired: &DatapathState) -> BTreeSet<IpAddr> {
    let mut touched = diff.mapping_addresses();
    for c in [
        &diff.filtered_pods,
        &diff.icmp_allowed_pods,
        &diff.ranged_lbs,
    ] {
        touched.extend(c.elements().copied());
    }
    touched.extend(diff.guard.elements().map(|(a, _)| *a));
    touched.extend(diff.routes.elements().map(|(a, _)| *a));
    let policies = diff
        .filtered_pods
        .elements()
        .chain(diff.icmp_allowed_pods.elements());
    touched.extend(policies.filter_map(|pod| desired.pod_svc.get(pod)));
    let ranged = diff.ranged_lbs.elements();
    touched.extend(ranged.filter_map(|lb| desired.svc_pod.get(lb)));
    touched
}

/// Whether the programs remember `pod`'s flows: replies to it pass the
/// port filter (a filtered pod) and the source ranges (a ranged LB IP's).
fn remembers(pod: &IpAddr, desired: &DatapathState) -> bool {
    desired.filtered_pods.contains(pod)
        || desired
            .pod_svc
            .get(pod)
            .is_some_and(|lb| desired.ranged_lbs.contains(lb))
}

/// What `addrs` must say about address `a` in `desired` (`None`: nothing).
fn entry(
    a: &IpAddr,
    desired: &DatapathState,
    remote_pods: &RemotePods,
    peer_links: &BTreeSet<u32>,
) -> Option<AddrInfo> {
    let guard = desired.guard.get(a).copied().unwrap_or(0);
    let path = |lb: &IpAddr| desired.routes.get(lb).map_or(0, |h| h.oif);
    let policy = |pod: &IpAddr| {
        let mut f = 0;
        if desired.filtered_pods.contains(pod) {
            f |= addr::FILTERED;
            if desired.icmp_allowed_pods.contains(pod) {
                f |= addr::ICMP_ALLOWED;
            }
        }
        f
    };
    let ranged = |lb: &IpAddr| {
        if desired.ranged_lbs.contains(lb) {
            addr::RANGED
        } else {
            0
        }
    };
    let info = |peer: &IpAddr, src_ifindex, path_ifindex: u32, flags| AddrInfo {
        peer: key(peer),
        src_ifindex,
        path_ifindex,
        flags: if peer_links.contains(&path_ifindex) {
            flags | addr::PATH_PEER
        } else {
            flags
        },
        slot: 0,
    };
    if let Some(pod) = desired.svc_pod.get(a) {
        let flags = addr::LB | addr::LOCAL | policy(pod) | ranged(a);
        return Some(info(pod, guard, path(a), flags));
    }
    if let Some(lb) = desired.pod_svc.get(a) {
        let flags = addr::POD | addr::LOCAL | policy(a) | ranged(lb);
        return Some(info(lb, guard, path(lb), flags));
    }
    if let Some(pod) = desired.remote.get(a) {
        return Some(info(pod, guard, path(a), addr::LB | ranged(a)));
    }
    if let Some(lb) = remote_pods.lb_of(a) {
        return Some(info(lb, guard, path(lb), addr::POD));
    }
    if desired.unmapped_lbs.contains(a) {
        return Some(AddrInfo {
            flags: addr::LB | addr::UNMAPPED,
            ..Default::default()
        });
    }
    None
}

/// `addr` flags by name, as `dump` and the tests print them.
const FLAG_NAMES: [(u16, &str); 8] = [
    (addr::LB, "lb"),
    (addr::POD, "pod"),
    (addr::LOCAL, "local"),
    (addr::UNMAPPED, "unmapped"),
    (addr::FILTERED, "filtered"),
    (addr::ICMP_ALLOWED, "icmp"),
    (addr::RANGED, "ranged"),
    (addr::PATH_PEER, "peer"),
];

fn flag_names(flags: u16) -> String {
    let names: Vec<&str> = (FLAG_NAMES.iter())
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| *name)
        .collect();
    names.join(",")
}

fn role_names(roles: u8) -> String {
    let names: Vec<&str> = [
        (prefilter::ALL, "all"),
        (prefilter::PODS, "pods"),
        (prefilter::FOREIGN_LBS, "foreign"),
    ]
    .into_iter()
    .filter(|(bit, _)| roles & bit != 0)
    .map(|(_, name)| name)
    .collect();
    names.join(",")
}

fn list<T>(items: &[T], show: impl Fn(&T) -> String) -> String {
    items.iter().map(show).collect::<Vec<_>>().join(" ")
}

fn port(p: &PortKey) -> String {
    format!("{}/{}/{}", ip(&p.pod), p.proto, p.port)
}

fn ranges(r: &Ranges) -> String {
    let mut parts: Vec<String> = r.cluster.iter().map(|c| format!("cluster {c}")).collect();
    parts.extend(r.sources.iter().map(|(lb, c)| format!("{lb} from {c}")));
    parts.join(" ")
}

/// One line per step: the phase, then its elements.
impl fmt::Display for Step<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = |b: &[(IpKey, u8)]| list(b, |(k, r)| format!("{}[{}]", ip(k), role_names(*r)));
        match self {
            Step::PrefilterUp { addrs, cluster } => write!(
                f,
                "prefilter up: {} {}",
                bits(addrs),
                list(cluster, |c| format!("cluster {c}"))
            ),
            Step::PortsIn(p) => write!(f, "ports in: {}", list(p, port)),
            Step::RangesIn(r) => write!(f, "ranges in: {}", ranges(r)),
            Step::ForgetFlows(pods) => {
                let pods: Vec<IpKey> = pods.iter().copied().collect();
                write!(f, "forget flows: {}", list(&pods, |k| ip(k).to_string()))
            }
            Step::Addrs(w) => {
                let gone: Vec<IpKey> = w.gone.iter().chain(&w.gone_unknown).copied().collect();
                let put: Vec<(IpKey, AddrInfo)> = w
                    .keys
                    .iter()
                    .copied()
                    .zip(w.infos.iter().copied())
                    .collect();
                write!(
                    f,
                    "addrs: del [{}] zero slots {:?} put [{}]",
                    list(&gone, |k| ip(k).to_string()),
                    w.zero_slots,
                    list(&put, |(k, i)| format!(
                        "{} {} peer {} src {} path {} slot {}",
                        ip(k),
                        flag_names(i.flags),
                        ip(&i.peer),
                        i.src_ifindex,
                        i.path_ifindex,
                        i.slot
                    ))
                )
            }
            Step::ZeroFlowCounts(s) => write!(f, "flow counts zeroed: {s:?}"),
            Step::RangesOut(r) => write!(f, "ranges out: {}", ranges(r)),
            Step::PortsOut(p) => write!(f, "ports out: {}", list(p, port)),
            Step::PrefilterDown(b) => write!(f, "prefilter down: {}", bits(b)),
        }
    }
}

/// Work an apply leaves to the next sweep, and what the last count found.
#[derive(Default)]
pub struct FlowSweep {
    /// Pods whose remembered flows are to be forgotten: at once where the
    /// programs consult that pod's flows again (it is filtered or ranged
    /// after an apply: its IP reused, say), else at the next sweep. One
    /// pass over the flow map walks all its buckets, even empty: not one
    /// on every change that removes a pod.
    pub stale_flows: BTreeSet<IpKey>,
    /// (LB IP, pod) of mappings removed or moved to another pod: the
    /// reverse translations of in-cluster clients' flows through them are
    /// forgotten at the next sweep (one walk of `rev_nat`, only then).
    pub stale_rev: BTreeSet<(IpKey, IpKey)>,
    /// Counter slots the last count of flows found flows for.
    pub counted: HashSet<u16>,
}

#[cfg(test)]
mod tests;
