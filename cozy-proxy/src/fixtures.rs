//! The one builder of the Services and EndpointSlices that tests and
//! benchmarks write: as YAML (a manifest directory, the API server;
//! written in JSON, which YAML readers take) or as the objects the model
//! reads. Compiled for this crate's tests and, with
//! the `fixtures` feature, for the test-support crate.
use crate::model::{
    ALLOW_ICMP_ANNOTATION, MANAGED_BY_LABEL, PROXY_NAME, PROXY_NAME_LABEL, SERVICE_NAME_LABEL,
    SLICE_CONTROLLER, WHOLE_IP_ANNOTATION,
};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// A Service of type LoadBalancer; see [`Svc::new`] for its defaults.
#[derive(Clone, Debug)]
pub struct Svc {
    pub name: String,
    pub namespace: String,
    /// Selected by the service-proxy-name label (else only by annotation).
    pub label: bool,
    pub whole_ip: Option<String>,
    pub allow_icmp: Option<String>,
    /// Further annotations, `(key, value)`.
    pub annotations: Vec<(String, String)>,
    /// `(protocol, port)`, e.g. `("TCP", 22)`; any `i32`, as the API's.
    pub ports: Vec<(String, i32)>,
    /// Raw strings for `status.loadBalancer.ingress[].ip`.
    pub lb_ips: Vec<String>,
    pub hostname: Option<String>,
    /// `metadata.creationTimestamp`, RFC 3339.
    pub created: Option<String>,
    /// `spec.loadBalancerSourceRanges`, as written.
    pub source_ranges: Vec<String>,
    /// A selector `app: NAME` (a Service whose slices the EndpointSlice
    /// controller writes).
    pub selector: bool,
}

impl Svc {
    /// A labelled passthrough Service of namespace `default` with one
    /// LoadBalancer IP and no ports.
    pub fn new(name: &str, lb: impl ToString) -> Svc {
        Svc {
            name: name.into(),
            namespace: "default".into(),
            label: true,
            whole_ip: None,
            allow_icmp: None,
            annotations: vec![],
            ports: vec![],
            lb_ips: vec![lb.to_string()],
            hostname: None,
            created: None,
            source_ranges: vec![],
            selector: false,
        }
    }

    pub fn in_namespace(mut self, namespace: &str) -> Svc {
        self.namespace = namespace.into();
        self
    }

    /// With a selector (`app: NAME`): its pods are the EndpointSlice
    /// controller's to list (see [`Slice::by_the_controller`]).
    pub fn selecting(mut self) -> Svc {
        self.selector = true;
        self
    }

    /// Port-filter mode (`wholeIP: "false"`) passing `ports`.
    pub fn filter<P: Copy + Into<i32>>(mut self, ports: &[(&str, P)]) -> Svc {
        self.whole_ip = Some("false".into());
        self.ports(ports)
    }

    /// `spec.ports`, `(protocol, port)` as written.
    pub fn ports<P: Copy + Into<i32>>(mut self, ports: &[(&str, P)]) -> Svc {
        self.ports = (ports.iter())
            .map(|(p, n)| (p.to_string(), (*n).into()))
            .collect();
        self
    }

    /// `networking.cozystack.io/wholeIP` as written.
    pub fn whole_ip(mut self, value: &str) -> Svc {
        self.whole_ip = Some(value.into());
        self
    }

    /// `networking.cozystack.io/allowICMP` as written.
    pub fn allow_icmp(mut self, value: &str) -> Svc {
        self.allow_icmp = Some(value.into());
        self
    }

