//! Keeping the relay's queue table small.
//!
//! `outbox_unpublished` is a queue: every event is inserted into it and deleted again when
//! published, and each claim reads the table whole (it is meant to be small). Rows deleted since
//! the last vacuum stay in its pages until one runs, and autovacuum visits a database once a
//! minute by default, so under a steady load every claim would read a minute's worth of dead
//! rows. A plain `VACUUM` of the table every second keeps it a few pages long; it takes no lock
//! that blocks inserts, deletes or claims, and on a table that small costs little.
//!
//! It leaves the table's empty last pages in place while the table is small: giving them back
//! (truncation) takes an ACCESS EXCLUSIVE lock that every claim and every writer's insert would
//! queue behind, for as long as the file system takes to truncate. Only a table grown past
//! [`SHRINK_ABOVE_PAGES`] (after a backlog) is truncated, so claims read a few hundred pages at
//! most and the lock is taken only then.

use std::time::Duration;

use prometheus::Histogram;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The queue table's vacuum statement. `SKIP_LOCKED`: never wait for a lock someone else
/// holds on it (an ALTER, or a vacuum already running); the next round vacuums it.
/// `TRUNCATE false`: empty last pages stay (see the module's documentation).
pub const VACUUM_QUEUE_SQL: &str = "VACUUM (SKIP_LOCKED, TRUNCATE false) outbox_unpublished";

/// The same, giving empty last pages back: only for a table grown past [`SHRINK_ABOVE_PAGES`].
pub const SHRINK_QUEUE_SQL: &str = "VACUUM (SKIP_LOCKED, TRUNCATE true) outbox_unpublished";

/// A queue table longer than this (1 MiB of 8 KiB pages) is truncated by its vacuum.
pub const SHRINK_ABOVE_PAGES: i64 = 128;

/// Vacuums the queue table once, truncating it only when it grew past [`SHRINK_ABOVE_PAGES`].
pub async fn vacuum_once(pool: &PgPool) -> Result<(), sqlx::Error> {
    let pages: i64 = sqlx::query_scalar(
        "SELECT pg_relation_size('outbox_unpublished') / current_setting('block_size')::bigint",
    )
    .fetch_one(pool)
    .await?;
    let sql = if pages > SHRINK_ABOVE_PAGES {
        SHRINK_QUEUE_SQL
    } else {
        VACUUM_QUEUE_SQL
    };
    sqlx::raw_sql(sql).execute(pool).await?;
    Ok(())
}

/// Vacuums the queue table every `every` until `shutdown`, in the rounds after this relay
/// recorded a batch (`batches`, the relay's batch-size histogram, counts them): an idle relay,
/// or a standby, sends nothing. A failure is logged and tried again next round: the relay works
/// without it, only its claims get slower.
pub async fn vacuum_queue(
    pool: PgPool,
    every: Duration,
    batches: Histogram,
    shutdown: CancellationToken,
) {
    let mut vacuumed_after = batches.get_sample_count();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let recorded = batches.get_sample_count();
        if recorded == vacuumed_after {
            continue;
        }
        match vacuum_once(&pool).await {
            Ok(()) => vacuumed_after = recorded,
            Err(e) => tracing::warn!(error = %e, "cannot vacuum the relay's queue table"),
        }
    }
}
