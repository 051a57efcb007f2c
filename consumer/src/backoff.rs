//! How long to wait before the next attempt: exponential from a base, capped, with equal jitter
//! (half fixed, half random) so that tasks failing together do not retry together. Used by the
//! partition tasks' batch retries, and by tasks a program runs beside its groups.

use std::time::Duration;

use rand::Rng;

/// The wait before attempt `attempt + 1`, after `attempt` failed ones (1 or more).
pub fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    let nominal = base
        .saturating_mul(2u32.saturating_pow(attempt.min(20).saturating_sub(1)))
        .min(max);
    let half = nominal / 2;
    half + Duration::from_millis(rand::rng().random_range(0..=half.as_millis().max(1) as u64))
}
