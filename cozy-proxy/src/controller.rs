//! The reconcile loop every source shares: events mark the state dirty and
//! the source tells which Services changed; each round updates the plan
//! for them (a full round at start and at each resync rebuilds it from the whole
//! snapshot), coalesced, with a periodic resync that repairs drift. The
//! reconciler and its datapath live on a thread of their own
//! ([`Worker`]): the loop only waits for it, never blocks on a syscall.
use crate::datapath::worker::Worker;
use crate::datapath::{Datapath, ErrorKind};
use crate::model::Warning;
use crate::reconcile::Reconciler;
use crate::repeats::Repeats;
use crate::source::{Source, Update};
use crate::telemetry::Telemetry;
use crate::warn_repeating;
use std::{future::Future, time::Duration, time::Instant};
use tracing::{error, info};
use turns::Turns;

mod turns;

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
pub type WarningSink = Box<dyn Fn(&[Warning]) + Send>;

/// Everything one controller runs with.
pub struct RunContext<D: Datapath, S: Source> {
    pub datapath: Worker<Reconciler<D>>,
    pub source: S,
    pub telemetry: Telemetry,
    pub settings: LoopSettings,
    pub on_warnings: WarningSink,
    /// Notified when the kernel announces a change that may move a pod's
    /// path (`steer::watch_paths`).
    pub path_news: std::sync::Arc<tokio::sync::Notify>,
}

/// Runs until `shutdown` resolves. Nothing here ever flushes the datapath:
/// on any error it keeps its last state and the round is retried.
pub async fn run<D, S>(ctx: RunContext<D, S>, shutdown: impl Future<Output = ()>)
where
    D: Datapath + 'static,
    S: Source,
{
    let RunContext {
        datapath,
        mut source,
        telemetry,
        settings,
        mut on_warnings,
        path_news,
    } = ctx;
    let mut shutdown = std::pin::pin!(shutdown);
    info!("waiting for the initial lists; the datapath stays as it is until then");
    tokio::select! {
        _ = source.ready() => {}
        _ = &mut shutdown => return,
    }
    let mut resync = tokio::time::interval(settings.resync);
    resync.tick().await;
    let mut upkeep = tokio::time::interval(settings.upkeep);
    let mut counters = tokio::time::interval(settings.counters);
    let mut turns = Turns::new();
    let mut retry = std::pin::pin!(tokio::time::sleep(Duration::MAX / 4));
    let mut late_news = std::pin::pin!(tokio::time::sleep(Duration::MAX / 4));
    // The warnings of the periodic jobs, which fail again each period
    // while their cause lasts.
    let mut repeats = PeriodicWarnings::default();
    loop {
        // A turn of the loop: /healthz fails when they stop.
        telemetry.beat();
        if turns.round_due() {
            let jobs = (&datapath, &mut source, &telemetry, &mut on_warnings);
            match round(jobs, &mut turns, settings.resync).await {
                Round::Done => {}
                Round::Failed { retry_in } => {
                    retry.as_mut().reset(tokio::time::Instant::now() + retry_in);
                }
                Round::Gone => return,
            }
        }
        tokio::select! {
            _ = source.changed() => {
                // Not cancellable here: whatever else arrives meanwhile is
                // part of this round. None at all is no timer: tokio's
                // rounds a zero sleep up to its next millisecond tick.
                if !settings.debounce.is_zero() {
                    tokio::time::sleep(settings.debounce).await;
                }
                turns.changed();
            }
            _ = &mut retry, if turns.round_due() => {}
            _ = resync.tick() => {
                if datapath.call(|r| r.datapath_mut().forget()).await.is_err() {
                    return;
                }
                turns.resync();
            }
            _ = path_news.notified() => {
                match news_turn(&datapath, &mut repeats.paths, &mut turns, false).await {
                    Some(again) => rearm(late_news.as_mut(), again),
                    None => return,
                }
            }
            _ = &mut late_news, if turns.next_late_check().is_some() => {
                match news_turn(&datapath, &mut repeats.paths, &mut turns, true).await {
                    Some(again) => rearm(late_news.as_mut(), again),
                    None => return,
                }
            }
            _ = upkeep.tick() => match datapath.call(|r| r.datapath_mut().upkeep()).await {
                Ok(Ok(paths_changed)) => {
                    turns.upkept(paths_changed);
                    repeats.upkeep.clear();
                }
                Ok(Err(e)) => warn_repeating!(repeats.upkeep, error = %e, "datapath upkeep failed"),
                Err(_) => return,
            },
            _ = counters.tick() => match datapath.call(|r| r.datapath().counters()).await {
                Ok(Ok(c)) => {
                    telemetry.metrics.observe_datapath_counters(c);
                    repeats.counters.clear();
                }
                Ok(Err(e)) => warn_repeating!(repeats.counters, error = %e, "reading datapath counters failed"),
                Err(_) => return,
            },
            _ = &mut shutdown => break,
        }
    }
    // No flush on exit: the kernel keeps translating while we restart.
    info!("stopping; the datapath stays in place (`cozy-proxy cleanup` removes it)");
}