    pub fn annotate(mut self, key: &str, value: &str) -> Svc {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// With the service-proxy-name label (the default) or without.
    pub fn labelled(mut self, label: bool) -> Svc {
        self.label = label;
        self
    }

    /// The LoadBalancer IPs, as written (any number, none included).
    pub fn lb_ips(mut self, ips: &[&str]) -> Svc {
        self.lb_ips = ips.iter().map(|ip| ip.to_string()).collect();
        self
    }

    /// A hostname after the IPs of `status.loadBalancer.ingress`.
    pub fn hostname(mut self, name: &str) -> Svc {
        self.hostname = Some(name.into());
        self
    }

    /// `spec.loadBalancerSourceRanges`, as written.
    pub fn source_ranges(mut self, ranges: &[&str]) -> Svc {
        self.source_ranges = ranges.iter().map(|r| r.to_string()).collect();
        self
    }

    pub fn created(mut self, ts: &str) -> Svc {
        self.created = Some(ts.into());
        self
    }

    /// Created `secs` seconds after the epoch.
    pub fn created_at(self, secs: i64) -> Svc {
        let ts = k8s_openapi::jiff::Timestamp::from_second(secs)
            .map(|t| t.to_string())
            .unwrap_or_default();
        self.created(&ts)
    }

    /// The Service as a JSON value: every string as written, escaped.
    pub fn value(&self) -> Value {
        let mut metadata = json!({"name": self.name, "namespace": self.namespace});
        if let Some(c) = &self.created {
            metadata["creationTimestamp"] = json!(c);
        }
        if self.label {
            metadata["labels"] = json!({PROXY_NAME_LABEL: PROXY_NAME});
        }
        let known = [
            (WHOLE_IP_ANNOTATION, &self.whole_ip),
            (ALLOW_ICMP_ANNOTATION, &self.allow_icmp),
        ];
        let annotations: Map<String, Value> = (known.iter())
            .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), json!(v))))
            .chain(self.annotations.iter().map(|(k, v)| (k.clone(), json!(v))))
            .collect();
        if !annotations.is_empty() {
            metadata["annotations"] = Value::Object(annotations);
        }
        let mut spec = json!({"type": "LoadBalancer"});
        if self.selector {
            spec["selector"] = json!({"app": self.name});
        }
        if !self.source_ranges.is_empty() {
            spec["loadBalancerSourceRanges"] = json!(self.source_ranges);
        }
        if !self.ports.is_empty() {
            let ports: Vec<Value> = (self.ports.iter())
                .map(|(proto, port)| json!({"port": port, "protocol": proto}))
                .collect();
            spec["ports"] = json!(ports);
        }
        let ingress: Vec<Value> = (self.lb_ips.iter())
            .map(|ip| json!({"ip": ip}))
            .chain(self.hostname.iter().map(|h| json!({"hostname": h})))
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": spec,
            "status": {"loadBalancer": {"ingress": ingress}},
        })
    }

    pub fn yaml(&self) -> String {
        yaml_of(&self.value())
    }

    /// The Service as the model reads it.
    pub fn object(&self) -> Service {
        object_of(self.value())
    }
}

/// An EndpointSlice of one Service and one address family.
#[derive(Clone, Debug)]
pub struct Slice {
    /// `metadata.name`; by default `SERVICE-FAMILY` (`vm1-ipv4`).
    pub name: String,
    pub service: String,
    pub namespace: String,
    /// `IPv4` or `IPv6`.
    pub address_type: String,
    /// `(address, ready)`: `None` leaves the condition unset.
    pub endpoints: Vec<(String, Option<bool>)>,
    /// Written by the EndpointSlice controller for the Service of this
    /// uid: see [`Slice::by_the_controller`].
    pub controller_for: Option<String>,
    /// `nodeName` of every endpoint; unset by default.
    pub node: Option<String>,
    /// `ports`: `(name, port, protocol)`; none by default.
    pub ports: Vec<(String, u16, String)>,
}

impl Slice {
    /// A slice of `service` in namespace `default`.
    pub fn new(service: &str, address_type: &str, endpoints: &[(&str, Option<bool>)]) -> Slice {
        Slice {
            name: format!("{service}-{}", address_type.to_lowercase()),
            service: service.into(),
            namespace: "default".into(),
            address_type: address_type.into(),
            endpoints: (endpoints.iter())
                .map(|(a, ready)| (a.to_string(), *ready))
                .collect(),
            controller_for: None,
            node: None,
            ports: Vec::new(),
        }
    }

    /// As the EndpointSlice controller writes it for the Service of
    /// `uid`: its managed-by label, the Service its owner, each endpoint
    /// naming a Pod of the namespace (`SERVICE-N`).
    pub fn by_the_controller(mut self, uid: &str) -> Slice {
        self.controller_for = Some(uid.into());
        self
    }

    /// Every endpoint on `node` (`nodeName`).
    pub fn on_node(mut self, node: &str) -> Slice {
        self.node = Some(node.into());
        self
    }

    /// The slice's `ports`, as `(name, port, protocol)`.
    pub fn ports(mut self, ports: &[(&str, u16, &str)]) -> Slice {
        self.ports = (ports.iter())
            .map(|(name, port, proto)| (name.to_string(), *port, proto.to_string()))
            .collect();
        self
    }

    pub fn named(mut self, name: &str) -> Slice {
        self.name = name.into();
        self
    }

