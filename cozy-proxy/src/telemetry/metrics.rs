//! The metrics: sync timing and errors, Services per mode, warnings by
//! reason, and the eBPF datapath's own counters.
use crate::datapath::{Counters, Overflow, SharedMapping, Table};
use crate::model::PlanSummary;
use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
    registry::Registry,
};
use std::sync::{Arc, Mutex};

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    sync_errors: Family<Labels, Counter>,
    services: Family<Labels, Gauge>,
    unmapped: Gauge,
    warnings: Family<Labels, Gauge>,
    datapath_elements: Gauge,
    left_out: Gauge,
    full_tables: Family<Labels, Gauge>,
    shared: Family<Labels, Gauge>,
    /// The datapath's counters as last read: exported as counters by
    /// [`DatapathCounters`] (the kernel keeps them; we only copy them).
    datapath_counters: Arc<Mutex<Counters>>,
}

/// Exports the kernel's own monotonic counts as Prometheus counters
/// (`_total`), not gauges: a reset (a map re-created) shows as a counter
/// reset, which `rate()` handles.
#[derive(Debug)]
struct DatapathCounters(Arc<Mutex<Counters>>);

impl Collector for DatapathCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let families: [(&str, &str, bool); 2] = [
            (
                "service_packets",
                "Packets rewritten per LoadBalancer IP and direction (eBPF datapath)",
                true,
            ),
            (
                "service_bytes",
                "Bytes rewritten per LoadBalancer IP and direction (eBPF datapath)",
                false,
            ),
        ];
        for (name, help, packets) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (lb, s) in &c.services {
                for (dir, count) in [("ingress", s.ingress), ("egress", s.egress)] {
                    let value = if packets { count.packets } else { count.bytes };
                    let l = labels(&[("lb_ip", &lb.to_string()), ("direction", dir)]);
                    ConstCounter::new(value).encode(family.encode_family(&l)?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "drops",
            "Packets dropped by the datapath, by reason (eBPF datapath)",
            None,
            MetricType::Counter,
        )?;
        for (reason, count) in &c.drops {
            let l = labels(&[("reason", reason)]);
            ConstCounter::new(count.packets).encode(family.encode_family(&l)?)?;
        }
        Ok(())
    }
}

/// The process-wide count of interrupted netlink dumps, read at scrape.
#[derive(Debug)]
struct InterruptedDumps;

impl Collector for InterruptedDumps {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let family = encoder.encode_descriptor(
            "netlink_dumps_interrupted",
            "Kernel table dumps interrupted by a concurrent change (NLM_F_DUMP_INTR) and made again",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(crate::netlink::socket::interrupted_dumps()).encode(family)
    }
}

/// The backend running, and why `auto` did not take eBPF where it did not.
#[derive(Debug)]
struct BackendInfo;

impl Collector for BackendInfo {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some((kind, why)) = crate::backend::chosen() else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(
            "backend",
            "The datapath this node runs (1), and why auto did not take eBPF (reason; empty: as asked)",
            None,
            MetricType::Gauge,
        )?;
        let l = labels(&[("backend", &kind.to_string()), ("reason", &why)]);
        ConstGauge::new(1).encode(family.encode_family(&l)?)
    }
}

/// Where the eBPF programs run among other agents' programs (ebpf/chain.rs),
/// read at scrape.
#[derive(Debug)]
struct HookPlaces;