/// How a round ended.
enum Round {
    Done,
    /// The datapath keeps its last state; the round is retried after
    /// `retry_in`.
    Failed {
        retry_in: Duration,
    },
    /// The datapath's thread is gone: the controller stops.
    Gone,
}

/// What a round works with: the datapath's thread, the source, the
/// telemetry and the warning sink (`&mut`: it is `Send`, not `Sync`, and
/// held across an await).
type RoundJobs<'a, D, S> = (
    &'a Worker<Reconciler<D>>,
    &'a mut S,
    &'a Telemetry,
    &'a mut WarningSink,
);

/// One round: the source's update reconciled on the datapath's thread,
/// its outcome told to `turns`, the metrics and the warning sink; a
/// failure waits a pause that grows up to `resync`.
async fn round<D: Datapath + 'static, S: Source>(
    (datapath, source, telemetry, on_warnings): RoundJobs<'_, D, S>,
    turns: &mut Turns,
    resync: Duration,
) -> Round {
    let started = Instant::now();
    let update = source.update(turns.round_starts());
    let was_full = matches!(update, Update::Full(_));
    let round = datapath
        .call(move |r| {
            let backend = r.datapath().kind();
            r.reconcile(update).map_err(|e| (backend, e))
        })
        .await;
    if was_full {
        crate::memory::release_freed();
    }
    match round {
        Ok(Ok(report)) => {
            turns.round_succeeded();
            let m = &telemetry.metrics;
            m.observe_sync(started.elapsed().as_secs_f64());
            m.observe_plan(&report.summary, report.sync.elements);
            m.observe_overflow(&report.sync.overflow);
            m.observe_shared(&report.shared);
            telemetry.set_shared(&report.shared);
            on_warnings(&report.new_warnings);
            telemetry.set_ready();
            Round::Done
        }
        Ok(Err((backend, e))) => {
            telemetry
                .metrics
                .sync_failed(&backend.to_string(), e.kind());
            let retry_in = turns.round_failed(resync);
            error!(error = %e, ?retry_in, "sync failed; the datapath keeps its last state");
            Round::Failed { retry_in }
        }
        Err(gone) => {
            error!(error = %gone, "stopping");
            Round::Gone
        }
    }
}

