//! When the pipeline counts as processing again after a fault.
//!
//! Recovery is the time from a fault's injection until (1) the faulted part is back: the
//! restarted process (or broker, or PostgreSQL) is up and ready, every pipeline process answers
//! `/readyz` and one relay is active; and (2) an event committed to the outbox after that moment
//! has been applied by both consumer groups, i.e. the whole path order service → outbox → relay →
//! broker → consumers works again.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::topology::Topology;
use crate::wait_until;

/// Waits until every pipeline process is ready and one relay is active.
pub async fn wait_pipeline_up(topology: &Topology, timeout: Duration) -> anyhow::Result<()> {
    wait_until(
        "every process ready and one relay active",
        timeout,
        || async {
            Ok((topology.all_ready().await && topology.active_relay().await.is_some())
                .then_some(()))
        },
    )
    .await
}

/// Waits until both groups have applied an event committed after this call; `None` if that does
/// not happen before `deadline`.
pub async fn wait_fresh_event_applied(pool: &PgPool, deadline: Instant) -> Option<Instant> {
    let marks = loop {
        match marks(pool).await {
            Ok(marks) => break marks,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => return None,
        }
    };
    while Instant::now() < deadline {
        let groups: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(DISTINCT a.group_name) FROM applied_effect a
             JOIN outbox o ON o.event_id = a.event_id
             WHERE a.id > $1 AND o.id > $2",
        )
        .bind(marks.0)
        .bind(marks.1)
        .fetch_one(pool)
        .await;
        if groups.is_ok_and(|n| n >= 2) {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// The newest applied effect and the newest outbox event right now.
async fn marks(pool: &PgPool) -> Result<(i64, i64), sqlx::Error> {
    let effect: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM applied_effect")
        .fetch_one(pool)
        .await?;
    let event: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM outbox")
        .fetch_one(pool)
        .await?;
    Ok((effect, event))
}
