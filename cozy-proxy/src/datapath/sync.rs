//! The one sync layer: what the kernel holds as of our last change, the
//! adoption of what a previous instance left, the diff, and the retry
//! policy, for every backend alike.
use super::Counters;
use super::{
    BackendKind, Change, Datapath, DatapathState, Dump, Entries, Kernel, Overflow, RemotePods,
    StateDiff, SyncReport,
};
use std::{collections::BTreeSet, net::IpAddr};
use tracing::{debug, info, warn};

pub struct Synced<K: Kernel> {
    kernel: K,
    /// What the kernel holds, as of our last successful change. `None`
    /// before the first sync, after a failure and after [`Datapath::forget`]:
    /// the next sync reads the kernel again.
    known: Option<DatapathState>,
    /// The reverse of `known.remote`: the guards of an incremental sync
    /// look a remote pod up by its address.
    remote_pods: RemotePods,
    /// The kernel's paths may have changed since `known` was resolved: the
    /// next sync resolves every address again.
    stale_paths: bool,
    /// What `known` needs of the backend's tables (see [`Entries`]).
    known_needs: Entries,
    /// What the last sync left out for lack of room: until it is empty,
    /// every sync takes the full way (which fits the state again, and
    /// takes back what now fits).
    overflow: Overflow,
}

impl<K: Kernel> Synced<K> {
    pub fn new(kernel: K) -> Self {
        Synced {
            kernel,
            known: None,
            remote_pods: RemotePods::default(),
            stale_paths: false,
            known_needs: Entries::default(),
            overflow: Overflow::default(),
        }
    }

    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    fn try_sync(&mut self, desired: &DatapathState) -> Result<SyncReport, K::Error> {
        let started = std::time::Instant::now();
        let (known, found) = match self.known.take() {
            Some(known) => (known, None),
            None => {
                let (live, found) = self.kernel.read()?;
                debug!(took = ?started.elapsed(), "kernel read");
                (adopt(self.kernel.kind(), live), Some(found))
            }
        };
        let mut desired = desired.clone();
        let (overflow, needs) = desired.fit(&self.kernel.capacity(), Some(&known));
        if !overflow.is_empty() {
            warn!(
                backend = %self.kernel.kind(),
                left_out = overflow.left_out.len(),
                full = ?overflow.full,
                "the datapath's tables are full: LB IPs left out (the rest is applied)"
            );
        }
        let started = std::time::Instant::now();
        let paths = match self.kernel.paths(&desired.pods()) {
            Ok(p) => p,
            Err(e) => {
                self.known = Some(known);
                return Err(e);
            }
        };
        debug!(pods = paths.len(), took = ?started.elapsed(), "paths toward the pods");
        desired.resolve(paths);
        let diff = known.diff(&desired);
        let started = std::time::Instant::now();
        let applied = self.kernel.apply(&diff, &desired, found)?;
        debug!(elements = diff.size(), took = ?started.elapsed(), "kernel changed");
        // Guards and routes, resolved since, need no table entries.
        self.known_needs = needs;
        self.remote_pods = RemotePods::of(&desired);
        // What we computed is what the kernel holds now: kept, not copied.
        self.known = Some(desired);
        self.stale_paths = false;
        self.overflow = overflow.clone();
        Ok(SyncReport {
            changed_elements: diff.size() + applied.extra_changes,
            installed_schema: applied.installed_schema,
            overflow,
        })
    }

