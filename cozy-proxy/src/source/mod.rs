//! Where Services and EndpointSlices come from: a directory of manifests
//! (standalone) or the Kubernetes API (the DaemonSet). Both feed the same
//! reconcile loop through [`Source`].
mod cache;
pub mod kube;
pub mod manifests;
mod pools;

use crate::model::{ReadService, ReadSlice, ServiceRef};
use crate::telemetry::repeats::Repeats;
use crate::warn_repeating;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Duration};
use tracing::warn;

/// A snapshot of the objects the model reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Shared with the caches they come from, not copied.
    pub services: Vec<Arc<Service>>,
    pub endpoint_slices: Vec<Arc<EndpointSlice>>,
    /// Services given as what the model reads of them and of their slices
    /// (the Kubernetes source keeps no more).
    pub read: Vec<ServiceObjects>,
    /// Every Node: their addresses (never translated, in-cluster) and pod
    /// networks (in-cluster).
    pub nodes: Vec<Node>,
    /// The cluster's service networks (in-cluster).
    pub service_cidrs: Vec<ServiceCIDR>,
    /// The CNI's pools of pod addresses (in-cluster), where it publishes
    /// them in objects of its own.
    pub pools: Vec<crate::model::cluster::PodPool>,
}

/// What a round reconciles.
#[derive(Clone, Debug)]
pub enum Update {
    /// Every object as it is now: the first round, a resync, a relist, a
    /// change of Nodes or ServiceCIDRs (they concern every Service).
    Full(Snapshot),
    /// Only these Services changed (their objects or their slices): the
    /// plan is updated for them alone.
    Services(Vec<ServiceObjects>),
}

/// One Service's objects as they are now.
#[derive(Clone, Debug)]
pub struct ServiceObjects {
    pub service: ServiceRef,
    /// What the model reads of it; `None`: deleted, or not ours.
    pub read: Option<Arc<ReadService>>,
    /// The EndpointSlices labelled with its name, as the model reads them.
    pub slices: Vec<Arc<ReadSlice>>,
}

/// A source of objects for the reconcile loop.
#[allow(async_fn_in_trait)]
pub trait Source {
    /// Resolves once every initial list is complete (the datapath left by a
    /// previous instance stays untouched until then).
    async fn ready(&mut self);

    /// Resolves when something may have changed (bursts are coalesced).
    async fn changed(&mut self);

    /// What changed since the last call; everything when `full` is asked
    /// for (a resync) or the source cannot tell.
    fn update(&mut self, full: bool) -> Update;
}

/// The standalone source: manifests in a directory, polled.
///
/// A directory that becomes empty after having manifests is more often a
/// mistake (a failed sync, a volume unmounted under us) than a wish to
/// remove every Service: the last state is kept, with a warning, unless
/// the directory holds [`EMPTY_MARKER`] (remove the manifests and create
/// that file to remove everything). An unreadable directory keeps the last
/// state too.
pub struct ManifestSource {
    dir: PathBuf,
    tick: tokio::time::Interval,
    /// The directory's content at the last snapshot.
    seen: Option<manifests::Contents>,
    /// The empty directory was already warned about.
    warned_empty: bool,
    /// The directory unreadable, polled four times a second.
    unreadable: Repeats,
    /// Each skipped document's warning, by its file and place, for as
    /// long as it stays as it is.
    skipped: BTreeSet<(PathBuf, usize, String)>,
}

/// A file in the manifest directory that says "empty on purpose".
pub const EMPTY_MARKER: &str = ".cozy-proxy-empty";

impl ManifestSource {
    pub fn new(dir: PathBuf, poll: Duration) -> Self {
        ManifestSource {
            dir,
            tick: tokio::time::interval(poll),
            seen: None,
            warned_empty: false,
            unreadable: Repeats::default(),
            skipped: BTreeSet::new(),
        }
    }

    fn read(&mut self) -> Option<manifests::Contents> {
        match manifests::read_manifests(&self.dir) {
            Ok(f) => {
                self.unreadable.clear();
                Some(f)
            }
            Err(e) => {
                warn_repeating!(self.unreadable, error = %e, "cannot read the manifest directory; keeping the datapath as it is");
                None
            }
        }
    }
}

impl Source for ManifestSource {
    async fn ready(&mut self) {
        // Wait until the directory can be read at all.
        while self.read().is_none() {
            self.tick.tick().await;
        }
    }

    async fn changed(&mut self) {
        loop {
            self.tick.tick().await;
            if let Some(files) = self.read() {
                if self.seen.as_ref() != Some(&files) {
                    return;
                }
            }
        }
    }

    /// Manifests change rarely and are read whole: every round is full.
    fn update(&mut self, _full: bool) -> Update {
        Update::Full(self.snapshot())
    }
}

impl ManifestSource {
    fn snapshot(&mut self) -> Snapshot {
        let read = self.read();
        let last = || {
            let files = self
                .seen
                .as_ref()
                .map(|(f, _)| f.clone())
                .unwrap_or_default();
            manifests::parse(&files).snapshot
        };
        let Some(contents) = read else {
            // Unreadable now: keep the last state (read again next time).
            return last();
        };
        let had_some = self.seen.as_ref().is_some_and(|(f, _)| !f.is_empty());
        if contents.0.is_empty() && had_some && !self.dir.join(EMPTY_MARKER).exists() {
            if !self.warned_empty {
                warn!(
                    dir = %self.dir.display(),
                    "the manifest directory became empty; keeping the last state (create {EMPTY_MARKER} in it to remove everything)"
                );
                self.warned_empty = true;
            }
            return last();
        }
        self.warned_empty = false;
        let loaded = manifests::parse(&contents.0);
        // Each once, while it stays skipped for the same reason.
        let skipped: BTreeSet<(PathBuf, usize, String)> = (contents.1.iter())
            .chain(&loaded.skipped)
            .map(|s| (s.file.clone(), s.document, s.reason.clone()))
            .collect();
        for (file, document, reason) in skipped.difference(&self.skipped) {
            warn!(file = %file.display(), document, "skipped: {reason}");
        }
        self.skipped = skipped;
        self.seen = Some(contents);
        loaded.snapshot
    }
}

#[cfg(test)]
mod tests {
    use super::{ManifestSource, EMPTY_MARKER};
    use std::time::Duration;

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: vm1, namespace: default}\nspec: {type: LoadBalancer}\n";

    #[tokio::test]
    async fn an_emptied_directory_keeps_the_last_state_unless_marked() {
        let dir = std::env::temp_dir().join(format!("cozy-proxy-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let mut source = ManifestSource::new(dir.clone(), Duration::from_millis(10));
        // Empty from the start: nothing to keep.
        assert!(source.snapshot().services.is_empty());
        std::fs::write(dir.join("vm1.yaml"), SERVICE).expect("write");
        assert_eq!(source.snapshot().services.len(), 1);
        std::fs::remove_file(dir.join("vm1.yaml")).expect("rm");
        assert_eq!(source.snapshot().services.len(), 1, "kept");
        std::fs::write(dir.join(EMPTY_MARKER), "").expect("marker");
        assert!(source.snapshot().services.is_empty(), "removed on purpose");
        // Unreadable: the last state again.
        std::fs::write(dir.join("vm1.yaml"), SERVICE).expect("write");
        assert_eq!(source.snapshot().services.len(), 1);
        std::fs::remove_dir_all(&dir).expect("rm dir");
        assert_eq!(source.snapshot().services.len(), 1, "kept while unreadable");
    }
}
