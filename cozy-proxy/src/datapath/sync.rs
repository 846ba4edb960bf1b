//! The one sync layer: what the kernel holds as of our last change, the
//! adoption of what a previous instance left, the diff, and the retry
//! policy, for every backend alike.
use super::Counters;
use super::{BackendKind, Datapath, DatapathState, Dump, Kernel, SyncReport};
use tracing::{info, warn};

pub struct Synced<K: Kernel> {
    kernel: K,
    /// What the kernel holds, as of our last successful change. `None`
    /// before the first sync, after a failure and after [`Datapath::forget`]:
    /// the next sync reads the kernel again.
    known: Option<DatapathState>,
}

impl<K: Kernel> Synced<K> {
    pub fn new(kernel: K) -> Self {
        Synced {
            kernel,
            known: None,
        }
    }

    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    fn try_sync(&mut self, desired: &DatapathState) -> Result<SyncReport, K::Error> {
        let mut desired = desired.clone();
        let paths = self.kernel.paths(&desired.pods())?;
        desired.resolve(&paths);
        let desired = &desired;
        let (known, found) = match self.known.take() {
            Some(known) => (known, None),
            None => {
                let (live, found) = self.kernel.read()?;
                (adopt(self.kernel.kind(), live), Some(found))
            }
        };
        let diff = known.diff(desired);
        let applied = self.kernel.apply(&diff, desired, found)?;
        self.known = Some(desired.clone());
        Ok(SyncReport {
            changed_elements: diff.size() + applied.extra_changes,
            installed_schema: applied.installed_schema,
        })
    }
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

    fn forget(&mut self) {
        self.known = None;
    }

    fn upkeep(&mut self) -> Result<bool, K::Error> {
        let foreign = self.kernel.foreign_changes()?;
        if foreign {
            info!(backend = %self.kernel.kind(), "our kernel state was changed by someone else; reading it again to repair it");
            self.known = None;
        }
        Ok(self.kernel.upkeep()? || foreign)
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