    /// The kernel from `known` to `desired`, where `change` turns the
    /// state of the last sync into `desired`: only the addresses it touches
    /// are resolved and compared, O(the change). `None` where it cannot be
    /// done so (nothing known, the paths may have changed): the caller
    /// takes the full way.
    fn try_sync_change(
        &mut self,
        desired: &DatapathState,
        change: &StateDiff,
    ) -> Result<Option<SyncReport>, K::Error> {
        if self.stale_paths || self.known.is_none() || !self.overflow.is_empty() {
            return Ok(None);
        }
        // A change that would not fit takes the full way, which fits it.
        let (added, removed) = change.needs();
        let needs = self.known_needs.plus(added).minus(removed);
        if !needs.fits(&self.kernel.capacity()) {
            return Ok(None);
        }
        let touched = change.mapping_addresses();
        self.remote_pods.apply(&change.remote);
        let pods: BTreeSet<IpAddr> = touched
            .iter()
            .flat_map(|a| {
                let own = desired.pod_svc.contains_key(a) || self.remote_pods.contains(a);
                let its = desired.svc_pod.get(a).or_else(|| desired.remote.get(a));
                own.then_some(*a).into_iter().chain(its.copied())
            })
            .collect();
        let paths = self.kernel.paths(&pods)?;
        let Some(known) = self.known.as_mut() else {
            return Ok(None);
        };
        let mut diff = StateDiff {
            guard: Change::default(),
            routes: Change::default(),
            ..change.clone()
        };
        for a in &touched {
            let guard = desired.guard_of(a, self.remote_pods.contains(a), paths);
            changed_entry(&mut diff.guard, a, known.guard.get(a), guard.as_ref());
            let route = desired.route_of(a, paths);
            changed_entry(&mut diff.routes, a, known.routes.get(a), route.as_ref());
        }
        if let Err(collection) = known.apply(&diff) {
            warn!(
                collection,
                "an incremental change does not fit what the kernel holds; syncing in full"
            );
            self.known = None;
            return Ok(None);
        }
        match self.kernel.apply(&diff, known, None) {
            Ok(applied) => {
                self.known_needs = needs;
                Ok(Some(SyncReport {
                    changed_elements: diff.size() + applied.extra_changes,
                    installed_schema: applied.installed_schema,
                    overflow: Overflow::default(),
                }))
            }
            Err(e) => {
                self.known = None;
                Err(e)
            }
        }
    }
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

    /// One attempt from what we believe the kernel holds; if it fails (an
    /// element or a table removed behind our back, a pinned map replaced),
    /// one more from a fresh read of the kernel. A second failure is
    /// returned: the kernel keeps its last state and the caller retries.
    fn sync(&mut self, desired: &DatapathState) -> Result<SyncReport, K::Error> {
        match self.try_sync(desired) {
            Ok(report) => Ok(report),
            Err(e) => {
                warn!(backend = %self.kernel.kind(), error = %e, "sync failed; re-reading the kernel's state and retrying");
                self.known = None;
                self.try_sync(desired)
            }
        }
    }

    /// Incremental when it can be (see [`Synced::try_sync_change`]); on
    /// a failure, the full way from a fresh read of the kernel.
    fn sync_change(
        &mut self,
        desired: &DatapathState,
        change: &StateDiff,
    ) -> Result<SyncReport, K::Error> {
        match self.try_sync_change(desired, change) {
            Ok(Some(report)) => Ok(report),
            Ok(None) => self.sync(desired),
            Err(e) => {
                warn!(backend = %self.kernel.kind(), error = %e, "sync failed; re-reading the kernel's state and retrying");
                self.known = None;
                self.try_sync(desired)
            }
        }
    }

    fn forget(&mut self) {
        self.known = None;
    }

    fn upkeep(&mut self) -> Result<bool, K::Error> {
        let foreign = self.kernel.foreign_changes()?;
        if foreign {
            info!(backend = %self.kernel.kind(), "our kernel state was changed by someone else; reading it again to repair it");
            self.known = None;
        }
        let paths_changed = self.kernel.upkeep()?;
        self.stale_paths |= paths_changed;
        Ok(paths_changed || foreign)
    }

    fn dump(&self) -> Result<Dump, K::Error> {
        self.kernel.dump()
    }

    fn counters(&self) -> Result<Counters, K::Error> {
        self.kernel.counters()
    }

    fn cleanup(&mut self) -> Result<(), K::Error> {
        self.known = None;
        self.kernel.cleanup()
    }
}
