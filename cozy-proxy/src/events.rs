//! Kubernetes Events for the problems the model reports: one Warning Event
//! on the Service per problem as it appears (the reconciler reports each
//! once while it lasts; the recorder folds repeats into a series).
//!
//! Every node runs the same controller and computes the same warnings: if
//! each published them, every rollout would post nodes x warnings Events.
//! Each Service's warnings are published by one node, its **owner** (see
//! [`owner`]), at most [`MAX_EVENTS_PER_MINUTE`] a minute per node, each
//! note cut to the API's limit.
use crate::model::{Warning, WarningKind};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    runtime::events::{Event, EventType, Recorder, Reporter},
    Client,
};
use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tracing::{debug, warn};

/// events.k8s.io/v1 refuses a note longer than 1 KiB.
pub const MAX_NOTE_BYTES: usize = 1024;
/// Events one node publishes per minute at most; more are logged only.
pub const MAX_EVENTS_PER_MINUTE: usize = 30;

/// The node that publishes a Service's Events: chosen by rendezvous
/// hashing of the Service's key over the cluster's `nodes`, which every
/// node computes alike. It depends only on the set of nodes, not on where
/// the endpoints are: a warning is reported once while it lasts, and an
/// owner that changed with an endpoint's move would leave it unpublished.
/// (A node whose controller is down leaves its share of Services without
/// Events; every node still logs them and counts them in
/// `cozy_proxy_warnings`.) `None` when no node is known (then each
/// publishes its own).
pub fn owner(namespace: &str, name: &str, nodes: &BTreeSet<String>) -> Option<String> {
    nodes
        .iter()
        .max_by_key(|node| {
            crate::fingerprint::fnv1a([namespace, name, node.as_str()].map(str::as_bytes))
        })
        .cloned()
}

/// `note` cut to [`MAX_NOTE_BYTES`] at a character boundary.
pub fn bounded_note(note: &str) -> String {
    if note.len() <= MAX_NOTE_BYTES {
        return note.to_string();
    }
    const MORE: &str = "...";
    let mut end = MAX_NOTE_BYTES - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MORE}", &note[..end])
}

/// At most `limit` publications in any minute.
#[derive(Debug)]
pub struct RateLimit {
    limit: usize,
    sent: Vec<Instant>,
}

impl RateLimit {
    pub fn new(limit: usize) -> Self {
        RateLimit {
            limit,
            sent: Vec::new(),
        }
    }

    /// May one more go out at `now`?
    pub fn allow(&mut self, now: Instant) -> bool {
        self.sent
            .retain(|t| now.saturating_duration_since(*t) < Duration::from_secs(60));
        if self.sent.len() >= self.limit {
            return false;
        }
        self.sent.push(now);
        true
    }
}

/// What a publisher needs to know about the cluster: Service uids (for
/// the Event's reference) and who owns a Service's Events.
/// Does node `me` publish a warning of `kind` about a Service `owner`
/// owns? The owner does, unless the warning is about one node's own
/// datapath (which only that node knows).
fn publishes(me: Option<&str>, owner: Option<&str>, kind: WarningKind) -> bool {
    match (me, owner) {
        (Some(me), Some(owner)) => me == owner || kind.is_node_local(),
        _ => true,
    }
}

pub trait ClusterView: Send + Sync {
    fn service_uid(&self, namespace: &str, name: &str) -> Option<String>;
    /// See [`owner`].
    fn owner(&self, namespace: &str, name: &str) -> Option<String>;
}

#[derive(Clone)]
pub struct EventPublisher {
    recorder: Recorder,
    /// This node's name: it publishes the Events of the Services it owns.
    node: Option<String>,
    limit: Arc<Mutex<RateLimit>>,
}

