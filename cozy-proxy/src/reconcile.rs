//! The reconcile step shared by every source: objects in, plan computed,
//! problems reported, datapath synced.
use crate::datapath::{Datapath, DatapathState, NodeView, SyncReport};
use crate::model::cluster::{cluster_ranges, ClusterConfig, ClusterRanges};
use crate::model::{compute_plan, Outcome, Warning};
use crate::source::Snapshot;
use std::collections::BTreeSet;
use tracing::{info, warn};

/// Who this node is, and where its in-cluster ranges come from.
#[derive(Clone, Debug, Default)]
pub struct NodeConfig {
    /// `--node-name`: mappings whose endpoint is on another node are not
    /// translated here. `None`: every mapping is local (standalone).
    pub name: Option<String>,
    pub cluster: ClusterConfig,
}

pub struct Reconciler<D: Datapath> {
    datapath: D,
    node: NodeConfig,
    /// Warnings already reported: each is logged once while it lasts.
    reported: BTreeSet<Warning>,
    /// The in-cluster ranges last used: a change is logged.
    ranges: ClusterRanges,
    /// Whether a sync has succeeded (the first one is always logged).
    synced_once: bool,
}

/// What one reconcile did.
#[derive(Debug)]
pub struct ReconcileReport {
    pub outcome: Outcome,
    pub sync: SyncReport,
    /// Warnings that appeared with this reconcile.
    pub new_warnings: Vec<Warning>,
    /// Warnings that went away with this reconcile.
    pub resolved_warnings: Vec<Warning>,
    /// Elements the datapath holds now.
    pub elements: usize,
}

impl<D: Datapath> Reconciler<D> {
    pub fn new(datapath: D, node: NodeConfig) -> Self {
        Reconciler {
            datapath,
            node,
            reported: BTreeSet::new(),
            ranges: ClusterRanges::default(),
            synced_once: false,
        }
    }

    pub fn datapath(&self) -> &D {
        &self.datapath
    }

    pub fn datapath_mut(&mut self) -> &mut D {
        &mut self.datapath
    }

    /// Computes the plan and syncs the datapath to it. Warnings are
    /// reported even when the sync fails (they are about the input); a
    /// failed sync leaves the kernel as it was, and is retried by the caller.
    pub fn reconcile(&mut self, snapshot: &Snapshot) -> Result<ReconcileReport, D::Error> {
        let outcome = compute_plan(
            &snapshot.services,
            &snapshot.endpoint_slices,
            &snapshot.nodes,
        );
        let (new_warnings, resolved_warnings) = self.report(&outcome.warnings);
        let ranges = cluster_ranges(&self.node.cluster, &snapshot.nodes, &snapshot.service_cidrs);
        self.report_ranges(ranges);
        let me = NodeView {
            name: self.node.name.as_deref(),
        };
        let desired = DatapathState::for_node(&outcome.plan, &self.ranges.ranges, me);
        let sync = self.datapath.sync(&desired)?;
        if sync.changed_elements > 0 || !self.synced_once {
            info!(
                backend = %self.datapath.kind(),
                mappings = outcome.plan.mappings.len(),
                unmapped = outcome.plan.unmapped_lb_ips.len(),
                changed_elements = sync.changed_elements,
                warnings = outcome.warnings.len(),
                "datapath synced"
            );
        }
        let elements = desired.len();
        self.synced_once = true;
        Ok(ReconcileReport {
            outcome,
            sync,
            new_warnings,
            resolved_warnings,
            elements,
        })
    }

    /// Logs the in-cluster ranges and where they came from when they change,
    /// and what could not be known.
    fn report_ranges(&mut self, ranges: ClusterRanges) {
        if ranges == self.ranges {
            return;
        }
        let list: Vec<String> = ranges
            .origin
            .iter()
            .map(|(c, from)| format!("{c} ({from})"))
            .collect();
        info!(ranges = %list.join(", "), "in-cluster ranges");
        for u in ranges
            .unknown
            .iter()
            .filter(|u| !self.ranges.unknown.contains(u))
        {
            warn!("{u}");
        }
        self.ranges = ranges;
    }

