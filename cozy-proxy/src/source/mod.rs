//! Where Services and EndpointSlices come from: a directory of manifests
//! (standalone) or the Kubernetes API (the DaemonSet). Both feed the same
//! reconcile loop through [`Source`].
pub mod kube;
pub mod manifests;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use std::{path::PathBuf, time::Duration};
use tracing::warn;

/// A snapshot of the objects the model reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    /// Every Node: their addresses (never translated, in-cluster) and pod
    /// networks (in-cluster).
    pub nodes: Vec<Node>,
    /// The cluster's service networks (in-cluster).
    pub service_cidrs: Vec<ServiceCIDR>,
}

/// A source of objects for the reconcile loop.
#[allow(async_fn_in_trait)]
pub trait Source {
    /// Resolves once every initial list is complete (the datapath left by a
    /// previous instance stays untouched until then).
    async fn ready(&mut self);

    /// Resolves when something may have changed (bursts are coalesced).
    async fn changed(&mut self);

    /// The objects as they are now.
    fn snapshot(&mut self) -> Snapshot;
}

/// The standalone source: manifests in a directory, polled.
pub struct ManifestSource {
    dir: PathBuf,
    tick: tokio::time::Interval,
    /// The directory's content at the last snapshot.
    seen: Option<Vec<(PathBuf, Vec<u8>)>>,
}

impl ManifestSource {
    pub fn new(dir: PathBuf, poll: Duration) -> Self {
        ManifestSource {
            dir,
            tick: tokio::time::interval(poll),
            seen: None,
        }
    }

    fn read(&self) -> Option<Vec<(PathBuf, Vec<u8>)>> {
        match manifests::fingerprint(&self.dir) {
            Ok(f) => Some(f),
            Err(e) => {
                warn!(error = %e, "cannot read the manifest directory; keeping the datapath as it is");
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

    fn snapshot(&mut self) -> Snapshot {
        let Some(files) = self.read() else {
            // Unreadable now: keep the last state (read again next time).
            let last = self.seen.clone().unwrap_or_default();
            return manifests::parse(&last).snapshot;
        };
        let loaded = manifests::parse(&files);
        for s in &loaded.skipped {
            warn!(file = %s.file.display(), document = s.document, "skipped: {}", s.reason);
        }
        self.seen = Some(files);
        loaded.snapshot
    }
}
