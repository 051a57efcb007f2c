//! What the database knows of a relay that streams the write-ahead log: whether writers queue
//! their events (they do not while a relay streams), and the horizon before which every event
//! neither queued nor delivered is published. Switching to the log, moving the horizon, and
//! falling back to the queue from it.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use pgwire_replication::Lsn;
use sqlx::PgPool;

use crate::lease::Fence;
use crate::mark::MarkError;

/// How far before the oldest open transaction's start the horizon stays: a transaction that has
/// just begun may not be listed among the server's sessions yet.
const HORIZON_MARGIN_MS: i64 = 1000;

/// A probe of the server: where its write-ahead log ends, and the time before which no open
/// transaction started. Once the slot's confirmed position has passed `position`, every event
/// created before `horizon` is either published or in a transaction that was rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// The server's WAL insert position at the probe.
    pub position: Lsn,
    /// The start of the oldest transaction open at the probe (less a margin), or the probe's
    /// time when none was.
    pub horizon: DateTime<Utc>,
    /// The outbox's last id at the probe.
    pub last_id: i64,
}

/// Whether the relay's role sees every session's transaction start (superuser, or a member of
/// `pg_read_all_stats`): the horizon depends on it.
pub async fn sees_all_transactions(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')",
    )
    .fetch_one(pool)
    .await
}

/// Marks the relay of `fence` as streaming from `slot`: from the commit on, writers queue
/// nothing. Every event written before then was queued, so the horizon starts at this
/// transaction's time, unless the relay already streamed (a takeover), which keeps its horizon.
pub async fn switch_to_wal(pool: &PgPool, fence: Fence, slot: &str) -> Result<(), MarkError> {
    let held: bool = sqlx::query_scalar(
        "WITH lease AS (SELECT epoch FROM relay_lease WHERE lease_key = $1 AND epoch = $2 FOR KEY SHARE),
              up AS (INSERT INTO outbox_wal_source (lock_key, slot, streaming, horizon, horizon_id)
                     SELECT $1, $3, true, now(),
                            COALESCE(pg_sequence_last_value(
                                pg_get_serial_sequence('outbox', 'id')::regclass), 0)
                     WHERE EXISTS (SELECT 1 FROM lease)
                     ON CONFLICT (lock_key) DO UPDATE
                     SET slot = EXCLUDED.slot, streaming = true, updated_at = now(),
                         horizon = CASE WHEN outbox_wal_source.streaming
                                        THEN outbox_wal_source.horizon ELSE now() END,
                         horizon_id = CASE WHEN outbox_wal_source.streaming
                                           THEN outbox_wal_source.horizon_id
                                           ELSE EXCLUDED.horizon_id END,
                         since = CASE WHEN outbox_wal_source.streaming
                                      THEN outbox_wal_source.since ELSE now() END
                     RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM up)",
    )
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .bind(slot)
    .fetch_one(pool)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(())
}

/// Moves the horizon to `passed` (a probe the slot's confirmed position `confirmed` has passed),
/// records `confirmed`, and probes the server again; one statement, fenced.
pub async fn advance(
    pool: &PgPool,
    fence: Fence,
    passed: Option<Probe>,
    confirmed: Lsn,
) -> Result<Probe, MarkError> {
    let (held, position, horizon, last_id): (bool, i64, DateTime<Utc>, Option<i64>) = sqlx::query_as(
        "WITH lease AS (SELECT epoch FROM relay_lease WHERE lease_key = $1 AND epoch = $2 FOR KEY SHARE),
              up AS (UPDATE outbox_wal_source
                     SET horizon = GREATEST(horizon, COALESCE($3, horizon)),
                         horizon_id = GREATEST(horizon_id, COALESCE($6, horizon_id)),
                         confirmed = '0/0'::pg_lsn + $4::numeric, updated_at = now()
                     WHERE lock_key = $1 AND streaming AND EXISTS (SELECT 1 FROM lease)
                       AND ($3 IS NOT NULL OR confirmed IS DISTINCT FROM '0/0'::pg_lsn + $4::numeric)
                     RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM lease),
                (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
                LEAST(clock_timestamp(),
                      (SELECT min(xact_start) FROM pg_stat_activity
                       WHERE datname = current_database() AND backend_type = 'client backend'
                         AND pid <> pg_backend_pid()))
                - $5 * interval '1 millisecond',
                pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass)",
    )
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .bind(passed.map(|p| p.horizon))
    .bind(i64::try_from(confirmed.0).unwrap_or(i64::MAX))
    .bind(HORIZON_MARGIN_MS)
    .bind(passed.map(|p| p.last_id))
    .fetch_one(pool)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    Ok(Probe {
        position: Lsn(u64::try_from(position).unwrap_or(0)),
        horizon,
        last_id: last_id.unwrap_or(0),
    })
}

