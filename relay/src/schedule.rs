//! The schedule step: the active relay materialises the due occurrences of recurring schedules
//! (`outbox::schedule`) as delayed events, fenced like its other writes, just before each
//! release of due delayed events, so an occurrence is published within a release interval of
//! its time.

use outbox::schedule::{materialise_due, Materialised};
use outbox::Outbox;
use sqlx::PgPool;

use crate::lease::Fence;
use crate::mark::MarkError;

/// Materialises every due occurrence in one transaction, nothing unless `fence`'s epoch still
/// holds the lease ([`MarkError::LeaseLost`]). Occurrences are decided by the database's clock,
/// the clock the release compares publish times with.
pub async fn materialise_step(
    pool: &PgPool,
    outbox: &Outbox,
    fence: Fence,
) -> Result<Vec<Materialised>, MarkError> {
    let mut tx = pool.begin().await?;
    let held: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT clock_timestamp() FROM relay_lease
         WHERE lease_key = $1 AND epoch = $2 FOR KEY SHARE",
    )
    .bind(fence.lock_key)
    .bind(fence.epoch)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(now) = held else {
        return Err(MarkError::LeaseLost(fence.epoch));
    };
    let done = materialise_due(&mut tx, outbox, now, Some(fence.epoch))
        .await
        .map_err(|e| match e {
            outbox::schedule::ScheduleError::Database(e) => MarkError::Database(e),
            other => MarkError::Database(sqlx::Error::Protocol(other.to_string())),
        })?;
    tx.commit().await?;
    for m in &done {
        if !m.fired.is_empty() || m.skipped > 0 {
            tracing::info!(
                schedule = %m.schedule,
                fired = m.fired.len(),
                skipped = m.skipped,
                epoch = fence.epoch,
                "schedule occurrences materialised"
            );
        }
    }
    Ok(done)
}
