//! When the pipeline counts as processing again after a fault.
//!
//! Recovery is the time from a fault's injection until (1) the faulted part is back: the
//! restarted process (or broker, or PostgreSQL) is up and ready, every pipeline process answers
//! `/readyz` and one relay is active; and (2) both consumer groups have applied an effect after
//! that moment (`applied_effect` grows for each). It measures "processing again", not "caught
//! up": a backlog built up during the fault is drained later, and the final drain waits for it.

use std::time::Duration;

use pipeline_testkit::wait_until;
use sqlx::PgPool;
use tokio::time::Instant;

use super::topology::Topology;

/// Waits until every pipeline process is ready and one relay is active.
pub async fn wait_pipeline_up(topology: &Topology, timeout: Duration) -> anyhow::Result<()> {
    wait_until(
        "every process ready and one relay active",
        timeout,
        || async {
            Ok(
                (topology.all_ready().await && topology.active_relay().await.is_some())
                    .then_some(()),
            )
        },
    )
    .await
}

/// Waits until both groups have applied an effect after this call; `None` if that does not
/// happen before `deadline`.
pub async fn wait_both_groups_apply(pool: &PgPool, deadline: Instant) -> Option<Instant> {
    let mark = loop {
        match newest_effect(pool).await {
            Ok(mark) => break mark,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => return None,
        }
    };
    while Instant::now() < deadline {
        let groups: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(DISTINCT group_name) FROM applied_effect WHERE id > $1",
        )
        .bind(mark)
        .fetch_one(pool)
        .await;
        if groups.is_ok_and(|n| n >= 2) {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

async fn newest_effect(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM applied_effect")
        .fetch_one(pool)
        .await
}