/// Falls back from the write-ahead log to the queue for the relay of `lock_key`, if it streamed:
/// writers queue their events again, and every event created since the horizon that is neither
/// queued nor delivered is queued (some of them were published already: consumers skip what they
/// applied). Takes the outbox's SHARE lock for the switch, so no insert is in flight across it:
/// writers wait for the few milliseconds it takes. Returns the events queued, `None` when the
/// relay did not stream. Fenced.
pub async fn fall_back_to_queue(pool: &PgPool, fence: Fence) -> Result<Option<u64>, MarkError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '10s'")
        .execute(&mut *tx)
        .await?;
    let held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM relay_lease WHERE lease_key = $1 AND epoch = $2 FOR KEY SHARE)",
    )
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .fetch_one(&mut *tx)
    .await?;
    if !held {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    let horizon: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT horizon FROM outbox_wal_source WHERE lock_key = $1 AND streaming FOR UPDATE",
    )
    .bind(fence.lock_key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(horizon) = horizon else {
        return Ok(None);
    };
    sqlx::query("LOCK TABLE outbox IN SHARE MODE")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE outbox_wal_source SET streaming = false, updated_at = now() WHERE lock_key = $1",
    )
    .bind(fence.lock_key)
    .execute(&mut *tx)
    .await?;
    let queued = sqlx::query(
        "INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
         SELECT o.id, o.aggregate_id, o.sequence, o.created_at FROM outbox o
         WHERE o.created_at >= $1
           AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
         ORDER BY o.id
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(horizon)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query("SELECT pg_notify('outbox_pending', '')")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(queued))
}

/// Ends the session holding `slot` (a relay that lost the lease but still streams, frozen or cut
/// off): the lease's holder takes the slot over. Whether one was ended.
pub async fn end_other_reader(pool: &PgPool, slot: &str) -> Result<bool, sqlx::Error> {
    let ended: Option<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
         WHERE slot_name = $1 AND active AND active_pid IS NOT NULL",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?;
    Ok(ended.unwrap_or(false))
}

/// Whether the relay of `lock_key` streams (by the database) from a slot that does not exist.
pub async fn slot_missing(pool: &PgPool, lock_key: i64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM outbox_wal_source w
                        WHERE w.lock_key = $1 AND w.streaming
                          AND NOT EXISTS (SELECT 1 FROM pg_replication_slots r
                                          WHERE r.slot_name = w.slot))",
    )
    .bind(lock_key)
    .fetch_one(pool)
    .await
}

/// Waits, up to `within`, until no session streams from `slot` (an ended session lets go of it
/// a moment later).
pub async fn until_slot_free(
    pool: &PgPool,
    slot: &str,
    within: std::time::Duration,
) -> Result<(), sqlx::Error> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let active: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)",
        )
        .bind(slot)
        .fetch_one(pool)
        .await?;
        if !active || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// What the queue holds of a read's aggregates ([`queued_aggregates`]).
pub struct QueuedAmong {
    /// The aggregates asked about with an event in the queue (pending, waiting for a retry, or
    /// failed).
    pub queued: HashSet<String>,
    /// Whether the queue holds any event at all.
    pub any: bool,
    /// Whether every transaction with an id below the one given has ended.
    pub writers_done: bool,
}

/// Of `aggregates`, those with an event in the relay's queue; whether it holds any event; and
/// whether every transaction with an id below `writers_before` has ended. A streamed event of
/// such an aggregate must wait in the queue behind it, or it would be published ahead of an
/// earlier event.
pub async fn queued_aggregates(
    pool: &PgPool,
    aggregates: &[&str],
    writers_before: i64,
) -> Result<QueuedAmong, sqlx::Error> {
    let (queued, any, writers_done): (Vec<String>, bool, bool) = sqlx::query_as(
        "SELECT ARRAY(SELECT DISTINCT aggregate_id FROM outbox_unpublished
                      WHERE aggregate_id = ANY ($1::text[])),
                EXISTS (SELECT 1 FROM outbox_unpublished),
                pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= $2",
    )
    .bind(aggregates)
    .bind(writers_before)
    .fetch_one(pool)
    .await?;
    Ok(QueuedAmong {
        queued: queued.into_iter().collect(),
        any,
        writers_done,
    })
}

/// Every aggregate with an event in the relay's queue, unless the queue holds more than `most`
/// events.
pub async fn all_queued_aggregates(
    pool: &PgPool,
    most: usize,
) -> Result<Option<HashSet<String>>, sqlx::Error> {
    let most = i64::try_from(most).unwrap_or(i64::MAX - 1);
    let all: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT CASE WHEN (SELECT count(*) FROM (SELECT 1 FROM outbox_unpublished LIMIT $1 + 1) r) > $1
                     THEN NULL
                     ELSE ARRAY(SELECT DISTINCT aggregate_id FROM outbox_unpublished) END",
    )
    .bind(most)
    .fetch_one(pool)
    .await?;
    Ok(all.map(|a| a.into_iter().collect()))
}

/// The id the next transaction to take one will get: every transaction that has one now has a
/// lower one.
pub async fn next_transaction_id(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        .fetch_one(pool)
        .await
}

