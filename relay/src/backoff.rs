//! Retry timing for failed publish attempts: exponential with jitter, then slower retries after
//! a threshold, and a bounded number of attempts for errors that cannot heal by themselves.

use std::time::Duration;

use rand::Rng;

/// How failed attempts are retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Delay after the first failed attempt.
    pub base: Duration,
    /// Longest delay of the exponential phase.
    pub max: Duration,
    /// After this many attempts, retries slow down to `slow_interval`.
    pub slow_after: i32,
    /// Delay between retries once past `slow_after`.
    pub slow_interval: Duration,
    /// Attempts allowed for a permanent error before the row is marked failed.
    pub max_attempts: i32,
}

impl RetryPolicy {
    /// Delay before the next attempt, given the attempts made so far including the failed one.
    pub fn delay(&self, attempts: i32) -> Duration {
        let nominal = if attempts > self.slow_after {
            self.slow_interval
        } else {
            let exp = u32::try_from(attempts.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
            self.base
                .saturating_mul(2u32.saturating_pow(exp))
                .min(self.max)
        };
        // Equal jitter: half fixed, half random, so relays retrying together spread out.
        let half = nominal / 2;
        let jitter = rand::rng().random_range(0..=half.as_millis().max(1) as u64);
        half + Duration::from_millis(jitter)
    }

    /// Whether a row that failed `attempts` times with a permanent error should stop retrying.
    pub fn gives_up(&self, attempts: i32, permanent: bool) -> bool {
        permanent && attempts >= self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(100),
            max: Duration::from_secs(10),
            slow_after: 5,
            slow_interval: Duration::from_secs(60),
            max_attempts: 3,
        }
    }

    #[test]
    fn grows_exponentially_within_jitter_bounds() {
        let p = policy();
        for (attempts, nominal_ms) in [(1, 100), (2, 200), (3, 400), (5, 1600)] {
            let d = p.delay(attempts).as_millis() as u64;
            assert!(
                (nominal_ms / 2..=nominal_ms).contains(&d),
                "attempt {attempts}: {d} ms"
            );
        }
        assert!(p.delay(6) >= Duration::from_secs(30), "slow phase");
    }

    #[test]
    fn only_permanent_errors_give_up() {
        let p = policy();
        assert!(!p.gives_up(100, false));
        assert!(!p.gives_up(2, true));
        assert!(p.gives_up(3, true));
    }
}
