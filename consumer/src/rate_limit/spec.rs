//! A group's rate limit as written on a command line (`GROUP=N/s`, `GROUP=N/min`) or filled in by
//! a program, and the token bucket it stands for.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

use governor::Quota;

/// Highest limit accepted, in events per second: the bucket's replenish interval (a second over
/// the rate) stays a whole number of microseconds or more.
pub const MAX_EVENTS_PER_SECOND: f64 = 1_000_000.0;

/// The unit of a [`RateLimit`]'s interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RatePeriod {
    /// `N/s`: events per second.
    Second,
    /// `N/min`: events per minute.
    Minute,
}

impl RatePeriod {
    /// The interval's length.
    pub fn duration(self) -> Duration {
        match self {
            RatePeriod::Second => Duration::from_secs(1),
            RatePeriod::Minute => Duration::from_secs(60),
        }
    }

    fn unit(self) -> &'static str {
        match self {
            RatePeriod::Second => "s",
            RatePeriod::Minute => "min",
        }
    }
}

/// A group's cap: at most `events` applied per `per`, in each consumer process that runs the
/// group (see the module's documentation for the rule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// The group, as the program registered it and `groups` names it (without the prefix).
    pub group: String,
    /// Events per interval; zero is refused.
    pub events: u32,
    /// The interval.
    pub per: RatePeriod,
}

/// A rate limit that cannot work, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rate limit `{spec}`: {reason}")]
pub struct InvalidRateLimit {
    /// The limit as given.
    pub spec: String,
    /// Why it is refused.
    pub reason: String,
}

impl RateLimit {
    /// At most `events` a second for `group`.
    pub fn per_second(group: impl Into<String>, events: u32) -> Self {
        RateLimit {
            group: group.into(),
            events,
            per: RatePeriod::Second,
        }
    }

    /// At most `events` a minute for `group`.
    pub fn per_minute(group: impl Into<String>, events: u32) -> Self {
        RateLimit {
            group: group.into(),
            events,
            per: RatePeriod::Minute,
        }
    }

    /// The limit in events per second.
    pub fn events_per_second(&self) -> f64 {
        f64::from(self.events) / self.per.duration().as_secs_f64()
    }

    /// The rate without the group, as written after `=`: `200/s`, `30/min`.
    pub fn rate(&self) -> String {
        format!("{}/{}", self.events, self.per.unit())
    }

    /// The bucket's size: a tenth of a second's events, at least one. It is also the largest
    /// batch a limited group applies, so no second applies more than 1.1 times the limit.
    pub fn burst(&self) -> NonZeroU32 {
        let tenth = self.events_per_second() / 10.0;
        // At most 100,000 (a tenth of MAX_EVENTS_PER_SECOND) once checked; `as` saturates.
        NonZeroU32::new(tenth.floor() as u32).unwrap_or(NonZeroU32::MIN)
    }

    /// The token bucket: one event every second / rate, holding [`RateLimit::burst`] events.
    /// `None` when [`RateLimit::check`] refuses the limit.
    pub fn quota(&self) -> Option<Quota> {
        self.check().ok()?;
        let interval = self.per.duration() / self.events;
        Some(Quota::with_period(interval)?.allow_burst(self.burst()))
    }

    /// Refuses a limit that cannot work: no group, zero events, or above
    /// [`MAX_EVENTS_PER_SECOND`].
    pub fn check(&self) -> Result<(), InvalidRateLimit> {
        let refuse = |reason: &str| {
            Err(InvalidRateLimit {
                spec: self.to_string(),
                reason: reason.to_owned(),
            })
        };
        if self.group.trim().is_empty() {
            return refuse("names no group: write GROUP=N/s or GROUP=N/min");
        }
        if self.events == 0 {
            return refuse(
                "a limit of zero would apply nothing; to run the group without a limit, give it \
                 none",
            );
        }
        if self.events_per_second() > MAX_EVENTS_PER_SECOND {
            return refuse("above 1000000/s; to run the group without a limit, give it none");
        }
        Ok(())
    }
}

