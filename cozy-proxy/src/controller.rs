//! The reconcile loop every source shares: level-triggered (events only
//! mark the state dirty; each round recomputes the plan from the whole
//! snapshot), coalesced, with a periodic resync that repairs drift.
use crate::datapath::Datapath;
use crate::model::Warning;
use crate::reconcile::Reconciler;
use crate::source::Source;
use crate::telemetry::Telemetry;
use std::{future::Future, time::Duration, time::Instant};
use tracing::{error, info, warn};

pub struct LoopSettings {
    /// How long after a change to wait for more before reconciling.
    pub debounce: Duration,
    /// How often the kernel is read again and drift repaired.
    pub resync: Duration,
    /// How often the datapath does its upkeep (following interfaces).
    pub upkeep: Duration,
    /// How often the datapath's counters are copied into the metrics.
    pub counters: Duration,
}

/// Called with the warnings that appeared in a round.
pub type WarningSink<'a> = Box<dyn Fn(&[Warning]) + Send + 'a>;

/// Runs until `shutdown` resolves. Nothing here ever flushes the datapath:
/// on any error it keeps its last state and the round is retried.
pub async fn run<D: Datapath, S: Source>(
    datapath: D,
    mut source: S,
    telemetry: Telemetry,
    settings: LoopSettings,
    on_warnings: WarningSink<'_>,
    on_first_sync: impl FnOnce(),
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut reconciler = Reconciler::new(datapath);
    info!("waiting for the initial lists; the datapath stays as it is until then");
    tokio::select! {
        _ = source.ready() => {}
        _ = &mut shutdown => return,
    }
    let mut resync = tokio::time::interval(settings.resync);
    resync.tick().await;
    let mut upkeep = tokio::time::interval(settings.upkeep);
    let mut counters = tokio::time::interval(settings.counters);
    let mut first = Some(on_first_sync);
    let mut pending = true;
    loop {
        if pending {
            let started = Instant::now();
            let snapshot = source.snapshot();
            match reconciler.reconcile(&snapshot) {
                Ok(report) => {
                    pending = false;
                    let m = &telemetry.metrics;
                    m.observe_sync(started.elapsed().as_secs_f64());
                    m.observe_outcome(&report.outcome, report.elements);
                    on_warnings(&report.new_warnings);
                    if let Some(f) = first.take() {
                        telemetry.set_ready();
                        f();
                    }
                }
                Err(e) => {
                    telemetry.metrics.sync_failed();
                    error!(error = %e, "sync failed; the datapath keeps its last state, retrying");
                }
            }
        }
        tokio::select! {
            _ = source.changed() => {
                // Not cancellable here: whatever else arrives meanwhile is
                // part of this round.
                tokio::time::sleep(settings.debounce).await;
                pending = true;
            }
            _ = resync.tick() => {
                reconciler.datapath_mut().forget();
                pending = true;
            }
            _ = upkeep.tick() => {
                if let Err(e) = reconciler.datapath_mut().tick() {
                    warn!(error = %e, "datapath upkeep failed");
                }
            }
            _ = counters.tick() => match reconciler.datapath().counters() {
                Ok(c) => telemetry.metrics.observe_datapath_counters(&c),
                Err(e) => warn!(error = %e, "reading datapath counters failed"),
            },
            _ = &mut shutdown => break,
        }
    }
    // No flush on exit: the kernel keeps translating while we restart.
    info!("stopping; the datapath stays in place (`cozy-proxy cleanup` removes it)");
}
