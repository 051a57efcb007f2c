//! When a schedule fires: its cron expression (the `cron` crate) read on the wall clock of its
//! time zone (`chrono-tz`), with daylight saving handled as Vixie cron does:
//!
//! - a wall-clock time that happens twice (clocks go back) fires once, at its first instant;
//! - a wall-clock time that does not happen (clocks go forward) fires at the first instant after
//!   the jump (02:30 on the night 02:00 becomes 03:00 fires at 03:00).
//!
//! The expression is evaluated on the zone's wall clock as if it had no transitions, and each
//! wall-clock time found is then placed on the real time line.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, LocalResult, NaiveDateTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;

use super::ScheduleError;

/// A parsed cron expression in its time zone.
#[derive(Debug, Clone)]
pub struct CronTimes {
    schedule: cron::Schedule,
    tz: Tz,
}

impl CronTimes {
    /// Parses `expression` (six fields, seconds first, or the usual five) in `time_zone`.
    pub fn parse(expression: &str, time_zone: &str) -> Result<Self, ScheduleError> {
        let tz = Tz::from_str(time_zone.trim())
            .map_err(|_| ScheduleError::InvalidTimeZone(time_zone.to_owned()))?;
        let fields = expression.split_whitespace().count();
        let full = match fields {
            5 => format!("0 {}", expression.trim()),
            6 | 7 => expression.trim().to_owned(),
            _ => {
                return Err(ScheduleError::InvalidCron {
                    expression: expression.to_owned(),
                    reason: format!(
                    "{fields} fields; five (minute hour day month weekday) or six (seconds first)"
                ),
                })
            }
        };
        let schedule = cron::Schedule::from_str(&full).map_err(|e| ScheduleError::InvalidCron {
            expression: expression.to_owned(),
            reason: e.to_string().replace('\n', " "),
        })?;
        Ok(CronTimes { schedule, tz })
    }

    /// The time zone.
    pub fn time_zone(&self) -> Tz {
        self.tz
    }

    /// Occurrences strictly after `after`, in order.
    pub fn after(&self, after: DateTime<Utc>) -> impl Iterator<Item = DateTime<Utc>> + '_ {
        let wall = after.with_timezone(&self.tz).naive_local();
        let mut last = after;
        self.schedule
            .after(&Utc.from_utc_datetime(&wall))
            .map(|w| self.place(w.naive_utc()))
            .filter(move |t| {
                // A time placed at or before the last (the second pass of an hour that repeats,
                // or a skipped time moved onto one that exists) is not a new occurrence.
                let new = *t > last;
                if new {
                    last = *t;
                }
                new
            })
    }

    /// The wall-clock time `wall` on the real time line: its first instant when it happens twice,
    /// the first instant after the jump when it does not happen.
    fn place(&self, wall: NaiveDateTime) -> DateTime<Utc> {
        let mut probe = wall;
        // A jump forward is an hour (at most two in a few zones' history); look minute by minute.
        for _ in 0..=180 {
            match self.tz.from_local_datetime(&probe) {
                LocalResult::Single(t) => return t.with_timezone(&Utc),
                LocalResult::Ambiguous(first, _) => return first.with_timezone(&Utc),
                LocalResult::None => {
                    probe = (probe + chrono::Duration::minutes(1))
                        .with_second(0)
                        .unwrap_or(probe + chrono::Duration::minutes(1));
                }
            }
        }
        Utc.from_utc_datetime(&wall)
    }

    /// The wall-clock time of `at` in the schedule's zone, e.g. `2026-11-26 09:00:00 CET`.
    pub fn local(&self, at: DateTime<Utc>) -> String {
        at.with_timezone(&self.tz)
            .format("%Y-%m-%d %H:%M:%S %Z")
            .to_string()
    }

    /// The shortest gap between the next `n` occurrences after `from` (None if it fires fewer
    /// than two times).
    pub fn shortest_gap(&self, from: DateTime<Utc>, n: usize) -> Option<Duration> {
        let times: Vec<DateTime<Utc>> = self.after(from).take(n).collect();
        times
            .windows(2)
            .filter_map(|w| (w[1] - w[0]).to_std().ok())
            .min()
    }
}