/// The kernel's path news looked at (`late`: again, a moment after a wake
/// that found none) and told to `turns`: when to look again, if at all.
/// `None`: the datapath thread is gone.
async fn news_turn<D: Datapath + 'static>(
    datapath: &Worker<Reconciler<D>>,
    repeats: &mut Repeats,
    turns: &mut Turns,
    late: bool,
) -> Option<Option<Duration>> {
    let changed = match datapath.call(|r| r.datapath_mut().paths_news()).await {
        Ok(Ok(changed)) => {
            repeats.clear();
            changed
        }
        // The sync layer takes news it could not read as a change of
        // every path; no round is forced for it (a broken socket would
        // force one per wake).
        Ok(Err(e)) => {
            warn_repeating!(repeats, error = %e, "following the kernel's paths failed");
            false
        }
        Err(_) => return None,
    };
    if late && changed {
        info!("path news arrived after their wake");
    }
    Some(turns.path_news(changed, late))
}

/// Sets `timer` to fire `after` from now; left as it is for `None`.
fn rearm(timer: std::pin::Pin<&mut tokio::time::Sleep>, after: Option<Duration>) {
    if let Some(after) = after {
        timer.reset(tokio::time::Instant::now() + after);
    }
}

#[derive(Default)]
struct PeriodicWarnings {
    paths: Repeats,
    upkeep: Repeats,
    counters: Repeats,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::fake::{FakeHandle, FakeKernel};
    use crate::datapath::{DatapathState, Synced};
    use crate::source::Snapshot;
    use std::sync::{Arc, Mutex};
    use tokio::sync::{mpsc, Notify};

    /// A source the test feeds: `ready` once told, `changed` on each push.
    struct TestSource {
        ready: Arc<Notify>,
        changes: mpsc::UnboundedReceiver<Snapshot>,
        current: Snapshot,
    }

    impl Source for TestSource {
        async fn ready(&mut self) {
            self.ready.notified().await;
        }
        async fn changed(&mut self) {
            match self.changes.recv().await {
                Some(s) => self.current = s,
                None => std::future::pending().await,
            }
        }
        fn update(&mut self, _full: bool) -> Update {
            Update::Full(self.current.clone())
        }
    }

    struct Harness {
        world: FakeHandle,
        ready: Arc<Notify>,
        push: mpsc::UnboundedSender<Snapshot>,
        path_news: Arc<Notify>,
        telemetry: Telemetry,
        warnings: Arc<Mutex<Vec<String>>>,
        stop: Arc<Notify>,
        task: tokio::task::JoinHandle<()>,
    }

    fn start(initial: Snapshot, resync: Duration) -> Harness {
        start_with(initial, resync, Duration::from_millis(20))
    }

    /// With upkeep every `upkeep` (which follows the paths too).
    fn start_with(initial: Snapshot, resync: Duration, upkeep: Duration) -> Harness {
        let (kernel, world) = FakeKernel::new();
        let datapath = Worker::spawn("test-datapath", move || {
            Ok::<_, std::io::Error>(Reconciler::new(Synced::new(kernel), Default::default()))
        })
        .expect("worker");
        let ready = Arc::new(Notify::new());
        let (push, changes) = mpsc::unbounded_channel();
        let telemetry = Telemetry::new();
        let warnings = Arc::new(Mutex::new(Vec::new()));
        let seen = warnings.clone();
        let stop = Arc::new(Notify::new());
        let path_news = Arc::new(Notify::new());
        let ctx = RunContext {
            datapath,
            source: TestSource {
                ready: ready.clone(),
                changes,
                current: initial,
            },
            telemetry: telemetry.clone(),
            settings: LoopSettings {
                debounce: Duration::from_millis(5),
                resync,
                upkeep,
                counters: Duration::from_secs(3600),
            },
            on_warnings: Box::new(move |w| {
                let mut seen = seen.lock().expect("lock");
                seen.extend(w.iter().map(|w| w.kind.as_str().to_string()));
            }),
            path_news: path_news.clone(),
        };
        let stopped = stop.clone();
        let task =
            tokio::spawn(async move { run(ctx, async move { stopped.notified().await }).await });
        Harness {
            world,
            ready,
            push,
            path_news,
            telemetry,
            warnings,
            stop,
            task,
        }
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..400 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("timed out waiting for {what}");
    }

