//! The Kubernetes source: reflectors (watch + cache) of Services,
//! EndpointSlices, Nodes and ServiceCIDRs, kept by kube-rs; every event
//! records what it changed and marks the state dirty. Objects are trimmed
//! as they arrive to what the model reads ([`crate::model::trim`]): every
//! node caches every object of the cluster, and most are not ours.
use super::{ServiceObjects, Snapshot, Source, Update};
use crate::model::{service_ref, slice_owner, trim, ServiceRef, SERVICE_NAME_LABEL};
use futures::{Stream, StreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    api::ListParams,
    runtime::{
        reflector::{self, Store},
        watcher, WatchStreamExt,
    },
    Api, Client, Resource, ResourceExt,
};
use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

pub struct KubeSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    /// Not served where the API server is older than 1.33 or we may not
    /// read them.
    service_cidrs: watch::Receiver<CidrWatch>,
    dirty: Arc<Notify>,
    changes: Arc<Mutex<Changes>>,
    tasks: Vec<JoinHandle<()>>,
}

/// What changed since the last round, as the watch events tell.
#[derive(Default)]
struct Changes {
    /// Everything is read again: at the start, after a relist, after a
    /// change of a Node's addresses or pod networks or of a ServiceCIDR.
    full: bool,
    /// Services whose object or slices changed.
    services: HashSet<ServiceRef>,
    /// Service -> the names of its EndpointSlices (a slice's Service never
    /// changes: the label is set by the EndpointSlice controller). A name
    /// whose slice is gone is dropped when looked up.
    slices: HashMap<ServiceRef, HashSet<String>>,
    /// Node -> what the model reads of it, to tell a change that matters
    /// from a status heartbeat.
    nodes: HashMap<String, String>,
}

impl Changes {
    fn service(&mut self, svc: &Service) {
        self.services.insert(service_ref(svc));
    }

    fn slice(&mut self, slice: &EndpointSlice, present: bool) {
        let Some(owner) = slice_owner(slice) else {
            return;
        };
        let name = slice.metadata.name.clone().unwrap_or_default();
        let names = self.slices.entry(owner.clone()).or_default();
        if present {
            names.insert(name);
        } else {
            names.remove(&name);
        }
        self.services.insert(owner);
    }

    fn node(&mut self, node: &Node, present: bool) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let read = present.then(|| {
            let pod_cidrs = node.spec.as_ref().map(|s| (&s.pod_cidr, &s.pod_cidrs));
            let addresses = node.status.as_ref().map(|s| &s.addresses);
            serde_json::to_string(&(pod_cidrs, addresses)).unwrap_or_default()
        });
        let before = match read {
            Some(r) => self.nodes.insert(name, r.clone()) != Some(r),
            None => self.nodes.remove(&name).is_some(),
        };
        self.full |= before;
    }
}

/// Records what one watch event changed.
type Record<K> = fn(&mut Changes, &watcher::Event<K>);

fn record_service(c: &mut Changes, e: &watcher::Event<Service>) {
    match e {
        watcher::Event::Apply(s) | watcher::Event::Delete(s) | watcher::Event::InitApply(s) => {
            c.service(s)
        }
        watcher::Event::Init => {}
        watcher::Event::InitDone => c.full = true,
    }
}

fn record_slice(c: &mut Changes, e: &watcher::Event<EndpointSlice>) {
    match e {
        watcher::Event::Apply(s) | watcher::Event::InitApply(s) => c.slice(s, true),
        watcher::Event::Delete(s) => c.slice(s, false),
        watcher::Event::Init => {}
        watcher::Event::InitDone => c.full = true,
    }
}

fn record_node(c: &mut Changes, e: &watcher::Event<Node>) {
    match e {
        watcher::Event::Apply(n) | watcher::Event::InitApply(n) => c.node(n, true),
        watcher::Event::Delete(n) => c.node(n, false),
        watcher::Event::Init => {}
        watcher::Event::InitDone => c.full = true,
    }
}

fn record_any<K>(c: &mut Changes, _: &watcher::Event<K>) {
    c.full = true;
}

