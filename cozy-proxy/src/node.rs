//! What the controller asks the API about its own node and installation:
//! the node's backend label, and whether its DaemonSet is being removed.
use crate::backend::Choice;
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Node};
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
