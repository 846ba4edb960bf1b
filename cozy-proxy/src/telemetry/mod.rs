//! What the controller tells the outside: Prometheus metrics, health
//! endpoints (`/metrics`, `/healthz`, `/readyz`) and its word on the
//! mappings several nodes hold (`/hosting`, read by `cozy-proxy dump`).
mod client;
mod http;
mod metrics;

pub use client::read_hosting;
pub use http::serve;
pub use metrics::Metrics;

use crate::datapath::SharedMapping;
use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// How long the controller loop may go without completing a turn before
/// `/healthz` fails (the kubelet then restarts a wedged loop). The loop
/// turns at least every second (its upkeep); a large sync takes seconds.
pub const HEALTH_STALL: Duration = Duration::from_secs(60);

/// Shared between the controller loop and the HTTP server.
#[derive(Clone)]
pub struct Telemetry {
    pub metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    /// When the process started: the origin of `heartbeat`.
    origin: Instant,
    /// Milliseconds after `origin` of the loop's last completed turn (0:
    /// the loop has not started its turns: it waits for the first lists,
    /// which is not being wedged).
    heartbeat: Arc<AtomicU64>,
    /// The mappings this node shares with others, as last decided (a
    /// handful: the VMs migrating now).
    shared: Arc<Mutex<Vec<SharedMapping>>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            metrics: Arc::default(),
            ready: Arc::default(),
            origin: Instant::now(),
            heartbeat: Arc::default(),
            shared: Arc::default(),
        }
    }
}

impl Telemetry {
    pub fn new() -> Self {
        Telemetry::default()
    }

    /// The controller loop completed a turn.
    pub fn beat(&self) {
        let ms = self.origin.elapsed().as_millis().max(1) as u64;
        self.heartbeat.store(ms, Ordering::Relaxed);
    }

    /// Healthy unless the loop has turned before and not for longer than
    /// `stall` as of `now`; the age of the last turn otherwise.
    pub fn stalled_for(&self, now: Instant, stall: Duration) -> Option<Duration> {
        let beat = self.heartbeat.load(Ordering::Relaxed);
        if beat == 0 {
            return None;
        }
        let age = now
            .saturating_duration_since(self.origin)
            .saturating_sub(Duration::from_millis(beat));
        (age > stall).then_some(age)
    }

    /// Ready once the first sync has put the datapath in place.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The mappings shared with other nodes, as the last round decided.
    pub fn set_shared(&self, shared: &[SharedMapping]) {
        let mut held = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        shared.clone_into(&mut held);
    }

    /// `/hosting`: the shared mappings as JSON.
    pub fn shared_json(&self) -> String {
        let held = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::to_string(&*held).unwrap_or_else(|_| "[]".into())
    }
}

#[cfg(test)]
mod tests {
    use super::Telemetry;
    use std::time::{Duration, Instant};

    #[test]
    fn health_fails_only_after_the_loop_stopped_turning() {
        let t = Telemetry::new();
        let later = Instant::now() + Duration::from_secs(3600);
        // Waiting for the first lists is not being wedged.
        assert_eq!(t.stalled_for(later, Duration::from_secs(60)), None);
        t.beat();
        assert_eq!(t.stalled_for(Instant::now(), Duration::from_secs(60)), None);
        let age = t.stalled_for(later, Duration::from_secs(60));
        assert!(
            age.is_some_and(|a| a >= Duration::from_secs(3599)),
            "{age:?}"
        );
        t.beat();
        assert_eq!(t.stalled_for(Instant::now(), Duration::from_secs(60)), None);
    }
}
