//! The release step: the active relay releases delayed events that are due, moving them from
//! `outbox_delayed` into the outbox, where the claim finds them like any other event.
//!
//! The claim itself never reads the delayed events, so events waiting far ahead cost it
//! nothing; the release reads the head of the due-time index and stops at the first event not
//! due yet.

use std::time::{Duration, Instant};

use outbox::{Outbox, OUTBOX_CHANNEL};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::lease::{Fence, Lease};
use crate::mark::MarkError;
use crate::metrics::RelayMetrics;
use crate::schedule::materialise_step;

/// What a release did, and when the next schedule occurrence falls due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Delayed events moved into the outbox.
    pub events: u64,
    /// How long until the earliest `next_fire_at` of an enabled recurring schedule, by the
    /// database's clock (zero when one is due; `None`: no schedule).
    pub next_fire_in: Option<Duration>,
}

/// Releases up to `limit` due delayed events into the outbox in one statement, oldest due first,
/// and returns how many it released, with the time the next schedule occurrence falls due.
///
/// Each event takes the next sequence number of its aggregate at this moment (the same row lock
/// as `outbox::enqueue`, taken in aggregate order so that concurrent writers cannot deadlock),
/// so it is published after every event its aggregate committed before. Its Kafka headers gain
/// `delayed-at` and `publish-at`. An event whose (business key, event type) reached the
/// outbox another way meanwhile is dropped as the duplicate it is. Fenced like the relay's
/// other writes: nothing moves unless `fence`'s epoch still holds the lease
/// ([`MarkError::LeaseLost`]). A listening relay is woken when something moved.
pub async fn release_due(pool: &PgPool, fence: Fence, limit: i64) -> Result<Released, MarkError> {
    // The planner takes the due rows for a handful (the statistics see them in the future) and
    // would join the statement's steps by nested loops, whose cost grows with the square of the
    // batch. Every index lookup the statement needs is written so that it is not a join, so
    // nested loops can be ruled out for this transaction; planned on every execution, like the
    // claim.
    let mut tx = pool.begin().await?;
    let _ = sqlx::query("SET LOCAL enable_nestloop = off")
        .execute(&mut *tx)
        .await?;
    let (held, released, next_fire_in): (bool, i64, Option<f64>) = sqlx::query_as(RELEASE_SQL)
        .persistent(false)
        .bind(limit)
        .bind(fence.lock_key)
        .bind(fence.epoch)
        .fetch_one(&mut *tx)
        .await?;
    if released > 0 {
        // Delivered at commit: wakes a relay waiting for work (this one's claim loop, if it
        // listens).
        let _ = sqlx::query("SELECT pg_notify($1, '')")
            .bind(OUTBOX_CHANNEL)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(Released {
        events: released as u64,
        next_fire_in: next_fire_in.map(|s| Duration::from_secs_f64(s.clamp(0.0, 1e9))),
    })
}

/// `$1` the most events to release, `$2`/`$3` the lease key and epoch.
const RELEASE_SQL: &str = "WITH lease AS (
         SELECT epoch FROM relay_lease WHERE lease_key = $2 AND epoch = $3 FOR KEY SHARE),
     due AS (
         SELECT event_id FROM outbox_delayed
         WHERE publish_at <= now() AND EXISTS (SELECT 1 FROM lease)
         ORDER BY publish_at, event_id
         LIMIT $1
         FOR UPDATE SKIP LOCKED),
     taken AS (
         DELETE FROM outbox_delayed s WHERE s.event_id = ANY (ARRAY(SELECT event_id FROM due))
         RETURNING s.*),
     fresh AS (
         SELECT * FROM taken t
         WHERE (SELECT count(*) FROM outbox o
                WHERE o.business_key = t.business_key AND o.event_type = t.event_type) = 0),
     counts AS (
         SELECT aggregate_id, count(*) AS events FROM fresh
         GROUP BY aggregate_id ORDER BY aggregate_id),
     next AS (
         INSERT INTO outbox_sequence AS q (aggregate_id, last_sequence)
         SELECT aggregate_id, events FROM counts
         ON CONFLICT (aggregate_id)
         DO UPDATE SET last_sequence = q.last_sequence + EXCLUDED.last_sequence
         RETURNING aggregate_id, last_sequence),
     moved AS (
         INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload, headers)
         SELECT f.event_id, f.business_key, f.event_type, f.aggregate_id,
                next.last_sequence - c.events
                    + row_number() OVER (PARTITION BY f.aggregate_id
                                         ORDER BY f.publish_at, f.event_id),
                f.topic, f.payload,
                f.headers || jsonb_build_object(
                    'delayed-at', to_char(f.delayed_at AT TIME ZONE 'UTC',
                                            'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                    'publish-at', to_char(f.publish_at AT TIME ZONE 'UTC',
                                          'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))
         FROM fresh f JOIN counts c USING (aggregate_id) JOIN next USING (aggregate_id)
         ORDER BY f.publish_at, f.event_id
         RETURNING 1)
 SELECT EXISTS (SELECT 1 FROM lease), (SELECT count(*) FROM moved),
        (SELECT EXTRACT(EPOCH FROM min(next_fire_at) - clock_timestamp())::float8
         FROM outbox_schedule WHERE enabled)";

/// While `lease` is held and until `stop`: every `every`, materialises the due occurrences of
/// recurring schedules ([`materialise_step`]) when one is due (as the previous release saw the
/// schedules), then releases due delayed events, at once again while a release finds a full
/// batch (`limit`).
pub async fn release_while_active(
    pool: PgPool,
    lease: Lease,
    limit: i64,
    every: Duration,
    metrics: RelayMetrics,
    stop: CancellationToken,
) {
    let lost = lease.lost().clone();
    // When the next schedule occurrence falls due (`None`: no schedule), as the last release saw
    // the schedules; unknown until the first.
    let mut schedule_due: Option<Option<Instant>> = None;
    loop {
        if stop.is_cancelled() || !lease.is_live() {
            return;
        }
        let materialise = match schedule_due {
            None => true,
            Some(due) => due.is_some_and(|at| at <= Instant::now()),
        };
        if materialise {
            match materialise_step(&pool, &Outbox::default(), lease.fence()).await {
                Ok(done) => {
                    for m in done {
                        metrics
                            .schedule_occurrences
                            .with_label_values(&["fired"])
                            .inc_by(m.fired.len() as u64);
                        metrics
                            .schedule_occurrences
                            .with_label_values(&["skipped"])
                            .inc_by(m.skipped as u64);
                    }
                }
                Err(MarkError::LeaseLost(epoch)) => {
                    tracing::warn!(epoch, "materialising schedules refused: lease lost");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "materialising schedules failed; retrying"),
            }
        }
        let wait = match release_due(&pool, lease.fence(), limit).await {
            Ok(Released {
                events: n,
                next_fire_in,
            }) => {
                schedule_due = Some(next_fire_in.map(|d| Instant::now() + d));
                metrics.delayed_released.inc_by(n);
                if n as i64 >= limit {
                    Duration::ZERO
                } else {
                    every
                }
            }
            Err(MarkError::LeaseLost(epoch)) => {
                tracing::warn!(epoch, "releasing delayed events refused: lease lost");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "releasing delayed events failed; retrying");
                every.max(Duration::from_secs(1))
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = lost.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
