//! The Kubernetes source: watches of Services and EndpointSlices into our
//! own cache ([`super::cache`]), reflectors of Nodes and ServiceCIDRs kept
//! by kube-rs; every event records what it changed and marks the state
//! dirty. Objects are trimmed as they arrive to what the model reads
//! ([`crate::model::trim`]): every node watches every object of the
//! cluster, and most are not ours.
use super::cache::Cache;
use super::pools::Pools;
use super::{Snapshot, Source, Update};
use crate::model::{trim, SERVICE_NAME_LABEL};
use crate::repeats::Repeats;
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
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

pub struct KubeSource {
    nodes: Store<Node>,
    /// Not served where the API server is older than 1.33 or we may not
    /// read them.
    service_cidrs: watch::Receiver<CidrWatch>,
    /// The CNIs' pools of pod addresses, where their CRDs are installed.
    pools: Pools,
    dirty: Arc<Notify>,
    /// Our Services, every slice (compact), and what changed.
    cache: Arc<Mutex<Cache>>,
    tasks: Vec<JoinHandle<()>>,
}

fn lock(cache: &Mutex<Cache>) -> std::sync::MutexGuard<'_, Cache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records one watch event in the cache.
type Record<K> = fn(&mut Cache, &watcher::Event<K>);

fn record_any<K>(c: &mut Cache, _: &watcher::Event<K>) {
    c.full = true;
}

/// Drives one watch; every event is recorded and marks the state dirty.
/// Errors are retried by the watcher's backoff (410 Gone relists).
async fn drive<K>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    feed: Feed<K>,
    kind: &'static str,
) where
    K: Resource + Send + 'static,
{
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(e) => {
                (feed.record)(&mut lock(&feed.cache), &e);
                feed.dirty.notify_one()
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
    (store, drive(stream, feed.clone(), kind))
}

/// A watch over `api` without a store of kube-rs's: its events (objects
/// passed through `trim`) go to the cache only. Its task, to be spawned.
fn watch_into_cache<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    feed: &Feed<K>,
    kind: &'static str,
) -> JoinHandle<()>
where
    K: Watched,
{
    let stream = watcher(api, config).modify(trim).default_backoff();
    tokio::spawn(drive(stream, feed.clone(), kind))
}

/// The watch of EndpointSlices into the cache. It starts once the first
/// list of Services is complete (until the cache knows which Services are
/// not ours, it keeps every slice), and starts again, its list replacing
/// the cache's slices, whenever the cache asks ([`Cache::take_slice_relist`]:
/// many Services whose slices were dropped became ours at once).
fn watch_slices(api: Api<EndpointSlice>, feed: &Feed<EndpointSlice>) -> JoinHandle<()> {
    let feed = feed.clone();
    tokio::spawn(async move {
        while !lock(&feed.cache).services_listed() {
            tokio::time::sleep(SLICE_RELIST_POLL).await;
        }
        loop {
            let config = watcher::Config::default().labels(SERVICE_NAME_LABEL);
            let stream = watcher(api.clone(), config)
                .modify(trim::trim_slice)
                .default_backoff();
            let relist_asked = async {
                loop {
                    tokio::time::sleep(SLICE_RELIST_POLL).await;
                    if lock(&feed.cache).take_slice_relist() {
                        break;
                    }
                }
            };
            tokio::select! {
                _ = drive(stream, feed.clone(), "EndpointSlice") => return,
                _ = relist_asked => {
                    info!("many Services whose EndpointSlices were not kept became ours: listing the EndpointSlices again");
                }
            }
        }
    })
}

/// How often the slices' watch looks whether the cache asks for a list.
const SLICE_RELIST_POLL: Duration = Duration::from_millis(100);

/// Reads the slices of each Service that became ours after its slices were
/// dropped ([`Cache::take_wanted_slices`]): one list in its namespace by
/// its `kubernetes.io/service-name` label, whatever the size of the
/// cluster. A read that fails is asked for again at the next look.
fn read_wanted_slices(client: Client, feed: &Feed<EndpointSlice>) -> JoinHandle<()> {
    let feed = feed.clone();
    tokio::spawn(async move {
        // After a round with a failed read the next waits twice as long, up
        // to READ_RETRY_AT_MOST (a server that cannot answer is not asked
        // ten times a second); a round without one starts over. The warning
        // is logged when it appears, then at most once a minute.
        let mut pause = SLICE_RELIST_POLL;
        let mut failing = Repeats::default();
        loop {
            tokio::time::sleep(pause).await;
            let wanted = lock(&feed.cache).take_wanted_slices();
            let mut failed = false;
            for owner in wanted {
                let api = Api::<EndpointSlice>::namespaced(client.clone(), &owner.namespace);
                let selector = format!("{SERVICE_NAME_LABEL}={}", owner.name);
                match api.list(&ListParams::default().labels(&selector)).await {
                    Ok(list) => {
                        let mut slices = list.items;
                        slices.iter_mut().for_each(trim::trim_slice);
                        info!(service = %owner, slices = slices.len(), "a Service became ours: its EndpointSlices read");
                        lock(&feed.cache).fill_slices(&owner, &slices);
                        feed.dirty.notify_one();
                    }
                    Err(e) => {
                        crate::warn_repeating!(failing, service = %owner, error = %e, "reading the EndpointSlices of a Service that became ours failed; retrying");
                        lock(&feed.cache).want_again(owner);
                        failed = true;
                    }
                }
            }
            pause = match failed {
                true => (pause * 2).min(READ_RETRY_AT_MOST),
                false => {
                    failing.clear();
                    SLICE_RELIST_POLL
                }
            };
        }
    })
}

