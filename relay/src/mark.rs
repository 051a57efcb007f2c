//! Recording what happened to a batch: published with its partition and offset, or a failed
//! attempt with its backoff.

use std::time::Duration;

use sqlx::PgPool;

use crate::lease::Fence;

/// Why a batch's outcome was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum MarkError {
    /// The lease's epoch is no longer the relay's (it expired, or another relay took it over):
    /// nothing was written, and the events stay queued for the lease's holder.
    #[error("relay lease epoch {0} is lost: this relay's writes are refused")]
    LeaseLost(i64),
    /// The statement failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// An event Kafka acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The outbox row's id.
    pub id: i64,
    /// The partition Kafka wrote it to.
    pub partition: i32,
    /// Its offset there; `None` when Kafka confirmed the write without one (the idempotent
    /// producer's answer to a retry of a message the broker already held).
    pub offset: Option<i64>,
}

impl Published {
    /// The event `id` as a delivery report gave it: an offset below zero (librdkafka's
    /// `RD_KAFKA_OFFSET_INVALID`, -1001, for a write confirmed without its offset) is no
    /// position, and is recorded as unknown.
    pub fn reported(id: i64, partition: i32, offset: i64) -> Published {
        Published {
            id,
            partition,
            offset: (offset >= 0).then_some(offset),
        }
    }
}

/// An event whose attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedAttempt {
    /// The outbox row's id.
    pub id: i64,
    /// What failed.
    pub error: String,
    /// Retry after this long.
    pub retry_in: Duration,
    /// No more attempts: the row becomes `failed` and holds its aggregate's later events.
    pub give_up: bool,
}

/// Marks the whole batch published in one statement: the events leave the relay's queue and their
/// partition and offset are recorded. The outbox rows themselves are not rewritten. An event no
/// longer queued (already marked) is left as it is. The statement share-locks the lease row at
/// `fence`'s epoch and writes nothing when that epoch is gone ([`MarkError::LeaseLost`]).
pub async fn mark_published(
    pool: &PgPool,
    fence: Fence,
    published: &[Published],
) -> Result<u64, MarkError> {
    if published.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = published.iter().map(|p| p.id).collect();
    let partitions: Vec<i32> = published.iter().map(|p| p.partition).collect();
    let offsets: Vec<Option<i64>> = published.iter().map(|p| p.offset).collect();
    let (held, marked): (bool, i64) = sqlx::query_as(
        "WITH lease AS (SELECT epoch FROM relay_lease WHERE lease_key = $4 AND epoch = $5 FOR KEY SHARE),
              d AS (SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[])
                        AS d(id, kafka_partition, kafka_offset)),
              sent AS (DELETE FROM outbox_unpublished u USING d
                       WHERE u.id = d.id AND EXISTS (SELECT 1 FROM lease)
                       RETURNING u.id, u.attempts),
              ins AS (INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts, published_at)
                      SELECT sent.id, d.kafka_partition, d.kafka_offset, sent.attempts + 1, now()
                      FROM sent JOIN d ON d.id = sent.id
                      RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM lease), (SELECT count(*) FROM ins)",
    )
    .bind(&ids)
    .bind(&partitions)
    .bind(&offsets)
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .fetch_one(pool)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(marked as u64)
}

/// Records failed attempts: attempts counted, last error and next attempt time set, and the row
/// marked `failed` when no attempt is left. Each attempt is also kept in the event's history
/// (`outbox_attempt`), by the same statement. Fenced like [`mark_published`].
pub async fn record_failures(
    pool: &PgPool,
    fence: Fence,
    failures: &[FailedAttempt],
) -> Result<u64, MarkError> {
    if failures.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
    let errors: Vec<String> = failures.iter().map(|f| f.error.clone()).collect();
    let delays_ms: Vec<i64> = failures
        .iter()
        .map(|f| i64::try_from(f.retry_in.as_millis()).unwrap_or(i64::MAX))
        .collect();
    let give_up: Vec<bool> = failures.iter().map(|f| f.give_up).collect();
    let (held, recorded): (bool, i64) = sqlx::query_as(
        "WITH lease AS (SELECT epoch FROM relay_lease WHERE lease_key = $5 AND epoch = $6 FOR KEY SHARE),
              upd AS (UPDATE outbox_unpublished o
                      SET attempts = o.attempts + 1, last_attempt_at = now(),
                          last_error = d.error,
                          next_attempt_at = now() + d.delay_ms * interval '1 millisecond',
                          state = CASE WHEN d.give_up THEN 'failed' ELSE o.state END
                      FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bool[])
                           AS d(id, error, delay_ms, give_up)
                      WHERE o.id = d.id AND o.state = 'pending' AND EXISTS (SELECT 1 FROM lease)
                      RETURNING o.id, o.attempts, o.state, d.error),
              history AS (INSERT INTO outbox_attempt (event, attempt, error, gave_up, relay_epoch)
                          SELECT id, attempts, error, state = 'failed', $6 FROM upd
                          RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM lease), (SELECT count(*) FROM history)",
    )
    .bind(&ids)
    .bind(&errors)
    .bind(&delays_ms)
    .bind(&give_up)
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .fetch_one(pool)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(recorded as u64)
}

/// Puts events read from the write-ahead log into the relay's queue, pending: those Kafka did not
/// take (their failed attempt is then recorded by [`record_failures`]) and those held behind
/// them. The queue's claim publishes them with its retries, in each aggregate's order. An event
/// already queued is left as it is. Fenced like [`mark_published`].
pub async fn queue_streamed(pool: &PgPool, fence: Fence, ids: &[i64]) -> Result<u64, MarkError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let (held, queued): (bool, i64) = sqlx::query_as(
        "WITH lease AS (SELECT epoch FROM relay_lease WHERE lease_key = $2 AND epoch = $3 FOR KEY SHARE),
              ins AS (INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
                      SELECT o.id, o.aggregate_id, o.sequence, o.created_at
                      FROM outbox o
                      WHERE o.id = ANY ($1::bigint[]) AND EXISTS (SELECT 1 FROM lease)
                        AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
                      ON CONFLICT (id) DO NOTHING
                      RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM lease), (SELECT count(*) FROM ins)",
    )
    .bind(ids)
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .fetch_one(pool)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(queued as u64)
}
