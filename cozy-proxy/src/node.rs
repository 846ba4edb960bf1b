//! What the controller asks the API about its own node and installation:
//! the node's backend label, and whether its DaemonSet is being removed.
use crate::backend::Choice;
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Node};
use tracing::{info, warn};

/// Node label that overrides `--backend` on that node (read at start).
pub const BACKEND_LABEL: &str = "networking.cozystack.io/cozy-proxy-backend";

/// The backend named by this node's label, if any.
pub async fn backend_label(client: &kube::Client, node: &str) -> Option<Choice> {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    match nodes.get(node).await {
        Ok(n) => {
            let value = n.metadata.labels.as_ref()?.get(BACKEND_LABEL)?.clone();
            match value.parse::<Choice>() {
                Ok(b) => {
                    info!(node, backend = %value, "backend chosen by the node label {BACKEND_LABEL}");
                    Some(b)
                }
                Err(_) => {
                    warn!(node, value = %value, "invalid {BACKEND_LABEL} label (ebpf, nft or auto); using --backend");
                    None
                }
            }
        }
        Err(e) => {
            warn!(node, error = %e, "could not read this node's labels; using --backend");
            None
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
