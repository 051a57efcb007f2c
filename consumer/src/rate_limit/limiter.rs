//! The token bucket a limited group's partition tasks share: each takes as many tokens as
//! messages its next batch holds before the batch's transaction, waiting for them without
//! blocking the poll thread and giving up when the task is stopped.

use std::num::NonZeroU32;
use std::time::Instant;

use governor::DefaultDirectRateLimiter;
use prometheus::{Counter, IntCounter};
use tokio_util::sync::CancellationToken;

use super::spec::RateLimit;
use crate::metrics::ConsumerMetrics;

/// One group's bucket in this process, counting what it delayed.
pub struct GroupRateLimiter {
    bucket: DefaultDirectRateLimiter,
    burst: NonZeroU32,
    delayed: IntCounter,
    waited: Counter,
}

impl GroupRateLimiter {
    /// The bucket of `limit` for the group whose id (prefix + name) is `group_id`; sets the
    /// group's `consumer_rate_limit_events_per_second`. `None` when the limit is refused by
    /// [`RateLimit::check`] (settings validation refuses it first).
    pub fn new(limit: &RateLimit, metrics: &ConsumerMetrics, group_id: &str) -> Option<Self> {
        let quota = limit.quota()?;
        metrics
            .rate_limit
            .with_label_values(&[group_id])
            .set(limit.events_per_second());
        Some(GroupRateLimiter {
            bucket: DefaultDirectRateLimiter::direct(quota),
            burst: quota.burst_size(),
            delayed: metrics.rate_limit_delayed.with_label_values(&[group_id]),
            waited: metrics.rate_limit_wait.with_label_values(&[group_id]),
        })
    }

    /// The most events one batch of the group may hold: the bucket's size.
    pub fn max_batch(&self) -> usize {
        self.burst.get() as usize
    }

    /// Waits until `events` more may be applied and takes them from the bucket (in steps of at
    /// most its size); false when `stop` is cancelled first. Events that had to wait, and the
    /// time they waited, are counted.
    pub async fn acquire(&self, events: usize, stop: &CancellationToken) -> bool {
        let mut left = events;
        let mut waiting_since: Option<Instant> = None;
        let mut acquired = true;
        while left > 0 {
            let step = left.min(self.max_batch());
            // `step` is between 1 and the bucket's size, so it is a NonZeroU32 that always fits.
            let n =
                NonZeroU32::new(u32::try_from(step).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN);
            if !matches!(self.bucket.check_n(n), Ok(Ok(()))) {
                let _ = waiting_since.get_or_insert_with(Instant::now);
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => {
                        acquired = false;
                        break;
                    }
                    _ = self.bucket.until_n_ready(n) => {}
                }
            }
            left -= step;
        }
        if let Some(since) = waiting_since {
            self.delayed.inc_by(events as u64);
            self.waited.inc_by(since.elapsed().as_secs_f64());
        }
        acquired
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus::Registry;

    use super::*;

    fn limiter(limit: &RateLimit) -> (GroupRateLimiter, ConsumerMetrics) {
        let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
        let limiter = GroupRateLimiter::new(limit, &metrics, "t-inventory").expect("valid");
        (limiter, metrics)
    }

    #[tokio::test]
    async fn batches_take_tokens_at_the_rate_and_count_the_wait() {
        let (limiter, metrics) = limiter(&RateLimit::per_second("inventory", 1_000));
        assert_eq!(limiter.max_batch(), 100);
        let gauge = metrics.rate_limit.with_label_values(&["t-inventory"]).get();
        assert_eq!(gauge, 1_000.0);
        let stop = CancellationToken::new();
        let started = Instant::now();
        // The full bucket goes at once; 1,900 more take 1.9 s at 1,000/s. Long enough that a
        // busy machine's late wake-ups stay within the bounds, short of what taking each
        // batch's tokens twice would take (3.8 s).
        for _ in 0..20 {
            assert!(limiter.acquire(100, &stop).await);
        }
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(1_880) && elapsed < Duration::from_millis(2_600),
            "2,000 events at 1000/s with a bucket of 100 took {elapsed:?}"
        );
        let delayed = metrics
            .rate_limit_delayed
            .with_label_values(&["t-inventory"])
            .get();
        assert_eq!(delayed, 1_900, "the first batch did not wait");
        let waited = metrics
            .rate_limit_wait
            .with_label_values(&["t-inventory"])
            .get();
        assert!((1.8..2.6).contains(&waited), "waited {waited} s");
    }

    #[tokio::test]
    async fn more_events_than_the_bucket_holds_are_taken_in_steps() {
        let (limiter, _) = limiter(&RateLimit::per_second("inventory", 100));
        let stop = CancellationToken::new();
        let started = Instant::now();
        assert!(limiter.acquire(30, &stop).await, "30 > the bucket's 10");
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(180),
            "30 events at 100/s, 10 at once: {elapsed:?}"
        );
    }

    #[tokio::test]
    async fn a_stopped_task_does_not_wait_for_the_bucket() {
        let (limiter, _) = limiter(&RateLimit::per_minute("inventory", 1));
        let stop = CancellationToken::new();
        assert!(limiter.acquire(1, &stop).await, "the bucket starts full");
        let stopping = stop.clone();
        let _stopper = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stopping.cancel();
        });
        let started = Instant::now();
        assert!(!limiter.acquire(1, &stop).await, "stopped while waiting");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
