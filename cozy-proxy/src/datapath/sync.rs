//! The one sync layer: what the kernel is asked to hold and what it holds
//! as of our last change, the adoption of what a previous instance left,
//! the diff, and the retry policy, for every backend alike.
use super::Counters;
use super::{
    BackendKind, Capacity, Change, Datapath, DatapathState, Desired, Dump, Entries, Kernel,
    Overflow, PathOf, Paths, RemotePods, StateDiff, SyncReport,
};
use known::{Known, Way};
use std::{collections::BTreeSet, net::IpAddr};
use tracing::{debug, info, warn};

mod known;

pub struct Synced<K: Kernel> {
    kernel: K,
    /// What the caller asks the kernel to hold, changed by every sync; its
    /// `guard` and `routes` are those of the last sync that applied it
    /// whole.
    planned: DatapathState,
    /// What the kernel holds, as of our last successful change (see
    /// [`Known`] for the rule its transitions keep).
    known: Known,
    /// The reverse of the state last asked of the kernel's `remote`: the
    /// guards of an incremental sync and the backend's apply
    /// ([`Desired`]) look a remote pod up by its address.
    remote_pods: RemotePods,
    /// The kernel's paths may have changed since the held state was
    /// resolved: the next sync resolves every address again.
    stale_paths: bool,
    /// LB IPs per step of a fresh install (see [`install_in_parts`]).
    part_lbs: usize,
}

/// LB IPs per step of a fresh install: the diff and the nf_tables batch
/// (or BPF map writes) of every Service are never held at once, so a
/// fresh install's peak stays the synced size.
pub const PART_LBS: usize = 4096;

