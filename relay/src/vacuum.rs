//! Keeping the relay's queue table small.
//!
//! `outbox_unpublished` is a queue: every event is inserted into it and deleted again when
//! published, and each claim reads the table whole (it is meant to be small). Rows deleted since
//! the last vacuum stay in its pages until one runs, and autovacuum visits a database once a
//! minute by default, so under a steady load every claim would read a minute's worth of dead
//! rows. A plain `VACUUM` of the table every second keeps it a few pages long; it takes no lock
//! that blocks inserts, deletes or claims, and on a table that small costs little.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The queue table's vacuum statement. `SKIP_LOCKED`: never wait for a lock someone else
/// holds on it (an ALTER, or a vacuum already running); the next round vacuums it.
pub const VACUUM_QUEUE_SQL: &str = "VACUUM (SKIP_LOCKED) outbox_unpublished";

/// Vacuums the queue table once.
pub async fn vacuum_once(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(VACUUM_QUEUE_SQL).execute(pool).await?;
    Ok(())
}

/// Vacuums the queue table every `every` until `shutdown`. A failure is logged and tried again
/// next round: the relay works without it, only its claims get slower.
pub async fn vacuum_queue(pool: PgPool, every: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) = vacuum_once(&pool).await {
            tracing::warn!(error = %e, "cannot vacuum the relay's queue table");
        }
    }
}
