//! The one sync layer: what the kernel is asked to hold and what it holds
//! as of our last change, the adoption of what a previous instance left,
//! the diff, and the retry policy, for every backend alike.
use super::Counters;
use super::{
    BackendKind, Capacity, Change, Datapath, DatapathState, Desired, Dump, Entries, Kernel,
    Overflow, PathOf, Paths, RemotePods, StateDiff, SyncReport,
};
use std::{collections::BTreeSet, net::IpAddr};
use tracing::{debug, info, warn};

pub struct Synced<K: Kernel> {
    kernel: K,
    /// What the caller asks the kernel to hold, changed by every sync; its
    /// `guard` and `routes` are those of the last sync that applied it
    /// whole (see [`Known::Planned`]).
    planned: DatapathState,
    /// What the kernel holds, as of our last successful change.
    known: Known,
    /// The reverse of the state last asked of the kernel's `remote`: the
    /// guards of an incremental sync and the backend's apply
    /// ([`Desired`]) look a remote pod up by its address.
    remote_pods: RemotePods,
    /// The kernel's paths may have changed since the held state was
    /// resolved: the next sync resolves every address again.
    stale_paths: bool,
    /// What the held state needs of the backend's tables (see [`Entries`]).
    known_needs: Entries,
    /// What the last sync left out for lack of room: until it is empty,
    /// every sync takes the full way (which fits the state again, and
    /// takes back what now fits).
    overflow: Overflow,
    /// LB IPs per step of a fresh install (see [`install_in_parts`]).
    part_lbs: usize,
}

/// LB IPs per step of a fresh install: the diff and the nf_tables batch
/// (or BPF map writes) of every Service are never held at once, so a
/// fresh install's peak stays the synced size.
pub const PART_LBS: usize = 4096;

/// What the kernel holds. One copy of the state in the usual case, never
/// a second kept or cloned at a full sync: the state is a large part of
/// the controller's memory.
enum Known {
    /// Not known (before the first sync, after a failure, after
    /// [`Datapath::forget`]): the next sync reads the kernel.
    Unread,
    /// `planned`, guards and routes included.
    Planned,
    /// Another state: what its tables could hold of `planned`, or
    /// `planned` before it changed (the way to the new one failed).
    State(Box<DatapathState>),
}

impl<K: Kernel> Synced<K> {
    pub fn new(kernel: K) -> Self {
        Synced {
            kernel,
            planned: DatapathState::default(),
            known: Known::Unread,
            remote_pods: RemotePods::default(),
            stale_paths: false,
            known_needs: Entries::default(),
            overflow: Overflow::default(),
            part_lbs: PART_LBS,
        }
    }