/// The next `n` fire times of `expression` in `time_zone` after `after`.
pub fn fire_times(
    expression: &str,
    time_zone: &str,
    after: DateTime<Utc>,
    n: usize,
) -> Result<Vec<DateTime<Utc>>, ScheduleError> {
    Ok(CronTimes::parse(expression, time_zone)?
        .after(after)
        .take(n)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn berlin(y: i32, m: u32, d: u32, h: u32, min: u32) -> DateTime<Utc> {
        chrono_tz::Europe::Berlin
            .with_ymd_and_hms(y, m, d, h, min, 0)
            .earliest()
            .expect("a Berlin time")
            .with_timezone(&Utc)
    }

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().expect("RFC 3339")
    }

    #[test]
    fn five_and_six_fields_and_bad_input() {
        let five = CronTimes::parse("0 9 * * *", "UTC").expect("five fields");
        let six = CronTimes::parse("0 0 9 * * *", "UTC").expect("six fields");
        let from = utc("2026-11-26T10:00:00Z");
        assert_eq!(five.after(from).next(), Some(utc("2026-11-27T09:00:00Z")));
        assert_eq!(six.after(from).next(), five.after(from).next());
        assert!(matches!(
            CronTimes::parse("0 9 * *", "UTC"),
            Err(ScheduleError::InvalidCron { .. })
        ));
        assert!(matches!(
            CronTimes::parse("0 61 * * *", "UTC"),
            Err(ScheduleError::InvalidCron { .. })
        ));
        assert!(matches!(
            CronTimes::parse("0 9 * * *", "Mars/Olympus"),
            Err(ScheduleError::InvalidTimeZone(_))
        ));
    }

    #[test]
    fn a_wall_clock_time_that_repeats_fires_once() {
        // Berlin, 25 Oct 2026: 03:00 CEST becomes 02:00 CET; 02:30 happens twice.
        let t = CronTimes::parse("30 2 * * *", "Europe/Berlin").expect("parse");
        let got: Vec<_> = t.after(berlin(2026, 10, 24, 12, 0)).take(3).collect();
        assert_eq!(
            got,
            vec![
                utc("2026-10-25T00:30:00Z"), // 02:30 CEST, the first pass
                utc("2026-10-26T01:30:00Z"), // 02:30 CET the next day
                utc("2026-10-27T01:30:00Z"),
            ]
        );
        // An hourly schedule fires once in the repeated hour too.
        let hourly = CronTimes::parse("0 * * * *", "Europe/Berlin").expect("parse");
        let got: Vec<_> = hourly.after(utc("2026-10-24T22:30:00Z")).take(4).collect();
        assert_eq!(
            got,
            vec![
                utc("2026-10-24T23:00:00Z"), // 01:00 CEST
                utc("2026-10-25T00:00:00Z"), // 02:00 CEST
                utc("2026-10-25T02:00:00Z"), // 03:00 CET (02:00 CET is the repeat)
                utc("2026-10-25T03:00:00Z"),
            ]
        );
    }

    #[test]
    fn a_wall_clock_time_that_does_not_happen_fires_after_the_jump() {
        // Berlin, 29 Mar 2026: 02:00 CET becomes 03:00 CEST; 02:30 does not happen.
        let t = CronTimes::parse("30 2 * * *", "Europe/Berlin").expect("parse");
        let got: Vec<_> = t.after(berlin(2026, 3, 28, 12, 0)).take(3).collect();
        assert_eq!(
            got,
            vec![
                utc("2026-03-29T01:00:00Z"), // 03:00 CEST, right after the jump
                utc("2026-03-30T00:30:00Z"), // 02:30 CEST
                utc("2026-03-31T00:30:00Z"),
            ]
        );
    }

    #[test]
    fn the_shortest_gap_between_occurrences() {
        let every3 = CronTimes::parse("*/3 * * * * *", "UTC").expect("parse");
        assert_eq!(
            every3.shortest_gap(utc("2026-11-26T10:00:00Z"), 50),
            Some(Duration::from_secs(3))
        );
        let weekdays = CronTimes::parse("0 9 * * 1-5", "UTC").expect("parse");
        assert_eq!(
            weekdays.shortest_gap(utc("2026-11-26T10:00:00Z"), 20),
            Some(Duration::from_secs(86_400))
        );
    }
}