impl fmt::Display for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.group, self.rate())
    }
}

impl FromStr for RateLimit {
    type Err = InvalidRateLimit;

    /// `GROUP=N/s` or `GROUP=N/min`, N a whole number from 1.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let refuse = |reason: String| InvalidRateLimit {
            spec: spec.to_owned(),
            reason,
        };
        let (group, rate) = spec
            .split_once('=')
            .ok_or_else(|| refuse("write GROUP=N/s or GROUP=N/min".to_owned()))?;
        let (events, unit) = rate.trim().split_once('/').ok_or_else(|| {
            refuse(format!(
                "`{}` has no unit: write {0}/s or {0}/min",
                rate.trim()
            ))
        })?;
        let per = match unit.trim() {
            "s" => RatePeriod::Second,
            "min" => RatePeriod::Minute,
            other => {
                return Err(refuse(format!(
                    "unknown unit `{other}`: write N/s (per second) or N/min (per minute)"
                )))
            }
        };
        let events = events.trim();
        let events: u32 = match events.parse::<i64>() {
            Ok(n) if n < 0 => return Err(refuse("a limit cannot be negative".to_owned())),
            Ok(n) => u32::try_from(n)
                .map_err(|_| refuse(format!("{n} events is too many for a limit")))?,
            Err(_) => {
                return Err(refuse(format!(
                    "`{events}` is not a whole number of events"
                )))
            }
        };
        let limit = RateLimit {
            group: group.trim().to_owned(),
            events,
            per,
        };
        limit.check().map_err(|e| refuse(e.reason))?;
        Ok(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_second_and_per_minute_limits_parse() {
        let limit: RateLimit = "inventory=200/s".parse().expect("parses");
        assert_eq!(limit, RateLimit::per_second("inventory", 200));
        assert_eq!(limit.events_per_second(), 200.0);
        assert_eq!(limit.burst().get(), 20);
        assert_eq!(limit.to_string(), "inventory=200/s");
        let limit: RateLimit = " notification = 30 / min ".parse().expect("parses");
        assert_eq!(limit, RateLimit::per_minute("notification", 30));
        assert_eq!(limit.events_per_second(), 0.5);
        assert_eq!(limit.burst().get(), 1, "at least one event");
        assert_eq!(limit.rate(), "30/min");
    }

    #[test]
    fn the_bucket_refills_at_the_rate_and_holds_a_tenth_of_a_second() {
        let quota = RateLimit::per_second("g", 200).quota().expect("quota");
        assert_eq!(quota.replenish_interval(), Duration::from_millis(5));
        assert_eq!(quota.burst_size().get(), 20);
        let quota = RateLimit::per_minute("g", 120).quota().expect("quota");
        assert_eq!(quota.replenish_interval(), Duration::from_millis(500));
        assert_eq!(quota.burst_size().get(), 1);
        assert!(RateLimit::per_second("g", 0).quota().is_none());
    }

    #[test]
    fn bad_limits_are_refused_with_the_reason() {
        let refused = |spec: &str, reason: &str| {
            let error = spec.parse::<RateLimit>().expect_err(spec).to_string();
            assert!(error.contains(spec), "{error}");
            assert!(error.contains(reason), "{spec}: {error}");
        };
        refused("inventory=0/s", "zero");
        refused("inventory=0/min", "zero");
        refused("inventory=-5/s", "negative");
        refused("inventory=1.5/s", "whole number");
        refused("inventory=fast/s", "whole number");
        refused("inventory=200", "no unit");
        refused("inventory=200/h", "unknown unit `h`");
        refused("inventory=200/sec", "unknown unit `sec`");
        refused("inventory", "GROUP=N/s");
        refused("=200/s", "names no group");
        refused("inventory=5000000/s", "above 1000000/s");
        refused("inventory=99999999999/s", "too many");
    }
}
