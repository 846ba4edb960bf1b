//! Objects cut down to what the model reads, as they arrive from the API:
//! every node caches every Service and EndpointSlice of the cluster, and
//! most of them are not ours. A trimmed object gives the model exactly the
//! outcome the whole one gives (a property test checks it); anything else
//! is dropped. A Service that becomes ours later arrives whole again with
//! the update that selects it.
use super::endpoints::{is_a_service, MANAGED_BY_LABEL, SERVICE_NAME_LABEL};
use super::service::{is_selected, ALLOW_ICMP_ANNOTATION, PROXY_NAME_LABEL, WHOLE_IP_ANNOTATION};
use k8s_openapi::api::{
    core::v1::{
        LoadBalancerIngress, LoadBalancerStatus, Node, NodeSpec, NodeStatus, ObjectReference,
        Service, ServicePort, ServiceSpec, ServiceStatus,
    },
    discovery::v1::{Endpoint, EndpointConditions, EndpointSlice},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;

/// Name, namespace, uid (Events name their Service by it), creation time
/// (conflicts), and the listed labels and annotations.
fn meta(m: &mut ObjectMeta, labels: &[&str], annotations: &[&str]) -> ObjectMeta {
    let keep = |map: &mut Option<BTreeMap<String, String>>, keys: &[&str]| {
        let kept: BTreeMap<String, String> = map
            .take()
            .into_iter()
            .flatten()
            .filter(|(k, _)| keys.contains(&k.as_str()))
            .collect();
        (!kept.is_empty()).then_some(kept)
    };
    ObjectMeta {
        name: m.name.take(),
        namespace: m.namespace.take(),
        uid: m.uid.take(),
        creation_timestamp: m.creation_timestamp.take(),
        labels: keep(&mut m.labels, labels),
        annotations: keep(&mut m.annotations, annotations),
        ..Default::default()
    }
}

pub fn trim_service(s: &mut Service) {
    if !is_selected(s) {
        *s = Service {
            metadata: meta(&mut s.metadata, &[], &[]),
            ..Default::default()
        };
        return;
    }
    let metadata = meta(
        &mut s.metadata,
        &[PROXY_NAME_LABEL],
        &[WHOLE_IP_ANNOTATION, ALLOW_ICMP_ANNOTATION],
    );
    let spec = s.spec.take().map(|spec| ServiceSpec {
        ports: spec.ports.map(|ports| {
            ports
                .into_iter()
                .map(|p| ServicePort {
                    port: p.port,
                    protocol: p.protocol,
                    ..Default::default()
                })
                .collect()
        }),
        load_balancer_source_ranges: spec.load_balancer_source_ranges,
        // Whether it has one: the EndpointSlice controller writes its
        // slices only then (model/trust.rs).
        selector: spec
            .selector
            .filter(|s| !s.is_empty())
            .map(|s| s.into_iter().take(1).collect()),
        ..Default::default()
    });
    let status = s.status.take().map(|status| ServiceStatus {
        load_balancer: status.load_balancer.map(|lb| LoadBalancerStatus {
            ingress: lb.ingress.map(|ingress| {
                ingress
                    .into_iter()
                    .map(|i| LoadBalancerIngress {
                        ip: i.ip,
                        hostname: i.hostname,
                        ..Default::default()
                    })
                    .collect()
            }),
        }),
        ..Default::default()
    });
    *s = Service {
        metadata,
        spec,
        status,
    };
}

pub fn trim_slice(e: &mut EndpointSlice) {
    let endpoints = std::mem::take(&mut e.endpoints)
        .into_iter()
        .map(|ep| Endpoint {
            addresses: ep.addresses,
            // All three: a terminating endpoint still serving is used while
            // none is ready (model/endpoints.rs).
            conditions: ep.conditions.map(|c| EndpointConditions {
                ready: c.ready,
                serving: c.serving,
                terminating: c.terminating,
            }),
            node_name: ep.node_name,
            // Whether it names a Pod of the slice's namespace (trust.rs).
            target_ref: ep.target_ref.map(|r| ObjectReference {
                kind: r.kind,
                namespace: r.namespace,
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let owners = (e.metadata.owner_references.take().into_iter().flatten())
        .filter(is_a_service)
        .collect::<Vec<_>>();
    let mut metadata = meta(
        &mut e.metadata,
        &[SERVICE_NAME_LABEL, MANAGED_BY_LABEL],
        &[],
    );
    metadata.owner_references = (!owners.is_empty()).then_some(owners);
    *e = EndpointSlice {
        metadata,
        address_type: std::mem::take(&mut e.address_type),
        endpoints,
        ports: None,
    };
}

/// Addresses and pod networks (in-cluster ranges, never-translated
/// addresses) and the name; labels stay for people reading a dump.
pub fn trim_node(n: &mut Node) {
    let labels = n.metadata.labels.take();
    let mut metadata = meta(&mut n.metadata, &[], &[]);
    metadata.labels = labels;
    let spec = n.spec.take().map(|s| NodeSpec {
        pod_cidr: s.pod_cidr,
        pod_cidrs: s.pod_cidrs,
        ..Default::default()
    });
    let status = n.status.take().map(|s| NodeStatus {
        addresses: s.addresses,
        ..Default::default()
    });
    *n = Node {
        metadata,
        spec,
        status,
    };
}
