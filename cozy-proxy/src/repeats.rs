//! A warning that may come back every round (an upkeep that keeps
//! failing, a directory that stays unreadable, a file that stays broken):
//! logged when it first appears, then at most once a minute while it
//! lasts, with how many were held back; logged at once again after it
//! went away.
use std::time::{Duration, Instant};

/// How often a warning that lasts is logged again.
pub const REPEAT_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct Repeats {
    every: Duration,
    /// When it was last logged (`None`: not since it went away).
    logged: Option<Instant>,
    held_back: u64,
}

impl Default for Repeats {
    fn default() -> Self {
        Repeats::new(REPEAT_EVERY)
    }
}

impl Repeats {
    pub const fn new(every: Duration) -> Self {
        Repeats {
            every,
            logged: None,
            held_back: 0,
        }
    }

    /// Another occurrence at `now`: `Some(held back since the last one
    /// logged)` if this one is to be logged.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        match self.logged {
            Some(at) if now.duration_since(at) < self.every => {
                self.held_back += 1;
                None
            }
            _ => {
                self.logged = Some(now);
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }

    /// It went away: the next occurrence is logged at once.
    pub fn clear(&mut self) {
        self.logged = None;
        self.held_back = 0;
    }
}

/// `warn!` through a [`Repeats`]: `warn_repeating!(repeats, fields...;
/// "message")`, with `held_back` added to the fields.
#[macro_export]
macro_rules! warn_repeating {
    ($repeats:expr, $($fields:tt)*) => {
        if let Some(held_back) = $repeats.admit(::std::time::Instant::now()) {
            ::tracing::warn!(held_back, $($fields)*);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lasting_warning_is_logged_once_a_period_with_what_was_held_back() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut r = Repeats::new(Duration::from_secs(1));
        assert_eq!(r.admit(at(0)), Some(0));
        // Four times a second (the manifest poll), for a second: held.
        for ms in [250, 500, 750] {
            assert_eq!(r.admit(at(ms)), None);
        }
        assert_eq!(r.admit(at(1000)), Some(3));
        assert_eq!(r.admit(at(1250)), None);
        // Gone, then back: at once.
        r.clear();
        assert_eq!(r.admit(at(1300)), Some(0));
    }
}
