//! Endpoints held through a readiness flap: a pod that was ready and whose
//! endpoint turns not ready without terminating keeps backing its LB IP
//! for a while ([`ReadSlice::held_from`]). The kubelet resets every
//! readiness probe to failing when it restarts, until each runs again (up
//! to a probe period, with jitter, and the status's way through the API):
//! without a hold, every single-pod Service on that node would lose its
//! LB IP and, with its egress translation, every connection. A real
//! failure is reported by then after `failureThreshold` probe periods; the
//! hold adds its time to that only while nothing else can back the IP.
use crate::model::{ReadSlice, ServiceRef};
use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};
use tracing::info;

/// The slices holding an address, by Service and slice name: when each
/// hold ends. What a slice holds is in the version the cache shows
/// ([`ReadSlice::unheld`] takes it out at the end).
#[derive(Default)]
pub struct Holds {
    /// How long a hold lasts; zero: never held.
    time: Duration,
    by_slice: HashMap<(ServiceRef, Box<str>), Instant>,
}

impl Holds {
    pub fn new(time: Duration) -> Self {
        Holds {
            time,
            by_slice: HashMap::new(),
        }
    }

    /// What the model reads of `read`, the new version of a slice of
    /// `owner` whose version shown so far is `previous`: `read` with what
    /// it holds ([`ReadSlice::held_from`]). A hold that goes on keeps the
    /// time it began with: a pod that stays not ready is not held forever.
    pub fn through(
        &mut self,
        owner: &ServiceRef,
        read: ReadSlice,
        previous: Option<&ReadSlice>,
        now: Instant,
    ) -> Arc<ReadSlice> {
        let shown = match previous {
            Some(previous) if !self.time.is_zero() => read.held_from(previous),
            _ => None,
        };
        let Some(shown) = shown else {
            self.drop_slice(owner, &read.name);
            return Arc::new(read);
        };
        let key = (owner.clone(), read.name.clone());
        if !self.by_slice.contains_key(&key) {
            let held: Vec<String> = shown.held().map(ToString::to_string).collect();
            info!(
                service = %owner, slice = %read.shown_name(), addresses = ?held,
                hold = ?self.time,
                "a ready endpoint turned not ready without terminating; it keeps backing \
                 the LB IP while nothing else can, until it is ready again or the hold ends"
            );
            self.by_slice.insert(key, now + self.time);
        }
        Arc::new(shown)
    }

    /// The slice `name` of `owner` is gone: nothing of it is held.
    pub fn drop_slice(&mut self, owner: &ServiceRef, name: &str) {
        if !self.by_slice.is_empty() {
            self.by_slice
                .retain(|(o, n), _| !(o == owner && &**n == name));
        }
    }

    /// Every hold ends (the slices were listed again).
    pub fn clear(&mut self) {
        self.by_slice.clear();
    }

    /// When the next hold ends.
    pub fn next_end(&self) -> Option<Instant> {
        self.by_slice.values().min().copied()
    }

    /// The holds ended by `now`: the Service and the slice's name of each.
    pub fn take_ended(&mut self, now: Instant) -> Vec<(ServiceRef, Box<str>)> {
        let mut ended = Vec::new();
        self.by_slice.retain(|key, until| {
            let over = *until <= now;
            if over {
                info!(
                    service = %key.0, slice = %key.1,
                    "the hold of a not-ready endpoint ended; it no longer backs the LB IP"
                );
                ended.push(key.clone());
            }
            !over
        });
        ended
    }
}