/// The longest pause between two rounds of reads that failed.
const READ_RETRY_AT_MOST: Duration = Duration::from_secs(5);

/// Where a watch's events go.
struct Feed<K> {
    dirty: Arc<Notify>,
    cache: Arc<Mutex<Cache>>,
    record: Record<K>,
}

impl<K> Clone for Feed<K> {
    fn clone(&self) -> Self {
        Feed {
            dirty: self.dirty.clone(),
            cache: self.cache.clone(),
            record: self.record,
        }
    }
}

impl<K> Feed<K> {
    fn new(dirty: &Arc<Notify>, cache: &Arc<Mutex<Cache>>, record: Record<K>) -> Self {
        Feed {
            dirty: dirty.clone(),
            cache: cache.clone(),
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
    /// A ready endpoint turned not ready without terminating keeps backing
    /// its LB IP for `not_ready_hold` (`source::holds`).
    pub async fn start(client: Client, not_ready_hold: Duration) -> Self {
        let dirty = Arc::new(Notify::new());
        let cache = Arc::new(Mutex::new(Cache::holding(not_ready_hold)));
        let mut tasks = vec![
            watch_into_cache(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
                trim::trim_service,
                &Feed::new(&dirty, &cache, Cache::service_event),
                "Service",
            ),
            watch_slices(
                Api::<EndpointSlice>::all(client.clone()),
                &Feed::new(&dirty, &cache, Cache::slice_event),
            ),
            read_wanted_slices(
                client.clone(),
                &Feed::new(&dirty, &cache, Cache::slice_event),
            ),
        ];
        let nodes = reflect(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            trim::trim_node,
            &Feed::new(&dirty, &cache, Cache::node_event),
            "Node",
            &mut tasks,
        );
        let pools = {
            let cache = cache.clone();
            Pools::start(
                &client,
                &dirty,
                move || lock(&cache).full = true,
                &mut tasks,
            )
        };
        let (decided, service_cidrs) = watch::channel(CidrWatch::Probing);
        let cidr_api = Api::<ServiceCIDR>::all(client);
        let cidr_feed = Feed::new(&dirty, &cache, record_any);
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
            nodes,
            service_cidrs,
            pools,
            dirty,
            cache,
            tasks,
        }
    }

    /// A handle on the caches for the Event publisher: Service uids, and
    /// which node publishes a Service's Events.
    pub fn cluster_view(&self) -> CacheView {
        CacheView {
            cache: self.cache.clone(),
            nodes: self.nodes.clone(),
        }
    }
}

/// The caches, as the Event publisher reads them.
#[derive(Clone)]
pub struct CacheView {
    cache: Arc<Mutex<Cache>>,
    nodes: Store<Node>,
}

impl crate::events::ClusterView for CacheView {
    fn service_uid(&self, namespace: &str, name: &str) -> Option<String> {
        lock(&self.cache).service_uid(namespace, name)
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
        // Our Services and slices: their first lists are complete.
        loop {
            let notified = self.dirty.notified();
            if lock(&self.cache).listed() {
                break;
            }
            notified.await;
        }
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
        self.pools.ready().await;
    }

    async fn changed(&mut self) {
        // Cancel-safe: a notification that arrives while nobody waits is
        // kept by the Notify. The caller coalesces the burst. A hold's end
        // is a change too.
        let hold_ends = lock(&self.cache).next_hold_end();
        match hold_ends {
            Some(at) => tokio::select! {
                () = self.dirty.notified() => {}
                () = tokio::time::sleep_until(at.into()) => {}
            },
            None => self.dirty.notified().await,
        }
    }

    fn update(&mut self, full: bool) -> Update {
        let mut cache = lock(&self.cache);
        cache.end_holds(std::time::Instant::now());
        if full || cache.full {
            let snapshot = cache.snapshot();
            drop(cache);
            return Update::Full(Snapshot {
                nodes: objects(&self.nodes),
                service_cidrs: match &*self.service_cidrs.borrow() {
                    CidrWatch::Watching(store) => objects(store),
                    _ => Vec::new(),
                },
                pools: self.pools.current(),
                ..snapshot
            });
        }
        Update::Services(cache.take_touched())
    }
}
