//! What the controller tells the outside: Prometheus metrics and health
//! endpoints (`/metrics`, `/healthz`, `/readyz`).
mod http;
mod metrics;

pub use http::serve;
pub use metrics::Metrics;

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

/// Shared between the controller loop and the HTTP server.
#[derive(Clone, Default)]
pub struct Telemetry {
    pub metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

impl Telemetry {
    pub fn new() -> Self {
        Telemetry::default()
    }

    /// Ready once the first sync has put the datapath in place.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}