    /// With fresh installs in steps of `lbs` LB IPs (tests take small ones).
    pub fn with_part_lbs(mut self, lbs: usize) -> Self {
        self.part_lbs = lbs.max(1);
        self
    }

    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    /// The kernel, for what lies outside the state the sync keeps (a
    /// backend switch's standby and wake).
    pub fn kernel_mut(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// What the kernel holds, taken out of `known` (which becomes
    /// [`Known::Unread`] until a sync succeeds); `None`: to be read.
    /// `planned_copy`: the kernel holds `planned` itself, and `planned` is
    /// about to change in place (a full way taken for a change).
    fn take_held(&mut self, planned_copy: bool) -> Option<DatapathState> {
        match std::mem::replace(&mut self.known, Known::Unread) {
            Known::Unread => None,
            Known::Planned if planned_copy => Some(self.planned.clone()),
            Known::Planned => Some(std::mem::take(&mut self.planned)),
            Known::State(s) => Some(*s),
        }
    }

    /// The full way from `held` (what the kernel holds; `None`: read it)
    /// to `planned`: everything resolved and compared.
    fn try_sync(&mut self, held: Option<DatapathState>) -> Result<SyncReport, K::Error> {
        let started = std::time::Instant::now();
        let (held, found) = match held {
            Some(held) => (held, None),
            None => {
                let (mut live, found) = self.kernel.read()?;
                // Planned only: what the kernel "holds" of it is the plan.
                live.remote_hosts = self.planned.remote_hosts.clone();
                debug!(took = ?started.elapsed(), "kernel read");
                (adopt(self.kernel.kind(), live), Some(found))
            }
        };
        let capacity = self.kernel.capacity();
        let needs = Entries::of_state(&self.planned);
        // What the tables can hold of `planned`: a copy only where they
        // cannot hold it all.
        let mut fitted = (!needs.fits(&capacity)).then(|| self.planned.clone());
        let (overflow, needs) = match &mut fitted {
            Some(f) => f.fit(&capacity, Some(&held)),
            None => (Overflow::default(), needs),
        };
        if !overflow.is_empty() {
            warn!(
                backend = %self.kernel.kind(),
                left_out = overflow.left_out.len(),
                full = ?overflow.full,
                "the datapath's tables are full: LB IPs left out (the rest is applied)"
            );
        }
        let whole = fitted.is_none();
        let target = match &mut fitted {
            Some(f) => f,
            None => &mut self.planned,
        };
        let started = std::time::Instant::now();
        let paths = match self.kernel.paths(&target.pods()) {
            Ok(p) => p,
            Err(e) => {
                self.known = Known::State(Box::new(held));
                return Err(e);
            }
        };
        debug!(pods = paths.len(), took = ?started.elapsed(), "paths toward the pods");
        target.resolve(paths);
        let started = std::time::Instant::now();
        let lbs = match whole && !held.has_mappings() {
            true => target.lb_ips(),
            false => Vec::new(),
        };
        self.remote_pods = RemotePods::of(target);
        let desired = Desired {
            state: target,
            remote_pods: &self.remote_pods,
        };
        let (changed_elements, applied, complete) = if lbs.len() > self.part_lbs {
            install_in_parts(&mut self.kernel, held, desired, &lbs, self.part_lbs, found)?
        } else {
            let diff = held.diff(target);
            drop(held);
            let applied = self.kernel.apply(&diff, desired, found)?;
            (diff.size(), applied, true)
        };
        debug!(elements = changed_elements, took = ?started.elapsed(), "kernel changed");
        self.known_needs = needs;
        let elements = target.len();
        // What we computed is what the kernel holds now: kept, not copied.
        self.known = match fitted {
            _ if !complete => Known::Unread,
            Some(f) => Known::State(Box::new(f)),
            None => Known::Planned,
        };
        self.stale_paths = false;
        self.overflow = overflow.clone();
        Ok(SyncReport {
            changed_elements: changed_elements + applied.extra_changes,
            installed_schema: applied.installed_schema,
            overflow,
            elements,
        })
    }

    /// [`Synced::try_sync`], and once more from a fresh read of the kernel
    /// if it fails.
    fn sync_full(&mut self, held: Option<DatapathState>) -> Result<SyncReport, K::Error> {
        match self.try_sync(held) {
            Ok(report) => Ok(report),
            Err(e) => {
                warn!(backend = %self.kernel.kind(), error = %e, "sync failed; re-reading the kernel's state and retrying");
                self.known = Known::Unread;
                self.try_sync(None)
            }
        }
    }

    /// The kernel from `planned` before `change` to `planned` now (the
    /// kernel holds the former, [`Known::Planned`], with nothing left
    /// out, and `needs` fits): only the addresses `change` touches are
    /// resolved and compared, O(the change); every address when the
    /// kernel's paths may have changed.
    fn try_sync_change(
        &mut self,
        change: &StateDiff,
        needs: Entries,
    ) -> Result<SyncReport, K::Error> {
        self.remote_pods.apply(&change.remote);
        let planned = &self.planned;
        let touched = if self.stale_paths {
            // The addresses guarded or routed before, and those now.
            let mut all: BTreeSet<IpAddr> = planned.guard.keys().copied().collect();
            all.extend(planned.routes.keys());
            all.extend(planned.guarded());
            all
        } else {
            change.mapping_addresses()
        };
        let pods: BTreeSet<IpAddr> = touched
            .iter()
            .flat_map(|a| {
                let own = planned.pod_svc.contains_key(a) || self.remote_pods.contains(a);
                let its = planned.svc_pod.get(a).or_else(|| planned.remote.get(a));
                let host = planned.remote_hosts.get(a);
                own.then_some(*a)
                    .into_iter()
                    .chain(its.copied())
                    .chain(host.copied())
            })
            .collect();
        let paths = self.kernel.paths(&pods)?;
        let mut diff = StateDiff {
            guard: Change::default(),
            routes: Change::default(),
            ..change.clone()
        };
        for a in &touched {
            let guard = planned.guard_of(a, self.remote_pods.contains(a), paths);
            changed_entry(&mut diff.guard, a, planned.guard.get(a), guard.as_ref());
            let route = planned.route_of(a, paths);
            changed_entry(&mut diff.routes, a, planned.routes.get(a), route.as_ref());
        }
        if let Err(collection) = self.planned.apply_resolved(&diff) {
            // Never expected: what is removed was read from `planned`.
            warn!(
                collection,
                "the guards or routes lost track of the kernel; syncing in full"
            );
            return self.try_sync(None);
        }
        let desired = Desired {
            state: &self.planned,
            remote_pods: &self.remote_pods,
        };
        let applied = self.kernel.apply(&diff, desired, None)?;
        self.known = Known::Planned;
        self.known_needs = needs;
        self.stale_paths = false;
        Ok(SyncReport {
            changed_elements: diff.size() + applied.extra_changes,
            installed_schema: applied.installed_schema,
            overflow: Overflow::default(),
            elements: self.planned.len(),
        })
    }
}

/// A fresh install (the kernel holds `held`: no mapping, perhaps in-cluster
/// ranges), in steps: the part of `target` that `part_lbs` of its LB IPs
/// `lbs` bring at a time (the first with the in-cluster ranges and the
/// schema `found` asks for). Each step leaves the kernel holding a whole
/// state, that of the Services installed so far, as if the others did not
/// exist yet: their LB IPs stay not ours a moment longer, as they were
/// before the install began. `target` is each step's `desired`: it
/// agrees with the step on every address the step touches. Returns the
/// elements changed, what the steps did, and whether the parts made the
/// whole (else the kernel is to be read again).
fn install_in_parts<K: Kernel>(
    kernel: &mut K,
    held: DatapathState,
    desired: Desired<'_>,
    lbs: &[IpAddr],
    part_lbs: usize,
    mut found: Option<K::Found>,
) -> Result<(usize, super::Applied, bool), K::Error> {
    info!(
        lb_ips = lbs.len(),
        steps = lbs.len().div_ceil(part_lbs),
        "installing onto a datapath that holds nothing of ours, in steps"
    );
    let mut from = Some(held);
    let (mut changed, mut installed, mut parts_len) = (0, false, 0);
    let mut extra = 0;
    let target = desired.state;
    for step in lbs.chunks(part_lbs) {
        let mut part = target.part_of(step);
        let diff = match from.take() {
            Some(held) => {
                part.cluster = target.cluster.clone();
                held.diff(&part)
            }
            None => DatapathState::default().diff(&part),
        };
        parts_len += part.len();
        drop(part);
        let applied = match kernel.apply_step(&diff, desired, found.take()) {
            Ok(applied) => applied,
            Err(e) => {
                // The first failure is the one told; nothing is left in
                // flight either way.
                if let Err(also) = kernel.settle() {
                    warn!(error = %also, "a fresh install's earlier step failed too");
                }
                return Err(e);
            }
        };
        changed += diff.size();
        extra += applied.extra_changes;
        installed |= applied.installed_schema;
    }
    kernel.settle()?;
    let complete = parts_len == target.len();
    if !complete {
        // Never expected (a state is the sum of its parts); the next sync
        // reads the kernel and repairs what is missing.
        warn!(
            parts = parts_len,
            state = target.len(),
            "a fresh install in parts left elements out"
        );
    }
    Ok((
        changed,
        super::Applied {
            extra_changes: extra,
            installed_schema: installed,
        },
        complete,
    ))
}

/// Records in `change` that the entry of `key` goes from `old` to `new`.
fn changed_entry<V: Copy + PartialEq>(
    change: &mut Change<(IpAddr, V)>,
    key: &IpAddr,
    old: Option<&V>,
    new: Option<&V>,
) {
    if old == new {
        return;
    }
    change.remove.extend(old.map(|v| (*key, *v)));
    change.add.extend(new.map(|v| (*key, *v)));
}

/// The state a datapath found in the kernel at a fresh read: what a
/// previous instance (or our own last run) left, taken over as it is.
fn adopt(kind: BackendKind, live: DatapathState) -> DatapathState {
    if live.has_mappings() {
        info!(backend = %kind, elements = live.len(), "adopting the datapath found in the kernel");
    }
    live
}

impl<K: Kernel> Datapath for Synced<K> {
    type Error = K::Error;