    pub fn in_namespace(mut self, namespace: &str) -> Slice {
        self.namespace = namespace.into();
        self
    }

    pub fn value(&self) -> Value {
        let endpoints: Vec<Value> = (self.endpoints.iter().enumerate())
            .map(|(i, (addr, ready))| {
                let mut e = json!({"addresses": [addr]});
                if let Some(r) = ready {
                    e["conditions"] = json!({"ready": r});
                }
                if let Some(node) = &self.node {
                    e["nodeName"] = json!(node);
                }
                if self.controller_for.is_some() {
                    e["targetRef"] = json!({
                        "kind": "Pod",
                        "namespace": self.namespace,
                        "name": format!("{}-{i}", self.service),
                    });
                }
                e
            })
            .collect();
        let mut metadata = json!({
            "name": self.name,
            "namespace": self.namespace,
            "labels": {SERVICE_NAME_LABEL: self.service},
        });
        if let Some(uid) = &self.controller_for {
            metadata["labels"][MANAGED_BY_LABEL] = json!(SLICE_CONTROLLER);
            metadata["ownerReferences"] = json!([{
                "apiVersion": "v1",
                "kind": "Service",
                "name": self.service,
                "uid": uid,
                "controller": true,
            }]);
        }
        let mut slice = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": metadata,
            "addressType": self.address_type,
            "endpoints": endpoints,
        });
        if !self.ports.is_empty() {
            slice["ports"] = (self.ports.iter())
                .map(|(name, port, proto)| json!({"name": name, "port": port, "protocol": proto}))
                .collect();
        }
        slice
    }

    pub fn yaml(&self) -> String {
        yaml_of(&self.value())
    }

    /// The slice as the model reads it.
    pub fn object(&self) -> EndpointSlice {
        object_of(self.value())
    }
}

/// A fixture as a YAML document, written in JSON (a subset of YAML): a
/// string stays a string for every reader, YAML 1.1's (kubectl's) `yes`
/// and `on` included, which a YAML emitter leaves unquoted.
fn yaml_of(value: &Value) -> String {
    format!("{value:#}\n")
}

/// A fixture as its object (see [`yaml_of`] for a failure).
fn object_of<T: DeserializeOwned>(value: Value) -> T {
    match serde_json::from_value(value) {
        Ok(o) => o,
        Err(e) => panic!("fixture is not a valid object: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the YAML says is what the object holds.
    #[test]
    fn the_objects_hold_what_the_yaml_says() {
        let svc = Svc::new("vm1", "203.0.113.10")
            .in_namespace("t")
            .filter(&[("TCP", 22), ("UDP", 53)])
            .allow_icmp("true")
            .annotate("owner", "team-a")
            .created_at(1_000)
            .object();
        assert_eq!(svc.metadata.namespace.as_deref(), Some("t"));
        let ann = svc.metadata.annotations.unwrap_or_default();
        assert_eq!(ann["networking.cozystack.io/wholeIP"], "false");
        assert_eq!(ann["networking.cozystack.io/allowICMP"], "true");
        assert_eq!(ann["owner"], "team-a");
        let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[1].protocol.as_deref(), Some("UDP"));
        assert!(svc.metadata.creation_timestamp.is_some());
        let slice = Slice::new("vm1", "IPv6", &[("2001:db8::1", Some(false))]).object();
        assert_eq!(slice.metadata.name.as_deref(), Some("vm1-ipv6"));
        assert_eq!(slice.address_type, "IPv6");
        let ready = slice.endpoints[0].conditions.as_ref().and_then(|c| c.ready);
        assert_eq!(ready, Some(false));
        assert!(Slice::new("vm1", "IPv4", &[]).object().endpoints.is_empty());
    }

    /// YAML 1.1 (kubectl's) reads an unquoted `yes` or `on` as a boolean:
    /// the document quotes every string.
    #[test]
    fn strings_stay_strings_in_the_yaml() {
        let yaml = Svc::new("vm1", "203.0.113.10")
            .whole_ip("yes")
            .allow_icmp("on")
            .yaml();
        assert!(
            yaml.contains(r#""networking.cozystack.io/wholeIP": "yes""#),
            "{yaml}"
        );
        assert!(
            yaml.contains(r#""networking.cozystack.io/allowICMP": "on""#),
            "{yaml}"
        );
        let back: Service = serde_yaml::from_str(&yaml).expect("YAML");
        let ann = back.metadata.annotations.unwrap_or_default();
        assert_eq!(ann["networking.cozystack.io/wholeIP"], "yes");
    }
}