    use crate::reconcile::tests::{desired, service, snapshot};

    #[tokio::test]
    async fn nothing_is_touched_before_the_source_is_ready_then_changes_flow() {
        let first = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        let h = start(first.clone(), Duration::from_secs(3600));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            h.world.world().reads,
            0,
            "read before the lists were complete"
        );
        assert!(!h.telemetry.is_ready());
        h.ready.notify_one();
        until("first sync", || h.world.world().kernel == desired(&first)).await;
        // Ready is set right after the sync's report, not with the kernel.
        until("ready after the first sync", || h.telemetry.is_ready()).await;
        let second = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        h.push.send(second.clone()).expect("push");
        until("change applied", || {
            h.world.world().kernel == desired(&second)
        })
        .await;
        h.stop.notify_one();
        h.task.await.expect("loop ends at shutdown");
        // Shutdown leaves the datapath in place.
        assert_eq!(h.world.world().kernel, desired(&second));
    }

    #[tokio::test]
    async fn the_resync_repairs_drift_and_a_failing_sync_is_retried() {
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        let h = start(snap.clone(), Duration::from_millis(50));
        h.ready.notify_one();
        until("first sync", || h.world.world().kernel == desired(&snap)).await;
        h.world.world().kernel = DatapathState::default();
        until("drift repaired", || {
            h.world.world().kernel == desired(&snap)
        })
        .await;
        // Every attempt of the next round fails for a while: the loop keeps
        // the old state, counts the errors, and gets there once the kernel
        // accepts again.
        let moved = snapshot(&service("a", "203.0.113.10", "192.0.2.12", "true"));
        h.world.world().failures = 6;
        h.push.send(moved.clone()).expect("push");
        until("retried until applied", || {
            h.world.world().kernel == desired(&moved)
        })
        .await;
        let metrics = h.telemetry.metrics.render();
        assert!(
            metrics.contains(r#"cozy_proxy_sync_errors_total{backend="nft",kind="fake"} 3"#),
            "three failed rounds (two attempts each): {metrics}"
        );
        h.stop.notify_one();
        h.task.await.expect("loop");
    }

    #[tokio::test]
    async fn warnings_reach_the_sink_once_while_they_last() {
        let bad = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "maybe"));
        let h = start(bad.clone(), Duration::from_millis(30));
        h.ready.notify_one();
        until("first sync", || h.world.world().applies > 0).await;
        // Several resync rounds later, still one report.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(*h.warnings.lock().expect("lock"), vec!["InvalidAnnotation"]);
        let good = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        h.push.send(good).expect("push");
        tokio::time::sleep(Duration::from_millis(50)).await;
        h.push.send(bad).expect("push");
        until("reported again after it came back", || {
            h.warnings.lock().expect("lock").len() == 2
        })
        .await;
        h.stop.notify_one();
        h.task.await.expect("loop");
    }

    #[tokio::test]
    async fn path_news_that_arrive_after_their_wake_are_still_followed() {
        let snap = snapshot(&service("a", "203.0.113.10", "192.0.2.11", "true"));
        // Neither upkeep nor resync comes during the test: only path news
        // follow the pod.
        let h = start_with(
            snap.clone(),
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        );
        h.ready.notify_one();
        until("first sync", || h.world.world().kernel == desired(&snap)).await;
        let pod: std::net::IpAddr = "192.0.2.11".parse().expect("pod");
        assert_eq!(h.world.world().kernel.guard.get(&pod), Some(&7));
        {
            let mut w = h.world.world();
            w.moved = true;
            // The wake finds nothing: the news reaches the datapath's
            // socket only after it looked.
            w.late_news = 1;
        }
        h.path_news.notify_one();
        until("the guard follows the moved pod", || {
            h.world.world().kernel.guard.get(&pod) == Some(&8)
        })
        .await;
        h.stop.notify_one();
        h.task.await.expect("loop");
    }
}