impl EventPublisher {
    /// `node`: this controller's node, shown as the reporter's instance.
    pub fn new(client: Client, node: Option<String>) -> Self {
        EventPublisher {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: "cozy-proxy".into(),
                    instance: node.clone(),
                },
            ),
            node,
            limit: Arc::new(Mutex::new(RateLimit::new(MAX_EVENTS_PER_MINUTE))),
        }
    }

    /// Publishes in the background: a slow or absent API server never holds
    /// up the datapath.
    pub fn publish(&self, warnings: &[Warning], view: &dyn ClusterView) {
        for w in warnings {
            let (ns, name) = (&w.service.namespace, &w.service.name);
            let owner = view.owner(ns, name);
            if !publishes(self.node.as_deref(), owner.as_deref(), w.kind) {
                debug!(service = %w.service, ?owner, "another node publishes this Service's Events");
                continue;
            }
            let allowed = self
                .limit
                .lock()
                .map(|mut l| l.allow(Instant::now()))
                .unwrap_or(true);
            if !allowed {
                warn!(service = %w.service, reason = w.kind.as_str(), "Event rate limit reached; logged only");
                continue;
            }
            let reference = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(ns.to_string()),
                name: Some(name.to_string()),
                uid: view.service_uid(ns, name),
                ..Default::default()
            };
            let event = Event {
                type_: EventType::Warning,
                reason: w.kind.as_str().into(),
                note: Some(bounded_note(&w.message)),
                action: "Reconcile".into(),
                secondary: None,
            };
            let recorder = self.recorder.clone();
            tokio::spawn(async move {
                if let Err(e) = recorder.publish(&event, &reference).await {
                    warn!(error = %e, "could not publish an Event");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> BTreeSet<String> {
        (1..=n).map(|i| format!("node{i}")).collect()
    }

    #[test]
    fn the_owner_publishes_and_a_node_publishes_its_own_datapath_warnings() {
        assert!(publishes(
            Some("a"),
            Some("a"),
            WarningKind::MultipleEndpoints
        ));
        assert!(!publishes(
            Some("a"),
            Some("b"),
            WarningKind::MultipleEndpoints
        ));
        assert!(publishes(Some("a"), Some("b"), WarningKind::DatapathFull));
        assert!(publishes(None, Some("b"), WarningKind::MultipleEndpoints));
    }

    #[test]
    fn exactly_one_node_owns_a_service_and_owners_spread() {
        let all = nodes(5);
        let o = owner("default", "vm1", &all);
        assert!(o.as_ref().is_some_and(|o| all.contains(o)));
        // The same answer whichever node computes it.
        assert_eq!(o, owner("default", "vm1", &all.clone()));
        let owners: BTreeSet<String> = (0..50)
            .filter_map(|i| owner("default", &format!("svc{i}"), &all))
            .collect();
        assert!(owners.len() >= 4, "owners bunch up: {owners:?}");
        assert_eq!(owner("default", "vm1", &BTreeSet::new()), None);
    }

    #[test]
    fn a_node_joining_moves_only_its_share() {
        let (before, after) = (nodes(4), nodes(5));
        let moved = (0..200)
            .filter(|i| {
                let n = format!("svc{i}");
                let (a, b) = (owner("default", &n, &before), owner("default", &n, &after));
                a != b && b.as_deref() != Some("node5")
            })
            .count();
        assert_eq!(moved, 0, "Services moved between old nodes");
    }

    #[test]
    fn notes_fit_the_api_limit() {
        let long = "é".repeat(2000);
        let note = bounded_note(&long);
        assert!(note.len() <= MAX_NOTE_BYTES);
        assert!(note.ends_with("..."));
        assert_eq!(bounded_note("short"), "short");
    }

    #[test]
    fn the_rate_limit_holds_per_minute() {
        let mut l = RateLimit::new(3);
        let t = Instant::now();
        assert!(l.allow(t) && l.allow(t) && l.allow(t));
        assert!(!l.allow(t + Duration::from_secs(30)));
        assert!(l.allow(t + Duration::from_secs(61)));
    }
}