/// Drives one reflector; every event is recorded and marks the state
/// dirty. Errors are retried by the watcher's backoff (410 Gone relists).
async fn drive<K>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    dirty: Arc<Notify>,
    changes: Arc<Mutex<Changes>>,
    record: Record<K>,
    kind: &'static str,
) where
    K: Resource + Send + 'static,
{
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(e) => {
                record(&mut changes.lock().unwrap_or_else(|p| p.into_inner()), &e);
                dirty.notify_one()
            }
            Err(e) => {
                warn!(kind, error = %e, "watch failed; retrying with backoff (the datapath keeps its state)")
            }
        }
    }
}

/// What a reflector can keep: a cluster-scoped or namespaced API object.
trait Watched:
    Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Whether ServiceCIDRs are watched: decided by a probe in the background.
enum CidrWatch {
    Probing,
    NotServed,
    Watching(Store<ServiceCIDR>),
}

/// A reflector over `api`, its objects passed through `trim` as they
/// arrive: its cache, and the task that keeps it (to be driven).
fn reflector<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    feed: &Feed<K>,
    kind: &'static str,
) -> (
    Store<K>,
    impl std::future::Future<Output = ()> + Send + 'static,
)
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config).modify(trim)).default_backoff();
    let task = drive(
        stream,
        feed.dirty.clone(),
        feed.changes.clone(),
        feed.record,
        kind,
    );
    (store, task)
}

/// Where a reflector's events go.
struct Feed<K> {
    dirty: Arc<Notify>,
    changes: Arc<Mutex<Changes>>,
    record: Record<K>,
}

impl<K> Feed<K> {
    fn new(dirty: &Arc<Notify>, changes: &Arc<Mutex<Changes>>, record: Record<K>) -> Self {
        Feed {
            dirty: dirty.clone(),
            changes: changes.clone(),
            record,
        }
    }
}

/// A reflector over `api` (see [`reflector`]), driven by a task of its own.
fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    feed: &Feed<K>,
    kind: &'static str,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Store<K>
where
    K: Watched,
{
    let (store, task) = reflector(api, config, trim, feed, kind);
    tasks.push(tokio::spawn(task));
    store
}

fn trim_meta<K: ResourceExt>(obj: &mut K) {
    obj.managed_fields_mut().clear();
}

/// How long a 403 on ServiceCIDRs is taken for a server still loading its
/// RBAC rules (seen right after a kube-apiserver restart) before it is
/// taken for a ServiceAccount without that rule.
const SERVICE_CIDR_FORBIDDEN_GRACE: Duration = Duration::from_secs(30);

