//! The reconcile step shared by every source: objects in, plan updated,
//! problems reported, datapath synced. A round that names the Services it
//! concerns costs in proportion to them (the plan, the datapath's state and
//! the kernel are changed for them alone); a full round (the first, a
//! resync) computes everything again.
use crate::datapath::{
    Datapath, DatapathState, NodeView, Overflow, SharedMapping, Sharing, StateBuilder, SyncReport,
    NONE_AWAY,
};
use crate::model::cluster::{
    cluster_ranges, internal_addresses, ClusterConfig, ClusterRanges, NodeAddresses,
};
use crate::model::{
    Cidr, Forbidden, LbResult, PlanState, PlanSummary, SliceTrust, Warning, WarningKind,
};
use crate::shares::Shares;
use crate::source::{Snapshot, Update};
use std::collections::BTreeSet;
use tracing::{debug, info, warn};

/// Who this node is, and where its in-cluster ranges come from.
#[derive(Clone, Debug, Default)]
pub struct NodeConfig {
    /// `--node-name`: mappings whose endpoint is on another node are not
    /// translated here. `None`: every mapping is local (standalone).
    pub name: Option<String>,
    pub cluster: ClusterConfig,
    /// `--reserved-cidrs`: never translated (node VIPs).
    pub reserved: Vec<Cidr>,
    /// `--namespace-share`: the percentage of each datapath table one
    /// namespace may take on this node (`None`: no bound).
    pub namespace_share: Option<u8>,
    /// Which EndpointSlices a Service's pod is read from
    /// (`--trust-unmanaged-slices`; manifests: all).
    pub slices: SliceTrust,
}

pub struct Reconciler<D: Datapath> {
    datapath: D,
    node: NodeConfig,
    /// The plan, kept up to date one Service at a time. What it puts in
    /// this node's datapath is kept by the datapath (one copy), changed
    /// with it.
    plan: PlanState,
    /// Warnings already reported: each is logged once while it lasts.
    reported: BTreeSet<Warning>,
    /// The datapath's own warnings (LB IPs its full tables left out),
    /// reported as the plan's are.
    overflow_reported: BTreeSet<Warning>,
    /// The in-cluster ranges last used: a change is logged.
    ranges: ClusterRanges,
    /// Every node's InternalIPs (where remote mappings are steered).
    addresses: NodeAddresses,
    /// The mappings this node shares with another (a VM migrating), and
    /// which of them the kernel delivers elsewhere.
    sharing: Sharing,
    /// Whether a sync has succeeded (the first one is always logged).
    synced_once: bool,
    /// Each namespace's share of this node's tables, and the mappings
    /// beyond it.
    shares: Shares,
    /// The namespace-share warnings reported.
    share_reported: BTreeSet<Warning>,
}

/// What one reconcile did.
#[derive(Debug)]
pub struct ReconcileReport {
    pub summary: PlanSummary,
    pub sync: SyncReport,
    /// Warnings that appeared with this reconcile.
    pub new_warnings: Vec<Warning>,
    /// Warnings that went away with this reconcile.
    pub resolved_warnings: Vec<Warning>,
    /// The mappings this node shares with another, and where they are
    /// translated.
    pub shared: Vec<SharedMapping>,
}

impl<D: Datapath> Reconciler<D> {
    pub fn new(datapath: D, node: NodeConfig) -> Self {
        let shares = Shares::new(node.namespace_share.unwrap_or(100), datapath.capacity());
        Reconciler {
            shares,
            share_reported: BTreeSet::new(),
            datapath,
            node,
            plan: PlanState::default(),
            reported: BTreeSet::new(),
            overflow_reported: BTreeSet::new(),
            ranges: ClusterRanges::default(),
            addresses: NodeAddresses::new(),
            sharing: Sharing::default(),
            synced_once: false,
        }
    }

    pub fn datapath(&self) -> &D {
        &self.datapath
    }

    pub fn datapath_mut(&mut self) -> &mut D {
        &mut self.datapath
    }

    /// The plan as it stands.
    pub fn plan(&self) -> &PlanState {
        &self.plan
    }

