//! What the controller asks the API about its own node and installation:
//! the node's backend label, and whether its DaemonSet is being removed.
use crate::backend::Choice;
use futures::StreamExt;
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Node};
use kube::runtime::{watcher, WatchStreamExt};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};
use tracing::{debug, info, warn};

/// Node label that overrides `--backend` on that node (read at start).
pub const BACKEND_LABEL: &str = "networking.cozystack.io/cozy-proxy-backend";

/// What this node's label says about the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelChoice {
    /// The label names a backend.
    Named(Choice),
    /// The node has no (valid) label: `--backend` holds.
    Absent,
    /// The node could not be read: `--backend` holds for now, and the
    /// other backend's state is kept (the label may name it).
    Unknown,
}

/// Reads of the node before its label is given up as unknown.
const LABEL_ATTEMPTS: u32 = 5;

/// The backend named by this node's label, read with retries (0.5 s
/// doubling: about 7 s in all) so that an API server restarting with us
/// does not decide the backend.
pub async fn backend_label(client: &kube::Client, node: &str) -> LabelChoice {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let mut pause = std::time::Duration::from_millis(500);
    for attempt in 1..=LABEL_ATTEMPTS {
        match nodes.get(node).await {
            Ok(n) => return label_choice(node, &n),
            // No such Node: a definite answer, there is no label.
            Err(kube::Error::Api(status)) if status.code == 404 => {
                debug!(node, "no Node object; using --backend");
                return LabelChoice::Absent;
            }
            Err(e) if attempt == LABEL_ATTEMPTS => {
                warn!(node, error = %e, "could not read this node's labels; using --backend and keeping the other backend's state");
            }
            Err(e) => {
                debug!(node, error = %e, attempt, "reading this node's labels failed; retrying");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
        }
    }
    LabelChoice::Unknown
}

fn label_choice(node: &str, n: &Node) -> LabelChoice {
    let Some(value) = n
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(BACKEND_LABEL))
    else {
        return LabelChoice::Absent;
    };
    match value.parse::<Choice>() {
        Ok(b) => {
            info!(node, backend = %value, "backend chosen by the node label {BACKEND_LABEL}");
            LabelChoice::Named(b)
        }
        Err(_) => {
            warn!(node, value = %value, "invalid {BACKEND_LABEL} label (ebpf, nft or auto); using --backend");
            LabelChoice::Absent
        }
    }
}

/// Is `namespace/name` (our DaemonSet) gone or being deleted? When the API
/// cannot say, the answer is no: keeping the datapath is the safe side.
pub async fn uninstalling(client: &kube::Client, daemonset: &str) -> bool {
    let Some((ns, name)) = daemonset.split_once('/') else {
        warn!(daemonset, "expected NAMESPACE/NAME");
        return false;
    };
    let api: kube::Api<DaemonSet> = kube::Api::namespaced(client.clone(), ns);
    match api.get_opt(name).await {
        Ok(None) => true,
        Ok(Some(ds)) => ds.metadata.deletion_timestamp.is_some(),
        Err(e) => {
            warn!(error = %e, "could not read our DaemonSet; keeping the datapath");
            false
        }
    }
}

/// What a watch of our DaemonSet saw while the controller ran: whether it
/// was deleted. `helm uninstall` deletes the DaemonSet, then the chart's
/// RBAC objects, before the pods stop: a read at shutdown is refused by
/// then (403), but a watch opened while the rules held keeps delivering
/// its events (authorisation is checked when a watch starts).
#[derive(Clone, Default)]
pub struct DaemonSetWatch {
    deleted: Arc<AtomicBool>,
}

impl DaemonSetWatch {
    /// Was our DaemonSet deleted (or marked for deletion) while we ran?
    pub fn saw_deletion(&self) -> bool {
        self.deleted.load(Ordering::SeqCst)
    }

    /// Watches `namespace/name` for the rest of the process's life.
    pub fn start(client: &kube::Client, daemonset: &str) -> Self {
        let watch = DaemonSetWatch::default();
        let Some((ns, name)) = daemonset.split_once('/') else {
            return watch;
        };
        let api: kube::Api<DaemonSet> = kube::Api::namespaced(client.clone(), ns);
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let stream = watcher(api, config).default_backoff();
        let deleted = watch.deleted.clone();
        tokio::spawn(async move {
            let mut seen = Seen::default();
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(e) => match seen.follow(&e) {
                        Some(true) if !deleted.swap(true, Ordering::SeqCst) => {
                            info!("our DaemonSet was deleted: the datapath goes at shutdown");
                        }
                        // Created again (a DaemonSet replaced): a restart.
                        Some(false) if deleted.swap(false, Ordering::SeqCst) => {
                            info!("our DaemonSet is back: the datapath stays at shutdown");
                        }
                        _ => {}
                    },
                    Err(e) => debug!(error = %e, "watching our DaemonSet"),
                }
            }
        });
        watch
    }
}

/// The watch's view of our DaemonSet.
#[derive(Default)]
struct Seen {
    /// It existed at some point.
    existed: bool,
    /// A list is being read, and it held our DaemonSet.
    listed: bool,
}

impl Seen {
    /// Follows one event: `Some(true)` when it says the DaemonSet is gone
    /// or going (deleted, marked for deletion, or missing from a whole
    /// list after it existed: deleted while the watch was renewed),
    /// `Some(false)` when it is there, `None` when the event says neither.
    fn follow(&mut self, e: &watcher::Event<DaemonSet>) -> Option<bool> {
        match e {
            watcher::Event::Apply(ds) | watcher::Event::InitApply(ds) => {
                self.existed = true;
                self.listed = true;
                Some(ds.metadata.deletion_timestamp.is_some())
            }
            watcher::Event::Delete(_) => Some(true),
            watcher::Event::Init => {
                self.listed = false;
                None
            }
            watcher::Event::InitDone => (self.existed && !self.listed).then_some(true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn ds(deleting: bool) -> DaemonSet {
        let mut ds = DaemonSet::default();
        if deleting {
            ds.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        ds
    }

    #[test]
    fn a_deletion_is_seen_in_every_form_and_a_recreation_undoes_it() {
        use watcher::Event::*;
        let mut s = Seen::default();
        // Never there: no answer.
        assert_eq!(s.follow(&Init), None);
        assert_eq!(s.follow(&InitDone), None);
        assert_eq!(s.follow(&Apply(ds(false))), Some(false));
        assert_eq!(s.follow(&Apply(ds(true))), Some(true));
        assert_eq!(s.follow(&Delete(ds(true))), Some(true));
        // Back (replaced): there.
        assert_eq!(s.follow(&Apply(ds(false))), Some(false));
        // A relist without it: gone; with it: there.
        assert_eq!(s.follow(&Init), None);
        assert_eq!(s.follow(&InitDone), Some(true));
        assert_eq!(s.follow(&Init), None);
        assert_eq!(s.follow(&InitApply(ds(false))), Some(false));
        assert_eq!(s.follow(&InitDone), None);
    }
}