/// Can ServiceCIDRs be watched? An API server before 1.33 does not serve
/// them (404), and a watch that can never list would keep us from ever
/// syncing: probed before the watch starts. Only a definite answer
/// counts: while the server cannot be reached (its lists cannot either,
/// and the datapath stays as it is) the probe is retried, so an outage at
/// start does not lose the service networks for the life of the process.
async fn service_cidrs_served(api: &Api<ServiceCIDR>) -> bool {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(200);
    loop {
        let error = match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => return true,
            Err(e) => e,
        };
        let code = match &error {
            kube::Error::Api(status) => Some(status.code),
            _ => None,
        };
        let give_up = match code {
            Some(404) => true,
            Some(403) => started.elapsed() > SERVICE_CIDR_FORBIDDEN_GRACE,
            _ => false,
        };
        if give_up {
            info!(error = %error, "ServiceCIDRs cannot be listed; service networks come only from --cluster-cidrs");
            return false;
        }
        debug!(error = %error, "ServiceCIDRs not listed yet; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

impl KubeSource {
    /// Starts watching. Services: all (selection is a label OR an
    /// annotation, which no server-side selector can express);
    /// EndpointSlices: those owned by a Service (`kubernetes.io/service-name`);
    /// Nodes and ServiceCIDRs: all (the in-cluster ranges).
    pub async fn start(client: Client) -> Self {
        let dirty = Arc::new(Notify::new());
        let changes = Arc::new(Mutex::new(Changes {
            full: true,
            ..Default::default()
        }));
        let mut tasks = Vec::new();
        let services = reflect(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            trim::trim_service,
            &Feed::new(&dirty, &changes, record_service),
            "Service",
            &mut tasks,
        );
        let slices = reflect(
            Api::<EndpointSlice>::all(client.clone()),
            watcher::Config::default().labels(SERVICE_NAME_LABEL),
            trim::trim_slice,
            &Feed::new(&dirty, &changes, record_slice),
            "EndpointSlice",
            &mut tasks,
        );
        let nodes = reflect(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            trim::trim_node,
            &Feed::new(&dirty, &changes, record_node),
            "Node",
            &mut tasks,
        );
        let (decided, service_cidrs) = watch::channel(CidrWatch::Probing);
        let cidr_api = Api::<ServiceCIDR>::all(client);
        let cidr_feed = Feed::new(&dirty, &changes, record_any);
        tasks.push(tokio::spawn(async move {
            if !service_cidrs_served(&cidr_api).await {
                decided.send_replace(CidrWatch::NotServed);
                return;
            }
            let (store, task) = reflector(
                cidr_api,
                watcher::Config::default(),
                trim_meta,
                &cidr_feed,
                "ServiceCIDR",
            );
            decided.send_replace(CidrWatch::Watching(store));
            task.await;
        }));
        KubeSource {
            services,
            slices,
            nodes,
            service_cidrs,
            dirty,
            changes,
            tasks,
        }
    }

    /// A handle on the caches for the Event publisher: Service uids, and
    /// which node publishes a Service's Events.
    pub fn cluster_view(&self) -> CacheView {
        CacheView {
            services: self.services.clone(),
            nodes: self.nodes.clone(),
        }
    }
}

/// The reflectors' caches, as the Event publisher reads them.
#[derive(Clone)]
pub struct CacheView {
    services: Store<Service>,
    nodes: Store<Node>,
}

impl crate::events::ClusterView for CacheView {
    fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        let key = reflector::ObjectRef::new(name).within(namespace);
        self.services.get(&key).and_then(|s| s.metadata.uid.clone())
    }

    fn owner(&self, namespace: &str, name: &str) -> Option<String> {
        let nodes = self
            .nodes
            .state()
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        crate::events::owner(namespace, name, &nodes)
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn objects<K: Clone + Resource<DynamicType = ()>>(store: &Store<K>) -> Vec<K> {
    store.state().iter().map(|o| (**o).clone()).collect()
}

impl Source for KubeSource {
    async fn ready(&mut self) {
        let _ = self.services.wait_until_ready().await;
        let _ = self.slices.wait_until_ready().await;
        let _ = self.nodes.wait_until_ready().await;
        let store = match self
            .service_cidrs
            .wait_for(|c| !matches!(c, CidrWatch::Probing))
            .await
            .as_deref()
        {
            Ok(CidrWatch::Watching(store)) => Some(store.clone()),
            _ => None,
        };
        if let Some(store) = store {
            let _ = store.wait_until_ready().await;
        }
    }

    async fn changed(&mut self) {
        // Cancel-safe: a notification that arrives while nobody waits is
        // kept by the Notify. The caller coalesces the burst.
        self.dirty.notified().await;
    }

    fn update(&mut self, full: bool) -> Update {
        let mut changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        if full || changes.full {
            changes.full = false;
            changes.services.clear();
            drop(changes);
            return Update::Full(self.snapshot());
        }
        let touched = std::mem::take(&mut changes.services);
        let mut out = Vec::with_capacity(touched.len());
        for service in touched {
            let key = reflector::ObjectRef::new(&service.name).within(&service.namespace);
            let objects = self.services.get(&key).into_iter().collect();
            let mut slices = Vec::new();
            if let Some(names) = changes.slices.get_mut(&service) {
                names.retain(|name| {
                    let key = reflector::ObjectRef::new(name).within(&service.namespace);
                    match self.slices.get(&key) {
                        Some(s) => {
                            slices.push(s);
                            true
                        }
                        None => false,
                    }
                });
                if names.is_empty() {
                    changes.slices.remove(&service);
                }
            }
            out.push(ServiceObjects {
                service,
                objects,
                slices,
            });
        }
        Update::Services(out)
    }
}

impl KubeSource {
    /// Every object, copied out of the caches.
    fn snapshot(&mut self) -> Snapshot {
        Snapshot {
            services: self.services.state(),
            endpoint_slices: self.slices.state(),
            nodes: objects(&self.nodes),
            service_cidrs: match &*self.service_cidrs.borrow() {
                CidrWatch::Watching(store) => objects(store),
                _ => Vec::new(),
            },
        }
    }
}
