//! Whether the pipeline's own work is behind, as the process that runs retention sees it: a
//! runner yields to a relay or a consumer catching up on a backlog, since a backlog drains faster
//! with the database to itself and old rows can wait; and, for a bounded share of its time, to
//! rounds of that work that waited long for a slow database.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shared between the work that finds itself behind (a relay's claim that came back full, a
/// consumer's batch that took as many messages as it may) or slow (either of them taking
/// [`SLOW`] or longer) and the runner that yields to it. Cloning gives another handle on the same
/// signals.
#[derive(Clone)]
pub struct Backlog {
    since: Instant,
    /// When work was last found behind.
    behind: Arc<Moment>,
    /// When a round of work last took [`SLOW`] or longer.
    slow: Arc<Moment>,
}

impl Default for Backlog {
    fn default() -> Self {
        Backlog {
            since: Instant::now(),
            behind: Arc::default(),
            slow: Arc::default(),
        }
    }
}

/// Milliseconds from the signal's `since` to the last time it was raised, plus one; 0: never.
#[derive(Default)]
struct Moment(AtomicU64);

/// One round of the pipeline's work (a consumer's batch transaction, a relay's claim) that takes
/// this long waited for the database: a COMMIT behind the disk's write load, a row lock held
/// through one. At 1,000 events/s a batch takes a few milliseconds to a few tens.
pub const SLOW: Duration = Duration::from_millis(200);

impl Backlog {
    /// A signal no work has raised yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The work found more waiting than one batch takes.
    pub fn behind(&self) {
        self.raise(&self.behind);
    }

    /// One round of the work took `elapsed`: slow when that is [`SLOW`] or longer. Each delete
    /// retention adds then would add to the write load the pipeline waits behind.
    pub fn took(&self, elapsed: Duration) {
        if elapsed >= SLOW {
            self.raise(&self.slow);
        }
    }

    /// Whether the work was found behind within the last `within`.
    pub fn behind_within(&self, within: Duration) -> bool {
        self.raised_within(&self.behind, within)
    }

    /// Whether a round of the work was slow within the last `within`.
    pub fn slow_within(&self, within: Duration) -> bool {
        self.raised_within(&self.slow, within)
    }

    fn raise(&self, moment: &Moment) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        moment.0.store(ms + 1, Ordering::Relaxed);
    }

    fn raised_within(&self, moment: &Moment, within: Duration) -> bool {
        match moment.0.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let now = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
                now.saturating_sub(at - 1) <= u64::try_from(within.as_millis()).unwrap_or(u64::MAX)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_is_seen_for_as_long_as_asked_then_no_more() {
        let backlog = Backlog::new();
        assert!(!backlog.behind_within(Duration::from_secs(3600)));
        let seen_by = backlog.clone();
        backlog.behind();
        assert!(seen_by.behind_within(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!seen_by.behind_within(Duration::from_millis(20)));
        assert!(seen_by.behind_within(Duration::from_secs(10)));
    }

    #[test]
    fn only_a_slow_round_counts_as_slow_and_slowness_is_not_a_backlog() {
        let backlog = Backlog::new();
        backlog.took(SLOW / 10);
        assert!(!backlog.slow_within(Duration::from_secs(3600)));
        backlog.took(SLOW);
        assert!(backlog.slow_within(Duration::from_secs(1)));
        assert!(!backlog.behind_within(Duration::from_secs(3600)));
        backlog.behind();
        assert!(backlog.behind_within(Duration::from_secs(1)));
    }
}