    /// Updates the plan and syncs the datapath to it. Warnings are
    /// reported even when the sync fails (they are about the input); a
    /// failed sync leaves the kernel as it was, and is retried by the caller
    /// (with the plan already updated: an empty update retries it).
    pub fn reconcile(&mut self, update: Update) -> Result<ReconcileReport, D::Error> {
        let (sync, mut new_warnings, mut resolved_warnings) = match update {
            Update::Full(snapshot) => {
                let started = std::time::Instant::now();
                self.rebuild(&snapshot);
                debug!(
                    services = snapshot.services.len() + snapshot.read.len(),
                    took = ?started.elapsed(),
                    "full round: plan built"
                );
                // Not held through the sync, the controller's peak: the
                // plan holds what it needs.
                drop(snapshot);
                let previous = std::mem::take(&mut self.sharing);
                self.sharing =
                    Sharing::of(self.plan.results(), self.node.name.as_deref()).carrying(previous);
                self.decide_sharing();
                let mut shares = std::mem::take(&mut self.shares);
                shares.rebuild(&self.plan, self.view());
                self.shares = shares;
                let (new, gone) = self.report(self.plan.warnings().cloned().collect());
                (self.datapath.sync(self.planned_of_plan())?, new, gone)
            }
            Update::Services(services) => {
                debug!(services = services.len(), "incremental round");
                for s in services {
                    let slices: Vec<_> = s.slices.iter().map(AsRef::as_ref).collect();
                    self.plan.update_read(&s.service, s.read, &slices);
                }
                let mut changes = self.plan.take_changes();
                (self.sharing).follow_changes(&changes, self.node.name.as_deref());
                let (was, moved) = self.decide_sharing();
                let touched: BTreeSet<_> = changes.iter().map(|c| c.lb_ip).collect();
                changes.extend(moved.into_iter().filter(|c| !touched.contains(&c.lb_ip)));
                let mut shares = std::mem::take(&mut self.shares);
                shares.gate_changes(&mut changes, &self.plan, self.view());
                self.shares = shares;
                let me = self.view();
                let change = DatapathState::change_of(&changes, NodeView { away: &was, ..me }, me);
                let (new, gone) = self.plan.take_warning_changes();
                self.log_warnings(&new, &gone);
                for w in &gone {
                    self.reported.remove(w);
                }
                self.reported.extend(new.iter().cloned());
                let sync = match self.datapath.sync_change(&change)? {
                    Some(sync) => sync,
                    // Never expected (the plan and its state move
                    // together); the full way is still right.
                    None => self.datapath.sync(self.planned_of_plan())?,
                };
                (sync, new, gone)
            }
        };
        let (new, gone) = self.report_overflow(&sync.overflow);
        new_warnings.extend(new);
        resolved_warnings.extend(gone);
        let node = self.node.name.as_deref().unwrap_or("this node");
        let current = self.shares.warnings(&self.plan, node);
        let (new, gone) = turnover(&mut self.share_reported, current);
        self.log_warnings(&new, &gone);
        new_warnings.extend(new);
        resolved_warnings.extend(gone);
        let summary = self.plan.summary().clone();
        if sync.changed_elements > 0 || !self.synced_once {
            info!(
                backend = %self.datapath.kind(),
                mappings = summary.passthrough + summary.port_filter,
                unmapped = summary.unmapped,
                changed_elements = sync.changed_elements,
                warnings = self.reported.len(),
                "datapath synced"
            );
        }
        self.synced_once = true;
        Ok(ReconcileReport {
            summary,
            sync,
            new_warnings,
            resolved_warnings,
            shared: self.sharing.report(),
        })
    }

    /// The plan from every object.
    fn rebuild(&mut self, snapshot: &Snapshot) {
        // The old plan goes first: two at once would make every resync
        // the controller's peak.
        self.plan = PlanState::default();
        self.plan = PlanState::build_forbidding(
            &snapshot.services,
            &snapshot.endpoint_slices,
            &snapshot.read,
            Forbidden::new(&snapshot.nodes, &self.node.reserved)
                .with_service_cidrs(&snapshot.service_cidrs)
                .trusting(self.node.slices.clone()),
        );
        let _ = self.plan.take_changes();
        let _ = self.plan.take_warning_changes();
        self.addresses = internal_addresses(&snapshot.nodes);
        let ranges = cluster_ranges(
            &self.node.cluster,
            &snapshot.nodes,
            &snapshot.service_cidrs,
            &snapshot.pools,
        );
        self.report_ranges(ranges);
    }

