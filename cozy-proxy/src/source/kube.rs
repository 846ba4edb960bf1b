//! The Kubernetes source: reflectors (watch + cache) of Services and
//! EndpointSlices, kept by kube-rs; every event only marks the state dirty.
use super::{Snapshot, Source};
use crate::model::SERVICE_NAME_LABEL;
use futures::{Stream, StreamExt};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    runtime::{
        reflector::{self, Store},
        watcher, WatchStreamExt,
    },
    Api, Client, Resource,
};
use std::sync::Arc;
use tokio::{sync::Notify, task::JoinHandle};
use tracing::warn;

pub struct KubeSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    dirty: Arc<Notify>,
    tasks: Vec<JoinHandle<()>>,
}

/// Drives one reflector; every event (or error) marks the state dirty.
/// Errors are retried by the watcher's backoff (410 Gone relists).
fn drive<K>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    dirty: Arc<Notify>,
    kind: &'static str,
) -> JoinHandle<()>
where
    K: Resource + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => dirty.notify_one(),
                Err(e) => {
                    warn!(kind, error = %e, "watch failed; retrying with backoff (the datapath keeps its state)")
                }
            }
        }
    })
}

impl KubeSource {
    /// Starts watching. Services: all (selection is a label OR an
    /// annotation, which no server-side selector can express);
    /// EndpointSlices: those owned by a Service (`kubernetes.io/service-name`).
    pub fn start(client: Client) -> Self {
        let dirty = Arc::new(Notify::new());
        let (services, svc_writer) = reflector::store();
        let svc_stream = reflector::reflector(
            svc_writer,
            watcher(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        let (slices, slice_writer) = reflector::store();
        let slice_stream = reflector::reflector(
            slice_writer,
            watcher(
                Api::<EndpointSlice>::all(client),
                watcher::Config::default().labels(SERVICE_NAME_LABEL),
            ),
        )
        .default_backoff();
        let tasks = vec![
            drive(svc_stream, dirty.clone(), "Service"),
            drive(slice_stream, dirty.clone(), "EndpointSlice"),
        ];
        KubeSource {
            services,
            slices,
            dirty,
            tasks,
        }
    }

    /// A handle on the Service cache for Event references.
    pub fn uid_lookup(&self) -> ServiceUids {
        ServiceUids(self.services.clone())
    }
}

/// Looks up Service uids in the reflector's cache.
#[derive(Clone)]
pub struct ServiceUids(Store<Service>);

impl ServiceUids {
    pub fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        let key = reflector::ObjectRef::new(name).within(namespace);
        self.0.get(&key).and_then(|s| s.metadata.uid.clone())
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Source for KubeSource {
    async fn ready(&mut self) {
        let _ = self.services.wait_until_ready().await;
        let _ = self.slices.wait_until_ready().await;
    }

    async fn changed(&mut self) {
        // Cancel-safe: a notification that arrives while nobody waits is
        // kept by the Notify. The caller coalesces the burst.
        self.dirty.notified().await;
    }

    fn snapshot(&mut self) -> Snapshot {
        Snapshot {
            services: self
                .services
                .state()
                .iter()
                .map(|s| (**s).clone())
                .collect(),
            endpoint_slices: self.slices.state().iter().map(|s| (**s).clone()).collect(),
        }
    }
}
