//! The reconcile step shared by every source: objects in, plan computed,
//! problems reported, datapath synced.
use crate::datapath::{Datapath, DatapathState, SyncReport};
use crate::model::{compute_plan, Outcome, Warning};
use crate::source::Snapshot;
use std::collections::BTreeSet;
use tracing::{info, warn};

pub struct Reconciler<D: Datapath> {
    datapath: D,
    /// Warnings already reported: each is logged once while it lasts.
    reported: BTreeSet<Warning>,
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
    /// Elements the datapath holds now.
    pub elements: usize,
}

impl<D: Datapath> Reconciler<D> {
    pub fn new(datapath: D) -> Self {
        Reconciler {
            datapath,
            reported: BTreeSet::new(),
            synced_once: false,
        }
    }

    pub fn datapath(&self) -> &D {
        &self.datapath
    }

    pub fn datapath_mut(&mut self) -> &mut D {
        &mut self.datapath
    }

    pub fn reconcile(&mut self, snapshot: &Snapshot) -> Result<ReconcileReport, D::Error> {
        let outcome = compute_plan(&snapshot.services, &snapshot.endpoint_slices);
        let new_warnings = self.report(&outcome.warnings);
        let desired = DatapathState::from_plan(&outcome.plan);
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
            elements,
        })
    }

    fn report(&mut self, current: &[Warning]) -> Vec<Warning> {
        let current: BTreeSet<Warning> = current.iter().cloned().collect();
        let new: Vec<Warning> = current.difference(&self.reported).cloned().collect();
        for w in &new {
            warn!(service = %w.service, reason = %w.kind, "{}", w.message);
        }
        for gone in self.reported.difference(&current) {
            info!(service = %gone.service, reason = %gone.kind, "resolved: {}", gone.message);
        }
        self.reported = current;
        new
    }
}