    /// The warnings that appeared and those that went away since the last
    /// round; each is logged once.
    fn report(&mut self, current: &[Warning]) -> (Vec<Warning>, Vec<Warning>) {
        let current: BTreeSet<Warning> = current.iter().cloned().collect();
        let new: Vec<Warning> = current.difference(&self.reported).cloned().collect();
        let gone: Vec<Warning> = self.reported.difference(&current).cloned().collect();
        for w in &new {
            warn!(service = %w.service, reason = %w.kind, "{}", w.message);
        }
        for w in &gone {
            info!(service = %w.service, reason = %w.kind, "resolved: {}", w.message);
        }
        self.reported = current;
        (new, gone)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::datapath::fake::{FakeHandle, FakeKernel};
    use crate::datapath::Synced;
    use crate::source::manifests;
    use std::path::PathBuf;

    /// Objects from YAML, as the manifest source reads them.
    pub fn snapshot(yaml: &str) -> Snapshot {
        let loaded = manifests::parse(&[(PathBuf::from("t.yaml"), yaml.as_bytes().to_vec())]);
        assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
        loaded.snapshot
    }

    pub fn service(name: &str, lb: &str, pod: &str, whole_ip: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: t\n  labels: {{service.kubernetes.io/service-proxy-name: cozy-proxy}}\n  annotations: {{networking.cozystack.io/wholeIP: \"{whole_ip}\"}}\n\
             spec:\n  ports: [{{port: 22}}]\nstatus:\n  loadBalancer:\n    ingress: [{{ip: \"{lb}\"}}]\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-e\n  namespace: t\n  labels: {{kubernetes.io/service-name: {name}}}\n\
             addressType: IPv4\nendpoints: [{{addresses: [\"{pod}\"]}}]\n"
        )
    }

    fn reconciler() -> (Reconciler<Synced<FakeKernel>>, FakeHandle) {
        let (kernel, world) = FakeKernel::new();
        (
            Reconciler::new(Synced::new(kernel), NodeConfig::default()),
            world,
        )
    }

    pub fn desired(snap: &Snapshot) -> DatapathState {
        let outcome = compute_plan(&snap.services, &snap.endpoint_slices, &snap.nodes);
        let ranges = cluster_ranges(&ClusterConfig::default(), &snap.nodes, &snap.service_cidrs);
        let mut s = DatapathState::for_node(&outcome.plan, &ranges.ranges, NodeView { name: None });
        s.resolve(&crate::datapath::fake::paths(&s.pods()));
        s
    }

    #[test]
    fn the_first_sync_adopts_what_the_kernel_holds_and_changes_only_the_difference() {
        let (mut r, world) = reconciler();
        let one = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        let two = snapshot(
            &(service("a", "203.0.113.10", "192.0.2.11", "true")
                + &service("b", "203.0.113.20", "192.0.2.12", "false")),
        );
        // A previous instance left `one` in the kernel.
        {
            let mut w = world.world();
            w.kernel = desired(&one);
            w.schema = true;
        }
        let report = r.reconcile(&two).expect("sync");
        // b: two map entries, its filtered pod, one port, two guarded
        // addresses (pod, LB IP) and one route.
        assert_eq!(report.sync.changed_elements, 7);
        assert!(!report.sync.installed_schema);
        assert_eq!(world.world().kernel, desired(&two));
        assert_eq!(world.world().reads, 1);
        // Nothing changed: no read, nothing applied.
        let again = r.reconcile(&two).expect("sync");
        assert_eq!(again.sync.changed_elements, 0);
        assert_eq!(world.world().reads, 1);
    }

    #[test]
    fn drift_is_repaired_after_forget_and_an_error_keeps_the_kernel_and_is_retried() {
        let (mut r, world) = reconciler();
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        r.reconcile(&snap).expect("sync");
        // Someone flushes our table by hand.
        world.world().kernel = DatapathState::default();
        // Without a resync we believe the kernel is as we left it.
        assert_eq!(r.reconcile(&snap).expect("sync").sync.changed_elements, 0);
        // The resync reads again and repairs it.
        r.datapath_mut().forget();
        // Two map entries, two guarded addresses, one route, and the two
        // link-local in-cluster ranges.
        assert_eq!(r.reconcile(&snap).expect("sync").sync.changed_elements, 7);
        assert_eq!(world.world().kernel, desired(&snap));

        // A change whose apply fails twice (attempt and retry) is an error;
        // the kernel keeps its last state.
        let before = world.world().kernel.clone();
        let changed = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        world.world().failures = 2;
        assert!(r.reconcile(&changed).is_err());
        assert_eq!(world.world().kernel, before);
        // One failure is absorbed by the retry (from a fresh read).
        world.world().failures = 1;
        let reads = world.world().reads;
        r.reconcile(&changed).expect("retried");
        assert_eq!(world.world().kernel, desired(&changed));
        assert_eq!(world.world().reads, reads + 1);
    }

    #[test]
    fn a_stale_belief_fails_the_first_attempt_and_the_retry_reads_the_kernel() {
        let (mut r, world) = reconciler();
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        r.reconcile(&snap).expect("sync");
        // An element removed by hand: removing it again fails (as ENOENT
        // fails an nf_tables batch); the retry starts from the kernel.
        world.world().kernel.pod_svc.clear();
        let moved = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        r.reconcile(&moved).expect("retried from a fresh read");
        assert_eq!(world.world().kernel, desired(&moved));
    }

    #[test]
    fn warnings_are_reported_once_while_they_last_and_resolved_once() {
        let (mut r, _world) = reconciler();
        let bad = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "yes"));
        let first = r.reconcile(&bad).expect("sync");
        assert_eq!(first.new_warnings.len(), 1);
        assert_eq!(first.new_warnings[0].kind.as_str(), "InvalidAnnotation");
        let second = r.reconcile(&bad).expect("sync");
        assert!(second.new_warnings.is_empty());
        assert!(second.resolved_warnings.is_empty());
        let good = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        let fixed = r.reconcile(&good).expect("sync");
        assert_eq!(fixed.resolved_warnings.len(), 1);
        assert!(r
            .reconcile(&good)
            .expect("sync")
            .resolved_warnings
            .is_empty());
    }
}
