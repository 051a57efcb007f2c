//! The open-loop timetable: slot `i` is due at `start + i / rate` whatever the service's speed, so
//! a stall shows as latency instead of hiding in a slower send rate (no coordinated omission).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// When each slot of a run is due.
#[derive(Debug, Clone)]
pub struct Timetable {
    start: Instant,
    /// `start` on the wall clock, µs since the Unix epoch.
    start_unix_us: i64,
    /// Slots per second; 0: every slot is due at once.
    rate: f64,
    /// Slots in the run, when it has a set number.
    slots: Option<u64>,
    /// How far behind its timetable the run may fall before the slots it missed are dropped
    /// rather than sent in a burst; `None`: never dropped.
    max_catch_up: Option<Duration>,
    /// How far the timetable has moved back after stalls, so far.
    shift: Duration,
}

impl Timetable {
    /// `slots` at `rate` per second, the first due `lead` from now.
    pub(crate) fn new(
        rate: f64,
        slots: Option<u64>,
        max_catch_up: Option<Duration>,
        lead: Duration,
    ) -> Timetable {
        let start = Instant::now() + lead;
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            + lead;
        Timetable {
            start,
            start_unix_us: i64::try_from(unix.as_micros()).unwrap_or(i64::MAX),
            rate,
            slots,
            max_catch_up,
            shift: Duration::ZERO,
        }
    }

    /// When the first slot is due.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// When slot `slot` is due, as planned (before any move after a stall).
    pub fn due(&self, slot: u64) -> Instant {
        if self.rate > 0.0 {
            self.start + Duration::from_secs_f64(slot as f64 / self.rate)
        } else {
            self.start
        }
    }

    /// Slots in the run, when it has a set number.
    pub fn slots(&self) -> Option<u64> {
        self.slots
    }

    /// When the last slot is due, for a run with a set number of slots.
    pub fn last_due(&self) -> Option<Instant> {
        self.slots.map(|n| self.due(n.saturating_sub(1)))
    }

    /// `at` on the wall clock, µs since the Unix epoch.
    pub fn unix_micros(&self, at: Instant) -> i64 {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        if at >= self.start {
            self.start_unix_us + micros(at - self.start)
        } else {
            self.start_unix_us - micros(self.start - at)
        }
    }

    /// When slot `slot` is due now: as planned, unless the run is further behind than it may
    /// catch up; then the rest of the timetable moves back so the slot is due that far behind.
    pub(crate) fn next_due(&mut self, slot: u64) -> Instant {
        let due = self.due(slot) + self.shift;
        let Some(floor) = self
            .max_catch_up
            .and_then(|m| Instant::now().checked_sub(m))
        else {
            return due;
        };
        if due < floor {
            self.shift += floor - due;
            return floor;
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_due_at_the_rate() {
        let s = Timetable::new(100.0, Some(1_000), None, Duration::ZERO);
        assert_eq!(s.due(100) - s.due(0), Duration::from_secs(1));
        assert_eq!(s.last_due(), Some(s.due(999)));
        let unpaced = Timetable::new(0.0, None, None, Duration::ZERO);
        assert_eq!(unpaced.due(1_000), unpaced.start());
        assert_eq!(unpaced.last_due(), None);
    }

    #[test]
    fn wall_clock_times_follow_the_timetable() {
        let s = Timetable::new(10.0, None, None, Duration::ZERO);
        assert_eq!(s.unix_micros(s.due(5)) - s.unix_micros(s.due(0)), 500_000);
        assert_eq!(
            s.unix_micros(s.start()) - s.unix_micros(s.start() - Duration::from_millis(1)),
            1_000
        );
    }

    #[tokio::test]
    async fn after_a_stall_missed_slots_are_dropped_only_with_a_catch_up_limit() {
        let mut bursting = Timetable::new(1_000.0, None, None, Duration::from_millis(20));
        let mut dropping = Timetable::new(
            1_000.0,
            None,
            Some(Duration::from_millis(10)),
            Duration::from_millis(20),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        // 80 ms behind: the first sends slot 0 now, late; the second moves its timetable back.
        assert_eq!(bursting.next_due(0), bursting.start());
        let moved = dropping.next_due(0);
        assert!(
            moved > dropping.start() + Duration::from_millis(60),
            "{moved:?}"
        );
        assert!(dropping.next_due(1) >= moved + Duration::from_millis(1));
    }
}
