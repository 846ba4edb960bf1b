//! The metrics: sync timing and errors, Services per mode, warnings by
//! reason, and the eBPF datapath's own counters.
use crate::model::{Mode, Outcome};
use prometheus_client::{
    encoding::text::encode,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use serde_json::Value;
use std::collections::BTreeMap;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    sync_errors: Counter,
    services: Family<Labels, Gauge>,
    unmapped: Gauge,
    warnings: Family<Labels, Gauge>,
    datapath_elements: Gauge,
    service_packets: Family<Labels, Gauge>,
    service_bytes: Family<Labels, Gauge>,
    drops: Family<Labels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("cozy_proxy");
        let m = Metrics {
            // 100 us .. ~26 s
            sync_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            sync_errors: Counter::default(),
            services: Family::default(),
            unmapped: Gauge::default(),
            warnings: Family::default(),
            datapath_elements: Gauge::default(),
            service_packets: Family::default(),
            service_bytes: Family::default(),
            drops: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "sync_duration_seconds",
            "Time to compute the plan and apply it to the datapath",
            m.sync_duration.clone(),
        );
        registry.register(
            "sync_errors",
            "Syncs that failed (retried; the datapath keeps its last state)",
            m.sync_errors.clone(),
        );
        registry.register(
            "services",
            "Mappings (LB IP <-> pod, per family) in the datapath, by mode",
            m.services.clone(),
        );
        registry.register(
            "unmapped_lb_ips",
            "LoadBalancer IPs of managed Services without a mapping (dropped)",
            m.unmapped.clone(),
        );
        registry.register(
            "warnings",
            "Current problems with Services, by reason",
            m.warnings.clone(),
        );
        registry.register(
            "datapath_elements",
            "Elements in the datapath's maps and sets",
            m.datapath_elements.clone(),
        );
        registry.register(
            "service_packets",
            "Packets rewritten per LoadBalancer IP and direction (eBPF datapath)",
            m.service_packets.clone(),
        );
        registry.register(
            "service_bytes",
            "Bytes rewritten per LoadBalancer IP and direction (eBPF datapath)",
            m.service_bytes.clone(),
        );
        registry.register(
            "drops",
            "Packets dropped by the datapath, by reason (eBPF datapath)",
            m.drops.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn observe_sync(&self, seconds: f64) {
        self.sync_duration.observe(seconds);
    }

    pub fn sync_failed(&self) {
        self.sync_errors.inc();
    }

    /// Updates the gauges derived from a plan.
    pub fn observe_outcome(&self, outcome: &Outcome, elements: usize) {
        let mut per_mode: BTreeMap<&str, i64> =
            BTreeMap::from([("passthrough", 0), ("port_filter", 0)]);
        for m in &outcome.plan.mappings {
            let mode = match m.mode {
                Mode::Passthrough => "passthrough",
                Mode::PortFilter { .. } => "port_filter",
            };
            *per_mode.entry(mode).or_default() += 1;
        }
        for (mode, n) in per_mode {
            self.services
                .get_or_create(&labels(&[("mode", mode)]))
                .set(n);
        }
        self.unmapped.set(outcome.plan.unmapped_lb_ips.len() as i64);
        self.warnings.clear();
        for w in &outcome.warnings {
            self.warnings
                .get_or_create(&labels(&[("reason", w.kind.as_str())]))
                .inc();
        }
        self.datapath_elements.set(elements as i64);
    }

    /// Copies the datapath's own counters (the `counters` of an eBPF dump).
    pub fn observe_datapath_counters(&self, counters: &Value) {
        let n = |v: &Value| v.as_u64().unwrap_or(0) as i64;
        self.service_packets.clear();
        self.service_bytes.clear();
        if let Some(services) = counters["services"].as_object() {
            for (lb, c) in services {
                for dir in ["ingress", "egress"] {
                    let l = labels(&[("lb_ip", lb), ("direction", dir)]);
                    self.service_packets
                        .get_or_create(&l)
                        .set(n(&c[format!("{dir}_packets")]));
                    self.service_bytes
                        .get_or_create(&l)
                        .set(n(&c[format!("{dir}_bytes")]));
                }
            }
        }
        if let Some(drops) = counters["drops"].as_object() {
            for (reason, c) in drops {
                self.drops
                    .get_or_create(&labels(&[("reason", reason)]))
                    .set(n(&c["packets"]));
            }
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
