//! Recording what happened to a batch: published with its partition and offset, or a failed
//! attempt with its backoff.

use std::time::Duration;

use sqlx::PgPool;

/// An event Kafka acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub id: i64,
    pub partition: i32,
    pub offset: i64,
}

/// An event whose attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedAttempt {
    pub id: i64,
    pub error: String,
    /// Retry after this long.
    pub retry_in: Duration,
    /// No more attempts: the row becomes `failed` and holds its aggregate's later events.
    pub give_up: bool,
}

/// Marks the whole batch published in one statement: the events leave the relay's queue and their
/// partition and offset are recorded. The outbox rows themselves are not rewritten. An event no
/// longer queued (already marked) is left as it is.
pub async fn mark_published(pool: &PgPool, published: &[Published]) -> Result<u64, sqlx::Error> {
    if published.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = published.iter().map(|p| p.id).collect();
    let partitions: Vec<i32> = published.iter().map(|p| p.partition).collect();
    let offsets: Vec<i64> = published.iter().map(|p| p.offset).collect();
    let result = sqlx::query(
        "WITH d AS (SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[])
                        AS d(id, kafka_partition, kafka_offset)),
              sent AS (DELETE FROM outbox_unpublished u USING d WHERE u.id = d.id
                       RETURNING u.id, u.attempts)
         INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts, published_at)
         SELECT sent.id, d.kafka_partition, d.kafka_offset, sent.attempts + 1, now()
         FROM sent JOIN d ON d.id = sent.id",
    )
    .bind(&ids)
    .bind(&partitions)
    .bind(&offsets)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}

/// Records failed attempts: attempts counted, last error and next attempt time set, and the row
/// marked `failed` when no attempt is left.
pub async fn record_failures(
    pool: &PgPool,
    failures: &[FailedAttempt],
) -> Result<u64, sqlx::Error> {
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
    let result = sqlx::query(
        "UPDATE outbox_unpublished o
         SET attempts = o.attempts + 1, last_attempt_at = now(),
             last_error = d.error,
             next_attempt_at = now() + d.delay_ms * interval '1 millisecond',
             state = CASE WHEN d.give_up THEN 'failed' ELSE o.state END
         FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bool[])
              AS d(id, error, delay_ms, give_up)
         WHERE o.id = d.id AND o.state = 'pending'",
    )
    .bind(&ids)
    .bind(&errors)
    .bind(&delays_ms)
    .bind(&give_up)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}
