//! The backlog gauges every relay reports, active or standing by: the relay's queue, the
//! lease's vacancy and the delayed events that are due, read from the database.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;

/// Refreshes the backlog gauges from the database clock every `every`, until `shutdown`.
/// Also reads how long the relay lease `lease_key` has had no holder.
pub async fn watch_backlog(
    pool: PgPool,
    lease_key: i64,
    metrics: RelayMetrics,
    every: Duration,
    shutdown: CancellationToken,
) {
    loop {
        if let Err(e) = refresh_backlog(&pool, lease_key, &metrics).await {
            tracing::warn!(error = %e, "cannot read outbox backlog");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// One reading of [`watch_backlog`]: the relay's queue (events waiting, failed, and held behind
/// a failed event of their aggregate; the oldest's age), the lease's vacancy, the delayed
/// events that are due, and the write-ahead log's slot (whether it streams, its lag, the WAL it
/// keeps, and the events past the horizon counted as unpublished).
pub async fn refresh_backlog(
    pool: &PgPool,
    lease_key: i64,
    metrics: &RelayMetrics,
) -> Result<(), sqlx::Error> {
    let (count, age, vacant, due, overdue, failed, held): (i64, f64, f64, i64, f64, i64, i64) =
        sqlx::query_as(BACKLOG_SQL)
            .bind(lease_key)
            .fetch_one(pool)
            .await?;
    let wal: Option<(bool, bool, i64, i64, i64, f64)> = sqlx::query_as(WAL_BACKLOG_SQL)
        .bind(lease_key)
        .fetch_optional(pool)
        .await?;
    let (streaming, slot_active, lag, retained, streamed, streamed_age) =
        wal.unwrap_or((false, false, 0, 0, 0, 0.0));
    metrics.wal_streaming.set(i64::from(streaming));
    metrics.wal_slot_active.set(i64::from(slot_active));
    metrics.wal_slot_lag.set(lag.max(0));
    metrics.wal_retained.set(retained.max(0));
    metrics.unpublished.set(count + streamed);
    metrics
        .oldest_unpublished_age
        .set(age.max(streamed_age).max(0.0));
    metrics.lease_vacant.set(vacant.max(0.0));
    metrics.delayed_due.set(due);
    metrics.delayed_overdue.set(overdue.max(0.0));
    metrics.failed.set(failed);
    metrics.held.set(held);
    Ok(())
}

/// The backlog reading of [`refresh_backlog`]; `$1` is the lease's key.
///
/// Delayed events: only the due head of the due-time index is read, however many wait further
/// ahead (`now()`, the statement's start here, bounds the index scan; the volatile
/// `clock_timestamp()` could only filter it, and every delayed event would be read each second).
/// Held events: from each failed event (a handful), its aggregate's later events through the
/// outbox's (aggregate, sequence) index.
pub const BACKLOG_SQL: &str = "SELECT count(*),
         COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8,
         (SELECT COALESCE(max(EXTRACT(EPOCH FROM clock_timestamp() - expires_at)), 0)::float8
          FROM relay_lease
          WHERE lease_key = $1 AND expires_at < clock_timestamp()
            AND expires_at > '-infinity'),
         (SELECT count(*) FROM outbox_delayed WHERE publish_at <= now()),
         (SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(publish_at)), 0)::float8
          FROM outbox_delayed WHERE publish_at <= now()),
         count(*) FILTER (WHERE state = 'failed'),
         (SELECT count(DISTINCT h.id)
          FROM outbox_unpublished f
          JOIN outbox o ON o.aggregate_id = f.aggregate_id AND o.sequence > f.sequence
          JOIN outbox_unpublished h ON h.id = o.id AND h.state = 'pending'
          WHERE f.state = 'failed' AND f.attempts > 0)
  FROM outbox_unpublished";

/// The write-ahead log's side of [`refresh_backlog`], for the relay of lease `$1`: no row when it
/// never streamed. Unpublished: the events past the horizon's last id that are neither queued
/// nor delivered (the horizon trails the stream by about a second, so a second's worth of
/// published events is counted too).
pub const WAL_BACKLOG_SQL: &str = "SELECT w.streaming,
         COALESCE(r.active, false),
         COALESCE((pg_current_wal_lsn() - r.confirmed_flush_lsn)::bigint, 0),
         COALESCE((pg_current_wal_lsn() - r.restart_lsn)::bigint, 0),
         p.n, COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - p.oldest), 0)::float8
  FROM outbox_wal_source w
  LEFT JOIN pg_replication_slots r ON r.slot_name = w.slot
  CROSS JOIN LATERAL (
      SELECT count(*) AS n, min(o.created_at) AS oldest FROM outbox o
      WHERE w.streaming AND o.id > w.horizon_id
        AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
        AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)) p
  WHERE w.lock_key = $1";