    fn kind(&self) -> BackendKind {
        self.kernel.kind()
    }

    fn capacity(&self) -> Capacity {
        self.kernel.capacity()
    }

    /// One attempt from what we believe the kernel holds; if it fails (an
    /// element or a table removed behind our back, a pinned map replaced),
    /// one more from a fresh read of the kernel. A second failure is
    /// returned: the kernel keeps its last state and the caller retries.
    fn sync(&mut self, desired: DatapathState) -> Result<SyncReport, K::Error> {
        let held = self.take_held(false);
        self.planned = desired;
        self.sync_full(held)
    }

    /// Incremental when it can be (the kernel holds `planned`, nothing
    /// is left out, the change fits: [`Synced::try_sync_change`]); else,
    /// or on a failure, the full way.
    fn sync_change(&mut self, change: &StateDiff) -> Result<Option<SyncReport>, K::Error> {
        let (added, removed) = change.needs();
        let needs = self.known_needs.plus(added).minus(removed);
        let incremental = matches!(self.known, Known::Planned)
            && self.overflow.is_empty()
            && needs.fits(&self.kernel.capacity());
        // What the kernel holds, before `planned` changes.
        let held = if incremental {
            self.known = Known::Unread;
            None
        } else {
            self.take_held(true)
        };
        if let Err(collection) = self.planned.apply(change) {
            // Never expected (the plan and its state move together); the
            // caller gives the whole state.
            warn!(
                collection,
                "the planned state lost track of the plan; computing it again"
            );
            self.known = held.map_or(Known::Unread, |h| Known::State(Box::new(h)));
            return Ok(None);
        }
        if !incremental {
            return self.sync_full(held).map(Some);
        }
        match self.try_sync_change(change, needs) {
            Ok(report) => Ok(Some(report)),
            Err(e) => {
                warn!(backend = %self.kernel.kind(), error = %e, "sync failed; re-reading the kernel's state and retrying");
                self.known = Known::Unread;
                self.try_sync(None).map(Some)
            }
        }
    }

