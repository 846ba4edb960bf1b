//! Kubernetes Events for the problems the model reports: one Warning Event
//! on the Service per problem as it appears (the reconciler reports each
//! once while it lasts; the recorder folds repeats into a series).
use crate::model::Warning;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    runtime::events::{Event, EventType, Recorder, Reporter},
    Client,
};
use tracing::warn;

#[derive(Clone)]
pub struct EventPublisher {
    recorder: Recorder,
}

impl EventPublisher {
    /// `instance`: this controller's pod or node, shown as the reporter.
    pub fn new(client: Client, instance: Option<String>) -> Self {
        EventPublisher {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: "cozy-proxy".into(),
                    instance,
                },
            ),
        }
    }

    /// Publishes in the background: a slow or absent API server never holds
    /// up the datapath.
    pub fn publish(&self, warnings: &[Warning], uid: impl Fn(&str, &str) -> Option<String>) {
        for w in warnings {
            let reference = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(w.service.namespace.clone()),
                name: Some(w.service.name.clone()),
                uid: uid(&w.service.namespace, &w.service.name),
                ..Default::default()
            };
            let event = Event {
                type_: EventType::Warning,
                reason: w.kind.as_str().into(),
                note: Some(w.message.clone()),
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