    /// This node, as the plan's state is built for it.
    fn view(&self) -> NodeView<'_> {
        self.sharing.view(NodeView {
            name: self.node.name.as_deref(),
            addresses: &self.addresses,
            away: &NONE_AWAY,
        })
    }

    /// Decides again where the shared mappings' pods are delivered, from
    /// the kernel's routes: the previous decision, and the changes of the
    /// LB IPs whose node changed. Where the routes cannot be read, the
    /// decision stays (the round's plan changes are not lost for it).
    fn decide_sharing(&mut self) -> (BTreeSet<std::net::IpAddr>, Vec<crate::model::LbChange>) {
        let paths = match self.datapath.paths_of(&self.sharing.pods()) {
            Ok(paths) => paths,
            Err(e) => {
                warn!(error = %e, "reading the routes toward pods on several nodes failed; where they are translated stays as it was");
                return (self.sharing.away().clone(), Vec::new());
            }
        };
        let decided = (self.sharing).decide(self.node.name.as_deref(), &self.addresses, &paths);
        for c in &decided.1 {
            let Some(LbResult::Mapped(m)) = &c.new else {
                continue;
            };
            let here = !self.sharing.away().contains(&m.pod_ip);
            info!(
                lb_ip = %c.lb_ip,
                pod_ip = %m.pod_ip,
                nodes = ?m.hosts.nodes(),
                translated_here = here,
                why = %self.sharing.why(m.pod_ip),
                "a pod several nodes' endpoints hold: {}",
                if here {
                    "the kernel delivers it here; translated here"
                } else {
                    "the kernel's route to it leads to another of its nodes; its LB IP is steered there"
                }
            );
        }
        decided
    }

    /// What the whole plan puts in this node's datapath.
    fn planned_of_plan(&self) -> DatapathState {
        let me = self.view();
        let mut planned = StateBuilder::default();
        for (lb, result) in self.plan.results() {
            planned.add_result(&lb, &self.shares.gate(&lb, result), me);
        }
        // Kept until the next full round, changed in place meanwhile
        // (built packed).
        planned.build(&self.ranges.ranges)
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
    /// round, given all current ones; each is logged once.
    fn report(&mut self, current: BTreeSet<Warning>) -> (Vec<Warning>, Vec<Warning>) {
        let (new, gone) = turnover(&mut self.reported, current);
        self.log_warnings(&new, &gone);
        (new, gone)
    }

    /// The datapath's warnings that appeared and went away: one per LB IP
    /// its tables left out, on the Service owning it.
    fn report_overflow(&mut self, overflow: &Overflow) -> (Vec<Warning>, Vec<Warning>) {
        if overflow.is_empty() && self.overflow_reported.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let full: Vec<&str> = overflow.full.iter().map(|t| t.as_str()).collect();
        let node = self.node.name.as_deref().unwrap_or("this node");
        let current: BTreeSet<Warning> = overflow
            .left_out
            .iter()
            .filter_map(|lb| {
                Some(Warning {
                    service: self.plan.result_of(lb)?.service().clone(),
                    kind: WarningKind::DatapathFull,
                    message: format!(
                        "{lb} is not translated on {node}: the datapath's tables are full ({}); \
                         the other Services are applied",
                        full.join(", ")
                    ),
                })
            })
            .collect();
        let (new, gone) = turnover(&mut self.overflow_reported, current);
        self.log_warnings(&new, &gone);
        (new, gone)
    }

    fn log_warnings(&self, new: &[Warning], gone: &[Warning]) {
        for w in new {
            warn!(service = %w.service, reason = %w.kind, "{}", w.message);
        }
        for w in gone {
            info!(service = %w.service, reason = %w.kind, "resolved: {}", w.message);
        }
    }
}

