//! The CNIs' own objects that publish pod networks where Nodes carry no
//! `spec.podCIDRs`: Kube-OVN `Subnet`s, Calico `IPPool`s, Cilium
//! `CiliumPodIPPool`s. Each is read only where its CRD is installed and
//! readable (probed at start, as ServiceCIDRs are); a change of any is a
//! full round, as a Node's is.
use crate::model::cluster::PodPool;
use futures::StreamExt;
use kube::{
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams},
    runtime::{watcher, WatchStreamExt},
    Api, Client,
};
use serde_json::Value;
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};
use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};
use tracing::{info, warn};

/// One kind of pool object: where it is served and where its CIDRs are.
struct PoolKind {
    gvk: (&'static str, &'static str, &'static str),
    plural: &'static str,
    /// How the log names one.
    what: &'static str,
    cidrs: fn(&Value) -> Vec<String>,
}

fn strings(v: &Value) -> impl Iterator<Item = String> + '_ {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
}

const KINDS: [PoolKind; 3] = [
    PoolKind {
        gvk: ("kubeovn.io", "v1", "Subnet"),
        plural: "subnets",
        what: "Kube-OVN Subnet",
        // "10.16.0.0/16" or, dual-stack, "10.16.0.0/16,fd00:10:16::/64".
        cidrs: |spec| {
            spec["cidrBlock"]
                .as_str()
                .map(|b| b.split(',').map(str::to_string).collect())
                .unwrap_or_default()
        },
    },
    PoolKind {
        gvk: ("crd.projectcalico.org", "v1", "IPPool"),
        plural: "ippools",
        what: "Calico IPPool",
        cidrs: |spec| {
            spec["cidr"]
                .as_str()
                .map(str::to_string)
                .into_iter()
                .collect()
        },
    },
    PoolKind {
        gvk: ("cilium.io", "v2alpha1", "CiliumPodIPPool"),
        plural: "ciliumpodippools",
        what: "Cilium CiliumPodIPPool",
        cidrs: |spec| {
            strings(&spec["ipv4"]["cidrs"])
                .chain(strings(&spec["ipv6"]["cidrs"]))
                .collect()
        },
    },
];

impl PoolKind {
    fn resource(&self) -> ApiResource {
        let (group, version, kind) = self.gvk;
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), self.plural)
    }

    fn pool(&self, o: &DynamicObject) -> PodPool {
        PodPool {
            origin: format!(
                "{} {}",
                self.what,
                o.metadata.name.as_deref().unwrap_or("?")
            ),
            cidrs: (self.cidrs)(&o.data["spec"]),
        }
    }
}

/// The pools of every kind read, and how many kinds are settled (listed
/// once, or found not served).
pub struct Pools {
    /// "kind/name" -> pool.
    pools: Arc<Mutex<BTreeMap<String, PodPool>>>,
    settled: watch::Receiver<usize>,
}

fn lock(
    p: &Mutex<BTreeMap<String, PodPool>>,
) -> std::sync::MutexGuard<'_, BTreeMap<String, PodPool>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// Is `api` served and readable? Not: a CRD not installed (404), or no
/// permission (403). While the server cannot be reached, asked again.
async fn served(api: &Api<DynamicObject>, what: &str) -> bool {
    let mut pause = std::time::Duration::from_millis(200);
    loop {
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => return true,
            Err(kube::Error::Api(s)) if matches!(s.code, 403 | 404) => {
                info!(
                    kind = what,
                    code = s.code,
                    "not read (CRD not installed, or not readable)"
                );
                return false;
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}

impl Pools {
    /// Starts a watch per kind; each change marks the state dirty and
    /// asks for a full round (`full`).
    pub fn start(
        client: &Client,
        dirty: &Arc<Notify>,
        full: impl Fn() + Clone + Send + Sync + 'static,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> Pools {
        let pools = Arc::new(Mutex::new(BTreeMap::new()));
        let (settle, settled) = watch::channel(0usize);
        let settle = Arc::new(settle);
        for kind in KINDS {
            let api = Api::<DynamicObject>::all_with(client.clone(), &kind.resource());
            let (pools, dirty, settle, full) =
                (pools.clone(), dirty.clone(), settle.clone(), full.clone());
            tasks.push(tokio::spawn(async move {
                let mark = || settle.send_modify(|n| *n += 1);
                if !served(&api, kind.what).await {
                    mark();
                    return;
                }
                let key = |o: &DynamicObject| {
                    format!("{}/{}", kind.what, o.metadata.name.as_deref().unwrap_or(""))
                };
                let mut listing = BTreeMap::new();
                let mut first = true;
                let stream = watcher(api, watcher::Config::default()).default_backoff();
                let mut stream = std::pin::pin!(stream);
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(watcher::Event::Init) => listing.clear(),
                        Ok(watcher::Event::InitApply(o)) => {
                            listing.insert(key(&o), kind.pool(&o));
                        }
                        Ok(watcher::Event::InitDone) => {
                            let mut all = lock(&pools);
                            all.retain(|k, _| !k.starts_with(kind.what));
                            all.append(&mut listing);
                            drop(all);
                            if std::mem::take(&mut first) {
                                mark();
                            }
                        }
                        Ok(watcher::Event::Apply(o)) => {
                            lock(&pools).insert(key(&o), kind.pool(&o));
                        }
                        Ok(watcher::Event::Delete(o)) => {
                            lock(&pools).remove(&key(&o));
                        }
                        Err(e) => {
                            warn!(kind = kind.what, error = %e, "watch failed; retrying with backoff");
                            continue;
                        }
                    }
                    full();
                    dirty.notify_one();
                }
            }));
        }
        Pools { pools, settled }
    }

    /// Waits until every kind was listed once or found not served.
    pub async fn ready(&mut self) {
        let _ = self.settled.wait_for(|n| *n >= KINDS.len()).await;
    }

    /// The pools as last read.
    pub fn current(&self) -> Vec<PodPool> {
        lock(&self.pools).values().cloned().collect()
    }
}
