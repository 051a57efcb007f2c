//! Rate limits: a group may cap how many events it applies per second or per minute
//! (`ConsumerSettings::rate_limits`, `--rate-limit GROUP=N/s`), so that it does not overrun what
//! its effects call on. The events wait in Kafka: the group's lag grows instead of anything
//! failing.
//!
//! The rule: the limit holds in each consumer process that runs the group, for all of that
//! process's partitions of it together; a group with M members applies at most M × N. Each
//! process's bucket (a GCRA token bucket, `governor`) refills at the rate and holds a tenth of a
//! second's events, at least one. A partition task takes as many tokens as messages its next
//! batch holds, before the batch's transaction starts, and a limited group's batches hold at most
//! the bucket's size; every message counts, redeliveries too, and a batch retried after a failure
//! pays once. Batches stay in offset order and only start later, so exactly once and order per
//! aggregate are untouched. The wait is the partition task's (the poll thread keeps polling and
//! heartbeating, and pauses the partition once enough is queued), and a revoke or shutdown ends
//! it.
//!
//! Seen from outside: `consumer_rate_limit_*` metrics ([`crate::metrics`]), and the
//! `group_rate_limit` table, where each process writes its group's limit at start (and a process
//! without one removes it), for `pipeline status`.
//!
//! - `spec`: [`RateLimit`], as written (`GROUP=N/s`, `GROUP=N/min`) and checked;
//! - `limiter`: [`GroupRateLimiter`], the bucket the partition tasks share.

mod limiter;
mod spec;

pub use limiter::GroupRateLimiter;
pub use spec::{InvalidRateLimit, RateLimit, RatePeriod, MAX_EVENTS_PER_SECOND};

use sqlx::PgPool;

/// Records the limit the group whose id is `group_id` runs with in this process
/// (`group_rate_limit`), or removes it when it runs without one, for `pipeline status`.
pub async fn record(pool: &PgPool, group_id: &str, limit: Option<&RateLimit>) -> sqlx::Result<()> {
    match limit {
        Some(limit) => {
            let burst = i32::try_from(limit.burst().get()).unwrap_or(i32::MAX);
            sqlx::query(
                "INSERT INTO group_rate_limit (group_name, rate, events_per_second, burst, updated_at)
                 VALUES ($1, $2, $3, $4, clock_timestamp())
                 ON CONFLICT (group_name) DO UPDATE
                 SET rate = EXCLUDED.rate, events_per_second = EXCLUDED.events_per_second,
                     burst = EXCLUDED.burst, updated_at = EXCLUDED.updated_at",
            )
            .bind(group_id)
            .bind(limit.rate())
            .bind(limit.events_per_second())
            .bind(burst)
            .execute(pool)
            .await?;
        }
        None => {
            let _ = sqlx::query("DELETE FROM group_rate_limit WHERE group_name = $1")
                .bind(group_id)
                .execute(pool)
                .await?;
        }
    }
    Ok(())
}
