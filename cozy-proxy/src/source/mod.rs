//! Where Services and EndpointSlices come from: a directory of manifests
//! (standalone) or the Kubernetes API (the DaemonSet). Both feed the same
//! reconcile loop through [`Source`].
mod cache;
mod holds;
pub mod kube;
pub mod manifests;
mod pools;
mod snapshot;

use crate::repeats::Repeats;
use crate::warn_repeating;
pub use snapshot::{Snapshot, Update};
use std::{collections::BTreeSet, path::PathBuf, time::Duration};
use tracing::warn;

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
