//! What the relay publishes while Kafka nodes are down or frozen, read from the outbox: an event
//! is marked published only once every in-sync replica acknowledged it (`acks=all`): by a row in
//! `outbox_delivery` (same id as its `outbox` row) from the queue, or, streamed from the
//! write-ahead log, by the stream's horizon passing it ([`PUBLISHED`]).
//!
//! Publishing counts as resumed once an event committed after a fault began is marked published:
//! an event claimed before the fault may have been acknowledged before it, and marked later.
//! "Committed after" is told by ids: identities are handed out at insert, so every event with an
//! id above the highest one visible at some moment was committed after that moment.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

/// Whether the outbox row `o` is marked published: its delivery recorded, or (streamed from the
/// write-ahead log) neither queued nor delivered and older than the stream's horizon.
pub const PUBLISHED: &str = "(EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
      OR (NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)
          AND o.created_at < (SELECT max(horizon) FROM outbox_wal_source)))";

/// Events the relay has not published yet.
pub use pipeline_testkit::db::UNPUBLISHED_SQL as PENDING_SQL;

/// How often the outbox is read while waiting.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// The outbox at one moment.
#[derive(Debug, Clone, Copy)]
pub struct OutboxMark {
    /// The highest event id visible: events above it were committed after this moment.
    pub last_event: i64,
    /// Events marked published so far.
    pub published: i64,
    /// The database's clock (`clock_timestamp()`), as `outbox_delivery.published_at` is.
    pub at: chrono::DateTime<chrono::Utc>,
}

/// Reads the outbox's mark now.
pub async fn mark(pool: &PgPool) -> Result<OutboxMark, sqlx::Error> {
    let (last_event, published, at) = sqlx::query_as(&format!(
        "SELECT (SELECT coalesce(max(id), 0) FROM outbox),
                (SELECT count(*) FROM outbox o WHERE {PUBLISHED}),
                clock_timestamp()"
    ))
    .fetch_one(pool)
    .await?;
    Ok(OutboxMark {
        last_event,
        published,
        at,
    })
}

/// Reads the outbox's mark, retrying while PostgreSQL does not answer, until `deadline`.
pub async fn mark_by(pool: &PgPool, deadline: Instant) -> Option<OutboxMark> {
    loop {
        match mark(pool).await {
            Ok(mark) => return Some(mark),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(POLL_EVERY).await,
            Err(_) => return None,
        }
    }
}

/// Waits, until `deadline`, for an event committed after `since` to be marked published; when
/// that happened, or `None`.
pub async fn wait_published_after(
    pool: &PgPool,
    since: &OutboxMark,
    deadline: Instant,
) -> Option<Instant> {
    while Instant::now() < deadline {
        let published: Result<bool, sqlx::Error> = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM outbox o WHERE o.id > $1 AND {PUBLISHED})"
        ))
        .bind(since.last_event)
        .fetch_one(pool)
        .await;
        if published.unwrap_or(false) {
            return Some(Instant::now());
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
    None
}

/// Events committed after `since` that were marked published before `before` (the database's
/// clock of a later mark; read just after it: a streamed event's mark, the horizon, has no time
/// of its own).
pub async fn published_between(
    pool: &PgPool,
    since: &OutboxMark,
    before: &OutboxMark,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox o
         WHERE o.id > $1
           AND (EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id AND d.published_at < $2)
                OR (NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
                    AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)
                    AND o.created_at < (SELECT max(horizon) FROM outbox_wal_source)))",
    )
    .bind(since.last_event)
    .bind(before.at)
    .fetch_one(pool)
    .await
}

/// Events waiting in the outbox (pending or failed; streamed ones past the horizon too).
pub async fn unpublished(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(PENDING_SQL).fetch_one(pool).await
}
