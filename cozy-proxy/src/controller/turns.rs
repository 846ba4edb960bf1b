//! What the controller's loop keeps between its turns, and how each event
//! changes it: pure, so its rules are tested without a runtime.
use std::time::Duration;

/// When a wake that found no path news is looked at again (after the
/// wake, then after the first look). The watcher thread and the datapath
/// read the kernel's path news from two sockets: a wake may come before
/// the news reaches the datapath's.
pub const LATE_NEWS: [Duration; 2] = [Duration::from_millis(20), Duration::from_millis(200)];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turns {
    /// A round is due.
    pending: bool,
    /// The next round reads every object: the first, and after a resync.
    full: bool,
    /// Rounds failed in a row: the pause before the next attempt grows.
    failures: u32,
    /// Looks left at the path news a wake did not find.
    late_checks: usize,
}

impl Turns {
    pub fn new() -> Turns {
        Turns {
            pending: true,
            full: true,
            failures: 0,
            late_checks: 0,
        }
    }

    pub fn round_due(&self) -> bool {
        self.pending
    }

    /// A round starts: whether it reads every object. The next one does
    /// not, even if this one fails: what it read is in the plan, and a
    /// retry needs only what changed since.
    pub fn round_starts(&mut self) -> bool {
        std::mem::replace(&mut self.full, false)
    }

    pub fn round_succeeded(&mut self) {
        self.pending = false;
        self.failures = 0;
    }

    /// The round failed: it stays due, and is retried after the pause
    /// returned (100 ms, doubling with each failure in a row, at most
    /// `resync`), not only at the next event.
    pub fn round_failed(&mut self, resync: Duration) -> Duration {
        let pause = Duration::from_millis(100)
            .saturating_mul(1 << self.failures.min(16))
            .min(resync);
        self.failures = self.failures.saturating_add(1);
        pause
    }

    /// The source changed.
    pub fn changed(&mut self) {
        self.pending = true;
    }

    /// The resync: the next round reads every object and the kernel.
    pub fn resync(&mut self) {
        self.pending = true;
        self.full = true;
    }

    /// Upkeep ran: `paths_changed`, the kernel's paths may have changed.
    pub fn upkept(&mut self, paths_changed: bool) {
        self.pending |= paths_changed;
    }

    /// Path news were looked at, after a wake (`late`: at a later look):
    /// `changed`, a path may have changed. Returns when to look again.
    pub fn path_news(&mut self, changed: bool, late: bool) -> Option<Duration> {
        self.pending |= changed;
        self.late_checks = match (changed, late) {
            (true, _) => 0,
            (false, false) => LATE_NEWS.len(),
            (false, true) => self.late_checks.saturating_sub(1),
        };
        self.next_late_check()
    }

    /// When the next look at late path news is due, if one is.
    pub fn next_late_check(&self) -> Option<Duration> {
        (self.late_checks > 0).then(|| LATE_NEWS[LATE_NEWS.len() - self.late_checks])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESYNC: Duration = Duration::from_secs(2);

    #[test]
    fn the_first_round_is_full_and_a_failed_one_is_retried_incrementally() {
        let mut t = Turns::new();
        assert!(t.round_due());
        assert!(t.round_starts(), "the first round reads everything");
        assert_eq!(t.round_failed(RESYNC), Duration::from_millis(100));
        assert!(t.round_due(), "a failed round stays due");
        assert!(!t.round_starts(), "its retry needs only what changed");
        t.round_succeeded();
        assert!(!t.round_due());
    }

    #[test]
    fn the_retry_pause_doubles_up_to_the_resync_and_resets_on_success() {
        let mut t = Turns::new();
        let pauses: Vec<u64> = (0..7)
            .map(|_| t.round_failed(RESYNC).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 2000, 2000]);
        t.round_succeeded();
        assert_eq!(t.round_failed(RESYNC), Duration::from_millis(100));
    }

    #[test]
    fn a_resync_makes_the_next_round_full() {
        let mut t = Turns::new();
        t.round_starts();
        t.round_succeeded();
        t.changed();
        assert!(t.round_due() && !t.round_starts(), "a change: incremental");
        t.round_succeeded();
        t.resync();
        assert!(t.round_due() && t.round_starts(), "a resync: full");
    }

    #[test]
    fn a_wake_without_news_is_looked_at_twice_more_then_left() {
        let mut t = Turns::new();
        t.round_succeeded();
        assert_eq!(t.path_news(false, false), Some(LATE_NEWS[0]));
        assert_eq!(t.path_news(false, true), Some(LATE_NEWS[1]));
        assert_eq!(t.path_news(false, true), None);
        assert!(!t.round_due());
        // News found at a late look end the looks and make a round due.
        t.path_news(false, false);
        assert_eq!(t.path_news(true, true), None);
        assert!(t.round_due());
    }

    #[test]
    fn upkeep_makes_a_round_due_only_when_paths_changed() {
        let mut t = Turns::new();
        t.round_succeeded();
        t.upkept(false);
        assert!(!t.round_due());
        t.upkept(true);
        assert!(t.round_due());
    }
}