/// The warnings of `current` not in `reported` (new) and of `reported`
/// not in `current` (gone); `reported` becomes `current`.
fn turnover(
    reported: &mut BTreeSet<Warning>,
    current: BTreeSet<Warning>,
) -> (Vec<Warning>, Vec<Warning>) {
    let new: Vec<Warning> = current.difference(reported).cloned().collect();
    let gone: Vec<Warning> = reported.difference(&current).cloned().collect();
    *reported = current;
    (new, gone)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::datapath::fake::{FakeHandle, FakeKernel};
    use crate::datapath::{Capacity, Synced};
    use crate::fixtures::{Slice, Svc};
    use crate::model::compute_plan;
    use crate::source::manifests;

    fn full(s: &Snapshot) -> Update {
        Update::Full(s.clone())
    }
    use std::path::PathBuf;

    /// Objects from YAML, as the manifest source reads them.
    pub fn snapshot(yaml: &str) -> Snapshot {
        let loaded = manifests::parse(&[(PathBuf::from("t.yaml"), yaml.as_bytes().to_vec())]);
        assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
        loaded.snapshot
    }

    pub fn service(name: &str, lb: &str, pod: &str, whole_ip: &str) -> String {
        with_slice(vm_in("t", name, lb).whole_ip(whole_ip), pod)
    }

    /// Service `name` of namespace `ns` on `lb`, passing port 22.
    fn vm_in(ns: &str, name: &str, lb: &str) -> Svc {
        Svc::new(name, lb).in_namespace(ns).ports(&[("TCP", 22)])
    }

    /// `svc` and its slice of one endpoint, `pod`, as YAML.
    fn with_slice(svc: Svc, pod: &str) -> String {
        let slice = Slice::new(&svc.name, "IPv4", &[(pod, None)]).in_namespace(&svc.namespace);
        format!("---\n{}---\n{}", svc.yaml(), slice.yaml())
    }

    fn reconciler() -> (Reconciler<Synced<FakeKernel>>, FakeHandle) {
        let (kernel, world) = FakeKernel::new();
        (
            Reconciler::new(Synced::new(kernel), NodeConfig::default()),
            world,
        )
    }

    pub fn desired(snap: &Snapshot) -> DatapathState {
        desired_on(snap, None)
    }

    /// What node `name` holds for `snap`, computed from scratch.
    fn desired_on(snap: &Snapshot, name: Option<&str>) -> DatapathState {
        fitted_on(snap, name, &Capacity::UNLIMITED, None, false).0
    }

    /// As [`desired_on`], fitted into `cap` keeping what `kept` holds
    /// first, and what did not fit; the pods' paths as the fake kernel's
    /// (`moved`: see [`crate::datapath::fake::FakeWorld::moved`]).
    fn fitted_on(
        snap: &Snapshot,
        name: Option<&str>,
        cap: &Capacity,
        kept: Option<&DatapathState>,
        moved: bool,
    ) -> (DatapathState, Overflow) {
        let outcome = compute_plan(&snap.services, &snap.endpoint_slices, &snap.nodes);
        let ranges = cluster_ranges(
            &ClusterConfig::default(),
            &snap.nodes,
            &snap.service_cidrs,
            &snap.pools,
        );
        let mut s = DatapathState::for_node(&outcome.plan, &ranges.ranges, NodeView::named(name));
        let (overflow, _) = s.fit(cap, kept);
        s.resolve(&crate::datapath::fake::paths(&s.pods(), moved));
        (s, overflow)
    }

    /// The round from `before` to `now` of the generated worlds
    /// ([`crate::model::tests::arb_world`]: Services s0-s5 of namespace
    /// `ns`): a full one, or one naming the Services whose objects changed.
    fn round(before: &Snapshot, now: &Snapshot, full: bool) -> Update {
        if full {
            return Update::Full(now.clone());
        }
        use crate::model::tests::objects_of;
        let names: Vec<String> = (0..6)
            .map(|n| format!("s{n}"))
            .filter(|name| {
                objects_of(name, &now.services, &now.endpoint_slices)
                    != objects_of(name, &before.services, &before.endpoint_slices)
            })
            .collect();
        let pairs: Vec<(&str, &str)> = names.iter().map(|n| ("ns", n.as_str())).collect();
        changed_in(now, &pairs)
    }

    /// The generated worlds' endpoints on node n1 or n2 (by the address's
    /// last digit), as a Snapshot.
    fn on_two_nodes(
        services: Vec<k8s_openapi::api::core::v1::Service>,
        mut slices: Vec<k8s_openapi::api::discovery::v1::EndpointSlice>,
    ) -> Snapshot {
        for e in slices.iter_mut().flat_map(|s| s.endpoints.iter_mut()) {
            let last = e.addresses.first().and_then(|a| a.chars().last());
            e.node_name = Some(if last == Some('1') { "n1" } else { "n2" }.into());
        }
        Snapshot {
            services: services.into_iter().map(std::sync::Arc::new).collect(),
            endpoint_slices: slices.into_iter().map(std::sync::Arc::new).collect(),
            ..Default::default()
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Rounds that name only the Services whose objects changed (and
        /// now and then a full one) leave the kernel exactly as computing
        /// everything from scratch would, on a node that hosts some of the
        /// pods (endpoints on node n1 or n2); where the kernel's tables are
        /// small, as fitting that into them, keeping what the kernel held
        /// (and the round reports what was left out). Now and then the
        /// pods' paths change between rounds, and the upkeep says so. The
        /// first round installs in parts.
        #[test]
        fn incremental_rounds_leave_the_kernel_as_a_full_computation_would(
            worlds in proptest::collection::vec(crate::model::tests::arb_world(), 1..8),
            fulls in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            moves in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            small in proptest::option::of((0usize..10, 0usize..4, 0usize..4)),
        ) {
            let cap = small.map_or(Capacity::UNLIMITED, |(a, l, p)| Capacity::new(a, l, p, usize::MAX));
            let (kernel, world) = FakeKernel::new();
            world.world().capacity = Some(cap);
            let node = NodeConfig { name: Some("n1".into()), ..Default::default() };
            // A fresh install in parts of two LB IPs (the first round).
            let mut r = Reconciler::new(Synced::new(kernel).with_part_lbs(2), node);
            let mut before = Snapshot::default();
            for (i, (services, slices)) in worlds.into_iter().enumerate() {
                let now = on_two_nodes(services, slices);
                let update = round(&before, &now, i == 0 || fulls[i]);
                world.world().moved = moves[i];
                r.datapath_mut().upkeep().expect("upkeep");
                let held = world.world().kernel.clone();
                let report = r.reconcile(update).expect("sync");
                let (want, overflow) = fitted_on(&now, Some("n1"), &cap, Some(&held), moves[i]);
                proptest::prop_assert_eq!(&world.world().kernel, &want);
                proptest::prop_assert_eq!(&report.sync.overflow, &overflow);
                let warned = report.new_warnings.iter().filter(|w| w.kind == WarningKind::DatapathFull).count();
                proptest::prop_assert!(warned <= overflow.left_out.len());
                before = now;
            }
        }

        /// With a namespace share (50% of tables of a few local mappings
        /// and ports), rounds naming only the Services whose objects
        /// changed leave the kernel as a full round from scratch does, and
        /// the namespace holds no more than its share.
        #[test]
        fn incremental_rounds_keep_the_namespace_share_as_a_full_round_would(
            worlds in proptest::collection::vec(crate::model::tests::arb_world(), 1..8),
            fulls in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            moves in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            (local, ports) in (0usize..7, 0usize..7),
        ) {
            let cap = Capacity::new(usize::MAX, local, ports, usize::MAX);
            let node = || NodeConfig { name: Some("n1".into()), namespace_share: Some(50), ..Default::default() };
            let fresh = |moved: bool| {
                let (kernel, world) = FakeKernel::new();
                world.world().capacity = Some(cap);
                world.world().moved = moved;
                (Reconciler::new(Synced::new(kernel), node()), world)
            };
            let (mut r, world) = fresh(false);
            let mut before = Snapshot::default();
            for (i, (services, slices)) in worlds.into_iter().enumerate() {
                let now = on_two_nodes(services, slices);
                world.world().moved = moves[i];
                r.datapath_mut().upkeep().expect("upkeep");
                r.reconcile(round(&before, &now, i == 0 || fulls[i])).expect("sync");
                let (mut scratch, scratch_world) = fresh(moves[i]);
                scratch.reconcile(Update::Full(now.clone())).expect("sync");
                proptest::prop_assert_eq!(&world.world().kernel, &scratch_world.world().kernel);
                let held = crate::datapath::Entries::of_state(&world.world().kernel);
                proptest::prop_assert!(held.fits(&cap.share(50)), "{:?}", held);
                before = now;
            }
        }
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
        let report = r.reconcile(full(&two)).expect("sync");
        // b: two map entries, its filtered pod, one port, two guarded
        // addresses (pod, LB IP) and one route.
        assert_eq!(report.sync.changed_elements, 7);
        assert!(!report.sync.installed_schema);
        assert_eq!(world.world().kernel, desired(&two));
        assert_eq!(world.world().reads, 1);
        // Nothing changed: no read, nothing applied.
        let again = r.reconcile(full(&two)).expect("sync");
        assert_eq!(again.sync.changed_elements, 0);
        assert_eq!(world.world().reads, 1);
    }

    #[test]
    fn drift_is_repaired_after_forget_and_an_error_keeps_the_kernel_and_is_retried() {
        let (mut r, world) = reconciler();
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        r.reconcile(full(&snap)).expect("sync");
        // Someone flushes our table by hand.
        world.world().kernel = DatapathState::default();
        // Without a resync we believe the kernel is as we left it.
        assert_eq!(
            r.reconcile(full(&snap))
                .expect("sync")
                .sync
                .changed_elements,
            0
        );
        // The resync reads again and repairs it.
        r.datapath_mut().forget();
        // Two map entries, two guarded addresses, one route, and the two
        // link-local in-cluster ranges.
        assert_eq!(
            r.reconcile(full(&snap))
                .expect("sync")
                .sync
                .changed_elements,
            7
        );
        assert_eq!(world.world().kernel, desired(&snap));

        // A change whose apply fails twice (attempt and retry) is an error;
        // the kernel keeps its last state.
        let before = world.world().kernel.clone();
        let changed = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        world.world().failures = 2;
        assert!(r.reconcile(full(&changed)).is_err());
        assert_eq!(world.world().kernel, before);
        // One failure is absorbed by the retry (from a fresh read).
        world.world().failures = 1;
        let reads = world.world().reads;
        r.reconcile(full(&changed)).expect("retried");
        assert_eq!(world.world().kernel, desired(&changed));
        assert_eq!(world.world().reads, reads + 1);
    }

    /// Path news that could not be read may have told a move: the next
    /// incremental round resolves every address again, not only those of
    /// the Service it names.
    #[test]
    fn lost_path_news_make_the_next_round_resolve_every_address() {
        let (mut r, world) = reconciler();
        let a = service("a", "203.0.113.10", "192.0.2.11", "true");
        r.reconcile(full(&snapshot(&a))).expect("sync");
        world.world().moved = true;
        world.world().lost_news = 1;
        assert!(r.datapath_mut().paths_news().is_err());
        let ab = snapshot(&(a + &service("b", "203.0.113.20", "192.0.2.12", "true")));
        r.reconcile(changed(&ab, &["b"])).expect("sync");
        let want = fitted_on(&ab, None, &Capacity::UNLIMITED, None, true).0;
        assert_eq!(world.world().kernel, want);
    }

    #[test]
    fn a_stale_belief_fails_the_first_attempt_and_the_retry_reads_the_kernel() {
        let (mut r, world) = reconciler();
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        r.reconcile(full(&snap)).expect("sync");
        // An element removed by hand: removing it again fails (as ENOENT
        // fails an nf_tables batch); the retry starts from the kernel.
        world.world().kernel.pod_svc.clear();
        let moved = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        r.reconcile(full(&moved))
            .expect("retried from a fresh read");
        assert_eq!(world.world().kernel, desired(&moved));
    }

    /// An incremental round for Services `names` of namespace `t` as
    /// `snap` has them.
    fn changed(snap: &Snapshot, names: &[&str]) -> Update {
        let named: Vec<(&str, &str)> = names.iter().map(|n| ("t", *n)).collect();
        changed_in(snap, &named)
    }

    /// As [`changed`], for `(namespace, name)` pairs (names unique across
    /// namespaces).
    fn changed_in(snap: &Snapshot, names: &[(&str, &str)]) -> Update {
        Update::Services(
            names
                .iter()
                .map(|(namespace, name)| {
                    let (svcs, eps) = crate::model::tests::objects_of(
                        name,
                        &snap.services,
                        &snap.endpoint_slices,
                    );
                    crate::model::ServiceObjects {
                        service: crate::model::ServiceRef::new(*namespace, *name),
                        read: crate::model::read_chosen(&svcs).map(std::sync::Arc::new),
                        slices: eps
                            .into_iter()
                            .filter_map(crate::model::ReadSlice::of_alone)
                            .map(std::sync::Arc::new)
                            .collect(),
                    }
                })
                .collect(),
        )
    }

    #[test]
    fn full_tables_leave_out_a_new_lb_ip_never_a_working_one_and_take_it_when_room_frees() {
        let (mut r, world) = reconciler();
        world.world().capacity = Some(Capacity::new(100, 2, 100, 100));
        let a = service("a", "203.0.113.20", "192.0.2.11", "true");
        let b = service("b", "203.0.113.30", "192.0.2.12", "false");
        // The lowest LB IP, arriving last.
        let c = service("c", "203.0.113.10", "192.0.2.13", "true");
        r.reconcile(full(&snapshot(&(a.clone() + &b))))
            .expect("sync");
        let abc = snapshot(&(a.clone() + &b + &c));
        let report = r.reconcile(changed(&abc, &["c"])).expect("sync");
        let c_lb: std::net::IpAddr = "203.0.113.10".parse().expect("ip");
        assert_eq!(report.sync.overflow.left_out, vec![c_lb]);
        assert_eq!(
            report.sync.overflow.full,
            vec![crate::datapath::Table::LocalMappings]
        );
        let full_warnings: Vec<&Warning> = report
            .new_warnings
            .iter()
            .filter(|w| w.kind == WarningKind::DatapathFull)
            .collect();
        assert_eq!(full_warnings.len(), 1, "{full_warnings:?}");
        assert_eq!(full_warnings[0].service.to_string(), "t/c");
        {
            let w = world.world();
            assert_eq!(w.kernel.svc_pod.len(), 2);
            assert!(!w.kernel.svc_pod.contains_key(&c_lb));
            // Dropped rather than routed on.
            assert!(w.kernel.unmapped_lbs.contains(&c_lb));
        }
        // Still full: reported once.
        let again = r.reconcile(changed(&abc, &["b"])).expect("sync");
        assert_eq!(again.sync.overflow.left_out, vec![c_lb]);
        assert!(again.new_warnings.is_empty());
        // a leaves: c takes its room, and its warning is resolved.
        let bc = snapshot(&(b + &c));
        let report = r.reconcile(changed(&bc, &["a"])).expect("sync");
        assert!(report.sync.overflow.is_empty());
        assert!(report
            .resolved_warnings
            .iter()
            .any(|w| w.kind == WarningKind::DatapathFull && w.service.to_string() == "t/c"));
        assert_eq!(world.world().kernel, desired(&bc));
        // Back to incremental rounds once nothing is left out.
        let reads = world.world().reads;
        r.reconcile(changed(&bc, &["b"])).expect("sync");
        assert_eq!(world.world().reads, reads);
    }

    #[test]
    fn warnings_are_reported_once_while_they_last_and_resolved_once() {
        let (mut r, _world) = reconciler();
        let bad = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "yes"));
        let first = r.reconcile(full(&bad)).expect("sync");
        assert_eq!(first.new_warnings.len(), 1);
        assert_eq!(first.new_warnings[0].kind.as_str(), "InvalidAnnotation");
        let second = r.reconcile(full(&bad)).expect("sync");
        assert!(second.new_warnings.is_empty());
        assert!(second.resolved_warnings.is_empty());
        let good = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        let fixed = r.reconcile(full(&good)).expect("sync");
        assert_eq!(fixed.resolved_warnings.len(), 1);
        assert!(r
            .reconcile(full(&good))
            .expect("sync")
            .resolved_warnings
            .is_empty());
    }

    /// Service `name` in namespace `ns`, created on day `day` of 2026.
    fn service_in(ns: &str, name: &str, day: u8, lb: &str, pod: &str) -> String {
        let created = format!("2026-01-{day:02}T00:00:00Z");
        with_slice(vm_in(ns, name, lb).whole_ip("true").created(&created), pod)
    }

    /// `--namespace-share 50` on tables of 4 local mappings: a namespace
    /// holds 2 here. Its older Services come first; one namespace's
    /// Services never take the room of another's; a mapping beyond the
    /// share is dropped and reported, and gets in when its namespace frees
    /// room. Every round leaves the kernel as a full round from scratch.
    #[test]
    fn a_namespace_takes_its_share_of_the_tables_and_no_more() {
        let node = |share| NodeConfig {
            namespace_share: Some(share),
            ..Default::default()
        };
        let reconciler = || {
            let (kernel, world) = FakeKernel::new();
            world.world().capacity = Some(Capacity::new(100, 4, 100, 100));
            (Reconciler::new(Synced::new(kernel), node(50)), world)
        };
        let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
        let mapped = |w: &FakeHandle| -> Vec<std::net::IpAddr> {
            w.world().kernel.svc_pod.keys().copied().collect()
        };
        let shared = |r: &ReconcileReport| -> Vec<String> {
            r.new_warnings
                .iter()
                .filter(|w| w.kind == WarningKind::NamespaceShare)
                .map(|w| w.service.to_string())
                .collect()
        };
        // The newest of a's Services has the lowest LB IP: rank decides,
        // not the address.
        let a1 = service_in("a", "a1", 1, "203.0.113.11", "192.0.2.11");
        let a2 = service_in("a", "a2", 2, "203.0.113.12", "192.0.2.12");
        let a3 = service_in("a", "a3", 3, "203.0.113.10", "192.0.2.13");
        let b1 = service_in("b", "b1", 1, "203.0.113.21", "192.0.2.21");
        let b2 = service_in("b", "b2", 2, "203.0.113.22", "192.0.2.22");
        let b3 = service_in("b", "b3", 3, "203.0.113.23", "192.0.2.23");
        let (mut r, world) = reconciler();
        let first = snapshot(&[a1.as_str(), &a2, &a3, &b1].concat());
        let report = r.reconcile(full(&first)).expect("sync");
        assert_eq!(shared(&report), vec!["a/a3"]);
        assert_eq!(
            mapped(&world),
            vec![ip("203.0.113.11"), ip("203.0.113.12"), ip("203.0.113.21")]
        );
        assert!(world
            .world()
            .kernel
            .unmapped_lbs
            .contains(&ip("203.0.113.10")));
        // b grows past its share: a is untouched.
        let grown = snapshot(&[a1.as_str(), &a2, &a3, &b1, &b2, &b3].concat());
        let report = r
            .reconcile(changed_in(&grown, &[("b", "b2"), ("b", "b3")]))
            .expect("sync");
        assert_eq!(shared(&report), vec!["b/b3"]);
        let held = world.world().kernel.clone();
        let (mut fresh, fresh_world) = reconciler();
        fresh.reconcile(full(&grown)).expect("sync");
        assert_eq!(held, fresh_world.world().kernel, "incremental != full");
        assert!(held.svc_pod.contains_key(&ip("203.0.113.11")));
        assert!(!held.svc_pod.contains_key(&ip("203.0.113.23")));
        // a's oldest goes: a3 takes its room, in the same round.
        let freed = snapshot(&[a2.as_str(), &a3, &b1, &b2, &b3].concat());
        let report = r
            .reconcile(changed_in(&freed, &[("a", "a1")]))
            .expect("sync");
        let resolved: Vec<String> = report
            .resolved_warnings
            .iter()
            .filter(|w| w.kind == WarningKind::NamespaceShare)
            .map(|w| w.service.to_string())
            .collect();
        assert_eq!(resolved, vec!["a/a3"]);
        assert!(world
            .world()
            .kernel
            .svc_pod
            .contains_key(&ip("203.0.113.10")));
        let (mut fresh, fresh_world) = reconciler();
        fresh.reconcile(full(&freed)).expect("sync");
        assert_eq!(
            world.world().kernel,
            fresh_world.world().kernel,
            "incremental != full"
        );
        // At 100% there is no bound: the tables' own fitting decides.
        let (kernel, world) = FakeKernel::new();
        let mut r = Reconciler::new(Synced::new(kernel), node(100));
        r.reconcile(full(&first)).expect("sync");
        assert_eq!(world.world().kernel.svc_pod.len(), 4);
    }
}