    fn forget(&mut self) {
        self.known = Known::Unread;
    }

    fn upkeep(&mut self) -> Result<bool, K::Error> {
        let foreign = self.kernel.foreign_changes()?;
        if foreign {
            info!(backend = %self.kernel.kind(), "our kernel state was changed by someone else; reading it again to repair it");
            self.known = Known::Unread;
        }
        let paths_changed = self.kernel.upkeep()?;
        self.stale_paths |= paths_changed;
        Ok(paths_changed || foreign)
    }

    fn paths_news(&mut self) -> Result<bool, K::Error> {
        let changed = self.kernel.paths_news()?;
        self.stale_paths |= changed;
        Ok(changed)
    }

    fn paths_of(&mut self, pods: &BTreeSet<IpAddr>) -> Result<Paths, K::Error> {
        if pods.is_empty() {
            return Ok(Paths::new());
        }
        let paths = self.kernel.paths(pods)?;
        Ok(pods
            .iter()
            .map(|p| (*p, paths.path_of(p).copied()))
            .collect())
    }

    fn dump(&self) -> Result<Dump, K::Error> {
        self.kernel.dump()
    }

    fn counters(&self) -> Result<Counters, K::Error> {
        self.kernel.counters()
    }

    fn cleanup(&mut self) -> Result<(), K::Error> {
        self.known = Known::Unread;
        self.kernel.cleanup()
    }
}
