//! The statements on `export_job`. Every outcome a worker records names the lease it holds
//! (`lease_until` as claimed or last renewed), so a worker whose lease was taken over records
//! nothing.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Moves job `id` from `pending` to `processing`, free for a worker to claim at once. False
/// when the job is not pending (started before, or unknown).
pub async fn start(conn: &mut PgConnection, id: Uuid) -> Result<bool, sqlx::Error> {
    let started = sqlx::query(
        "UPDATE export_job SET state = 'processing', lease_until = clock_timestamp()
         WHERE id = $1 AND state = 'pending'",
    )
    .bind(id)
    .execute(conn)
    .await?;
    Ok(started.rows_affected() == 1)
}

/// The stored state of job `id`, if it exists.
pub async fn state(conn: &mut PgConnection, id: Uuid) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT state FROM export_job WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// A processing job a worker holds until `lease`.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The job.
    pub id: Uuid,
    /// The filters as stored; the worker reads them (an unreadable one fails the job for good).
    pub filters: serde_json::Value,
    /// Attempts so far, this one included.
    pub attempts: i32,
    /// The lease this worker holds: the job's `lease_until` as claimed or last renewed.
    pub lease: DateTime<Utc>,
}

/// What a finished file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The file's name in the export directory.
    pub file_name: String,
    /// Data rows (the header line not counted).
    pub row_count: i64,
    /// SHA-256 of the file, lowercase hex.
    pub checksum: String,
}

/// Claims the processing job whose lease ran out first, if any: its lease is pushed `lease` ahead
/// and its attempts counted. Other workers skip it meanwhile.
pub async fn claim(pool: &PgPool, lease: Duration) -> Result<Option<Claimed>, sqlx::Error> {
    let row: Option<(Uuid, serde_json::Value, i32, DateTime<Utc>)> = sqlx::query_as(
        "UPDATE export_job j
         SET lease_until = clock_timestamp() + $1 * interval '1 millisecond',
             attempts = j.attempts + 1, started_at = COALESCE(j.started_at, clock_timestamp())
         FROM (SELECT id FROM export_job
               WHERE state = 'processing' AND lease_until <= clock_timestamp()
               ORDER BY lease_until LIMIT 1 FOR UPDATE SKIP LOCKED) free
         WHERE j.id = free.id
         RETURNING j.id, j.filters, j.attempts, j.lease_until",
    )
    .bind(millis(lease))
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(id, filters, attempts, lease)| Claimed {
        id,
        filters,
        attempts,
        lease,
    }))
}

/// Pushes the lease of `job` `lease` ahead. False when the lease is no longer this worker's.
pub async fn renew(pool: &PgPool, job: &mut Claimed, lease: Duration) -> Result<bool, sqlx::Error> {
    let renewed: Option<DateTime<Utc>> = sqlx::query_scalar(
        "UPDATE export_job SET lease_until = clock_timestamp() + $3 * interval '1 millisecond'
         WHERE id = $1 AND state = 'processing' AND lease_until = $2
         RETURNING lease_until",
    )
    .bind(job.id)
    .bind(job.lease)
    .bind(millis(lease))
    .fetch_optional(pool)
    .await?;
    match renewed {
        Some(lease) => {
            job.lease = lease;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Records `job` succeeded with its file, downloadable for `ttl`.
pub async fn record_succeeded(
    pool: &PgPool,
    job: &Claimed,
    written: &Written,
    ttl: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE export_job
         SET state = 'succeeded', file_name = $3, row_count = $4, checksum = $5,
             failure_reason = NULL, retryable = NULL, lease_until = NULL,
             finished_at = clock_timestamp(),
             expires_at = clock_timestamp() + $6 * interval '1 millisecond'
         WHERE id = $1 AND state = 'processing' AND lease_until = $2",
    )
    .bind(job.id)
    .bind(job.lease)
    .bind(&written.file_name)
    .bind(written.row_count)
    .bind(&written.checksum)
    .bind(millis(ttl))
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Records `job` failed with `reason`; `retryable` says whether submitting it again may succeed.
/// The failed job expires after `ttl` like a finished one.
pub async fn record_failed(
    pool: &PgPool,
    job: &Claimed,
    reason: &str,
    retryable: bool,
    ttl: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE export_job
         SET state = 'failed', failure_reason = $3, retryable = $4, lease_until = NULL,
             finished_at = clock_timestamp(),
             expires_at = clock_timestamp() + $5 * interval '1 millisecond'
         WHERE id = $1 AND state = 'processing' AND lease_until = $2",
    )
    .bind(job.id)
    .bind(job.lease)
    .bind(reason)
    .bind(retryable)
    .bind(millis(ttl))
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Leaves `job` for another attempt in `after`, noting why this one failed.
pub async fn retry_later(
    pool: &PgPool,
    job: &Claimed,
    reason: &str,
    after: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE export_job
         SET failure_reason = $3, lease_until = clock_timestamp() + $4 * interval '1 millisecond'
         WHERE id = $1 AND state = 'processing' AND lease_until = $2",
    )
    .bind(job.id)
    .bind(job.lease)
    .bind(reason)
    .bind(millis(after))
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives `job` back at once without counting the attempt (the worker is stopping).
pub async fn release(pool: &PgPool, job: &Claimed) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE export_job SET lease_until = clock_timestamp(), attempts = attempts - 1
         WHERE id = $1 AND state = 'processing' AND lease_until = $2",
    )
    .bind(job.id)
    .bind(job.lease)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Up to `limit` finished jobs whose time is up, with their file names.
pub async fn expiring(
    pool: &PgPool,
    limit: i64,
) -> Result<Vec<(Uuid, Option<String>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, file_name FROM export_job
         WHERE state IN ('succeeded', 'failed') AND expires_at <= clock_timestamp()
         ORDER BY expires_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Marks `ids` expired (their files already removed).
pub async fn mark_expired(pool: &PgPool, ids: &[Uuid]) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE export_job SET state = 'expired'
         WHERE id = ANY($1) AND state IN ('succeeded', 'failed')",
    )
    .bind(ids)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Removes at most `limit` jobs that expired more than `kept` ago (their files are gone); the
/// oldest first, through the expiry index. Returns how many.
pub async fn remove_expired(pool: &PgPool, kept: Duration, limit: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM export_job WHERE id IN (
             SELECT id FROM export_job
             WHERE state = 'expired'
               AND expires_at < clock_timestamp() - make_interval(secs => $1::float8 / 1000)
             ORDER BY expires_at LIMIT $2)",
    )
    .bind(millis(kept))
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Jobs submitted and not finished (pending or processing), and the age in seconds of the
/// oldest of them (0 when there is none).
pub async fn waiting(pool: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*),
                COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8
         FROM export_job WHERE state IN ('pending', 'processing')",
    )
    .fetch_one(pool)
    .await
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