impl<K: Kernel> Synced<K> {
    pub fn new(kernel: K) -> Self {
        Synced {
            kernel,
            planned: DatapathState::default(),
            known: Known::Unread,
            remote_pods: RemotePods::default(),
            stale_paths: false,
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

    /// The kernel's state read afresh (what a previous instance, or our
    /// own last run, left), and what its schema needs.
    fn read(&mut self) -> Result<(DatapathState, K::Found), K::Error> {
        let started = std::time::Instant::now();
        let (mut live, found) = self.kernel.read()?;
        // Planned only: what the kernel "holds" of it is the plan.
        live.remote_hosts = self.planned.remote_hosts.clone();
        debug!(took = ?started.elapsed(), "kernel read");
        if live.has_mappings() {
            info!(backend = %self.kernel.kind(), elements = live.len(), "adopting the datapath found in the kernel");
        }
        Ok((live, found))
    }

    /// The full way from `held` (what the kernel holds; `None`: read it)
    /// to `planned`: what the tables can hold of it, every address
    /// resolved, everything compared and written.
    fn try_sync(&mut self, held: Option<DatapathState>) -> Result<SyncReport, K::Error> {
        let (held, found) = match held {
            Some(held) => (held, None),
            None => self.read().map(|(held, found)| (held, Some(found)))?,
        };
        let Fitted {
            mut fitted,
            overflow,
            needs,
        } = fit(
            &self.planned,
            &held,
            &self.kernel.capacity(),
            self.kernel.kind(),
        );
        let whole = fitted.is_none();
        let target = match &mut fitted {
            Some(f) => f,
            None => &mut self.planned,
        };
        let started = std::time::Instant::now();
        let paths = self.kernel.paths(&target.pods())?;
        debug!(pods = paths.len(), took = ?started.elapsed(), "paths toward the pods");
        target.resolve(paths);
        self.remote_pods = RemotePods::of(target);
        let desired = Desired {
            state: target,
            remote_pods: &self.remote_pods,
        };
        let lbs = match whole && !held.has_mappings() {
            true => target.lb_ips(),
            false => Vec::new(),
        };
        let written = if lbs.len() > self.part_lbs {
            install_in_parts(&mut self.kernel, held, desired, &lbs, self.part_lbs, found)?
        } else {
            write(&mut self.kernel, held, desired, found)?
        };
        let elements = target.len();
        self.known = Known::written(fitted, written.complete, needs);
        self.stale_paths = false;
        Ok(SyncReport {
            changed_elements: written.changed + written.applied.extra_changes,
            installed_schema: written.applied.installed_schema,
            overflow,
            elements,
        })
    }

    /// `first`, or if it failed one more attempt, the full way from a
    /// fresh read of the kernel.
    fn retried(&mut self, first: Result<SyncReport, K::Error>) -> Result<SyncReport, K::Error> {
        first.or_else(|e| {
            warn!(backend = %self.kernel.kind(), error = %e, "sync failed; re-reading the kernel's state and retrying");
            self.try_sync(None)
        })
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
        self.known = Known::written(None, true, needs);
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
) -> Result<Written, K::Error> {
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
    Ok(Written {
        changed,
        applied: super::Applied {
            extra_changes: extra,
            installed_schema: installed,
        },
        complete,
    })
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

/// What the tables can hold of a plan.
struct Fitted {
    /// `None`: the whole plan (no copy made); else what of it fits.
    fitted: Option<DatapathState>,
    /// What is left out for lack of room.
    overflow: Overflow,
    /// What the target needs of the tables.
    needs: Entries,
}

/// What the tables of `capacity` can hold of `planned`, the kernel
/// holding `held` (what it holds keeps its place): a copy only where
/// they cannot hold it all.
fn fit(
    planned: &DatapathState,
    held: &DatapathState,
    capacity: &Capacity,
    kind: BackendKind,
) -> Fitted {
    let needs = Entries::of_state(planned);
    if needs.fits(capacity) {
        return Fitted {
            fitted: None,
            overflow: Overflow::default(),
            needs,
        };
    }
    let mut fitted = planned.clone();
    let (overflow, needs) = fitted.fit(capacity, Some(held));
    if !overflow.is_empty() {
        warn!(
            backend = %kind,
            left_out = overflow.left_out.len(),
            full = ?overflow.full,
            "the datapath's tables are full: LB IPs left out (the rest is applied)"
        );
    }
    Fitted {
        fitted: Some(fitted),
        overflow,
        needs,
    }
}

/// What writing a state did.
struct Written {
    /// Elements removed plus added.
    changed: usize,
    applied: super::Applied,
    /// The kernel holds the whole target (else it is to be read again).
    complete: bool,
}

/// `desired` written in one apply onto a kernel holding `held`.
fn write<K: Kernel>(
    kernel: &mut K,
    held: DatapathState,
    desired: Desired<'_>,
    found: Option<K::Found>,
) -> Result<Written, K::Error> {
    let started = std::time::Instant::now();
    let diff = held.diff(desired.state);
    drop(held);
    let applied = kernel.apply(&diff, desired, found)?;
    debug!(elements = diff.size(), took = ?started.elapsed(), "kernel changed");
    Ok(Written {
        changed: diff.size(),
        applied,
        complete: true,
    })
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
        let held = self.known.start(&mut self.planned);
        self.planned = desired;
        let first = self.try_sync(held);
        self.retried(first)
    }

    /// Incremental when [`Known::way`] says so
    /// ([`Synced::try_sync_change`]); else, or on a failure, the full way.
    fn sync_change(&mut self, change: &StateDiff) -> Result<Option<SyncReport>, K::Error> {
        let (added, removed) = change.needs();
        let way = self.known.way(added, removed, &self.kernel.capacity());
        // What the kernel holds, before `planned` changes.
        let held = self.known.start_change(way, &self.planned);
        if let Err(collection) = self.planned.apply(change) {
            // Never expected (the plan and its state move together); the
            // caller gives the whole state, and the kernel is read again.
            warn!(
                collection,
                "the planned state lost track of the plan; computing it again"
            );
            return Ok(None);
        }
        let first = match way {
            Way::Incremental(needs) => self.try_sync_change(change, needs),
            Way::Full => self.try_sync(held),
        };
        self.retried(first).map(Some)
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

    /// News that could not be read may have told a change: the next sync
    /// resolves every address again, as after news of one.
    fn paths_news(&mut self) -> Result<bool, K::Error> {
        let news = self.kernel.paths_news();
        self.stale_paths |= news.as_ref().map_or(true, |changed| *changed);
        news
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