impl Collector for HookPlaces {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::ebpf::chain;
        let family = encoder.encode_descriptor(
            "ebpf_hooks_reclaimed",
            "Times another agent's program was found running before ours on a hook and ours was put first again",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(chain::reclaimed()).encode(family)?;
        let family = encoder.encode_descriptor(
            "ebpf_hooks_behind",
            "Hooks where another agent's program runs before ours and ours could not be put first (traffic there is not translated)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(chain::behind() as i64).encode(family)?;
        let family = encoder.encode_descriptor(
            "ebpf_hairpin_masquerade_missing",
            "1 while the masquerade of in-cluster clients' hairpins (nft table inet cozy_proxy) cannot be put in place",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(crate::ebpf::hairpin::missing() as i64).encode(family)
    }
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
            sync_errors: Family::default(),
            services: Family::default(),
            unmapped: Gauge::default(),
            warnings: Family::default(),
            datapath_elements: Gauge::default(),
            left_out: Gauge::default(),
            full_tables: Family::default(),
            shared: Family::default(),
            datapath_counters: Arc::default(),
            registry: Registry::default(),
        };
        registry.register(
            "sync_duration_seconds",
            "Time to compute the plan and apply it to the datapath",
            m.sync_duration.clone(),
        );
        registry.register(
            "sync_errors",
            "Syncs that failed (retried; the datapath keeps its last state), by backend and kind \
             of failure (refused: the kernel refused a change; map, full, load, attach, bpffs, \
             decode, interrupted, ...)",
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
            "Elements in the datapath's maps and sets, and its host routes",
            m.datapath_elements.clone(),
        );
        registry.register(
            "datapath_left_out_lb_ips",
            "LoadBalancer IPs the datapath's full tables could not hold (not translated here)",
            m.left_out.clone(),
        );
        registry.register(
            "datapath_table_full",
            "1 where a datapath table is full and LB IPs were left out, by table",
            m.full_tables.clone(),
        );
        registry.register(
            "mapping_on_several_nodes",
            "1 per mapping whose pod IP several nodes' endpoints hold (a VM migrating), this \
             node among them: the nodes named, and whether this node translates it (the kernel \
             delivers the pod here) or steers its LB IP to another of them (the route leads there), \
             and why (where the route to the pod leads)",
            m.shared.clone(),
        );
        registry.register_collector(Box::new(DatapathCounters(m.datapath_counters.clone())));
        registry.register_collector(Box::new(InterruptedDumps));
        registry.register_collector(Box::new(HookPlaces));
        registry.register_collector(Box::new(BackendInfo));
        Metrics { registry, ..m }
    }

    pub fn observe_sync(&self, seconds: f64) {
        self.sync_duration.observe(seconds);
    }

    pub fn sync_failed(&self, backend: &str, kind: &str) {
        self.sync_errors
            .get_or_create(&labels(&[("backend", backend), ("kind", kind)]))
            .inc();
    }

    /// Updates the gauges derived from a plan.
    pub fn observe_plan(&self, summary: &PlanSummary, elements: usize) {
        for (mode, n) in [
            ("passthrough", summary.passthrough),
            ("port_filter", summary.port_filter),
        ] {
            self.services
                .get_or_create(&labels(&[("mode", mode)]))
                .set(n as i64);
        }
        self.unmapped.set(summary.unmapped as i64);
        self.warnings.clear();
        for (kind, n) in summary.warnings.iter().filter(|(_, n)| **n > 0) {
            self.warnings
                .get_or_create(&labels(&[("reason", kind.as_str())]))
                .inc_by(*n as i64);
        }
        self.datapath_elements.set(elements as i64);
    }

    /// The mappings this node shares with others, as last decided (a
    /// handful: the VMs migrating now).
    pub fn observe_shared(&self, shared: &[SharedMapping]) {
        self.shared.clear();
        for m in shared {
            let here = if m.translated_here { "true" } else { "false" };
            let lb = m.lb_ip.to_string();
            self.shared
                .get_or_create(&labels(&[
                    ("lb_ip", &lb),
                    ("nodes", &m.nodes),
                    ("translated_here", here),
                    ("why", &m.why),
                ]))
                .set(1);
        }
    }

    /// What the last sync could not fit in the datapath's tables.
    pub fn observe_overflow(&self, overflow: &Overflow) {
        self.left_out.set(overflow.left_out.len() as i64);
        for t in Table::ALL {
            let full = i64::from(overflow.full.contains(&t));
            self.full_tables
                .get_or_create(&labels(&[("table", t.as_str())]))
                .set(full);
        }
    }

    /// Keeps the datapath's own counters for the next scrape (moved in, not
    /// copied: one per mapping).
    pub fn observe_datapath_counters(&self, counters: Counters) {
        *self
            .datapath_counters
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = counters;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
