//! After the load: waiting until the outbox is drained and both groups have caught up, and, when
//! that does not happen in time, a snapshot of where each group stands for the investigation.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pipeline_core::kafka::group_lag;
use sqlx::PgPool;

use super::environment::{Environment, GROUP_KINDS};
use super::topology::Topology;

/// How long the committed lag may stay above zero once every event is applied: the offset
/// commit follows each batch's database commit within a poll loop, so this is generous.
const LAG_GRACE: Duration = Duration::from_secs(60);
/// How often the (heavier) "is every event applied" query runs while the lag is not zero.
const APPLIED_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Waits until the outbox is drained and both groups have committed up to the end of the topic;
/// returns the seconds it took. Fails after `timeout`, or sooner when every event has been
/// applied by both groups but a committed lag stays above zero for [`LAG_GRACE`].
pub async fn wait_drained(
    env: &Environment,
    topology: &Topology,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut all_applied_since: Option<Instant> = None;
    let mut last_applied_check: Option<Instant> = None;
    loop {
        let pending = pending_events(&env.pool).await.ok();
        let lag = match pending {
            Some(0) => total_lag(env, topology).await.ok(),
            _ => None,
        };
        if lag == Some(0) {
            return Ok(started.elapsed().as_secs_f64());
        }
        if pending == Some(0)
            && all_applied_since.is_none()
            && last_applied_check.is_none_or(|t| t.elapsed() >= APPLIED_CHECK_EVERY)
        {
            last_applied_check = Some(Instant::now());
            if unapplied_events(env).await.is_ok_and(|n| n == 0) {
                all_applied_since = Some(Instant::now());
            }
        }
        if let (Some(since), Some(lag)) = (all_applied_since, lag) {
            if since.elapsed() >= LAG_GRACE {
                bail!(
                    "every event was applied by both groups, but their committed lag stayed at \
                     {lag} for {LAG_GRACE:?} (offsets not committed)"
                );
            }
        }
        if started.elapsed() >= timeout {
            bail!(
                "timed out after {timeout:?} waiting for the outbox to drain and both groups to \
                 catch up (outbox pending: {}, committed lag: {})",
                pending.map_or("?".to_owned(), |n| n.to_string()),
                lag.map_or("?".to_owned(), |n| n.to_string())
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn pending_events(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(crate::publishing::PENDING_SQL)
        .fetch_one(pool)
        .await
}

/// Outbox events some group has neither applied nor dead-lettered.
async fn unapplied_events(env: &Environment) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox o CROSS JOIN unnest($1::text[]) AS g(name)
         WHERE NOT EXISTS (SELECT 1 FROM applied_effect a
                           WHERE a.group_name = g.name AND a.event_id = o.event_id)
           AND NOT EXISTS (SELECT 1 FROM dead_letter d
                           WHERE d.group_name = g.name AND d.event_id = o.event_id)",
    )
    .bind(GROUP_KINDS.map(|k| env.group(k)).to_vec())
    .fetch_one(&env.pool)
    .await
}

/// Both groups' committed lag over the topic (a partition a group never committed counts whole).
async fn total_lag(env: &Environment, topology: &Topology) -> anyhow::Result<i64> {
    let mut total = 0;
    for kind in GROUP_KINDS {
        let (kafka, group, topic) = (topology.kafka(), env.group(kind), env.topic.clone());
        let parts = tokio::task::spawn_blocking(move || {
            group_lag(&kafka, &group, &[topic], Duration::from_secs(10))
        })
        .await??;
        total += parts.iter().map(|p| p.lag().unwrap_or(p.end)).sum::<i64>();
    }
    Ok(total)
}

/// Where each group stands per partition (committed offset, end of the partition, last offset
/// the group recorded processed, partition owner) and each process's metrics, written to the
/// work directory: what a drain that did not finish needs investigating. Returns the lagging
/// partitions, one line each.
pub async fn snapshot_lag(env: &Environment, topology: &Topology) -> anyhow::Result<Vec<String>> {
    let mut lines = Vec::new();
    for kind in GROUP_KINDS {
        let group = env.group(kind);
        let (kafka, g, topic) = (topology.kafka(), group.clone(), env.topic.clone());
        let parts = tokio::task::spawn_blocking(move || {
            group_lag(&kafka, &g, &[topic], Duration::from_secs(10))
        })
        .await??;
        let processed: Vec<(i32, i64, Option<String>)> = sqlx::query_as(
            "SELECT p.partition, max(p.kafka_offset),
                    (SELECT o.owner::text FROM partition_owner o
                     WHERE o.group_name = $1 AND o.partition = p.partition)
             FROM processed_message p WHERE p.group_name = $1 GROUP BY p.partition",
        )
        .bind(&group)
        .fetch_all(&env.pool)
        .await?;
        for p in parts.iter().filter(|p| p.end > 0 && p.lag() != Some(0)) {
            let (last, owner) = processed
                .iter()
                .find(|(partition, _, _)| *partition == p.partition)
                .map_or((None, None), |(_, last, owner)| {
                    (Some(*last), owner.clone())
                });
            lines.push(format!(
                "{group} partition {}: committed {:?}, end {}, last processed offset {:?}, owner {}",
                p.partition,
                p.committed,
                p.end,
                last,
                owner.as_deref().unwrap_or("none")
            ));
        }
    }
    write_metrics(env, topology).await?;
    Ok(lines)
}

/// Writes each relay's and consumer's /metrics to `metrics-<label>.txt` in the work directory.
pub async fn write_metrics(env: &Environment, topology: &Topology) -> anyhow::Result<()> {
    for member in topology.relays.iter().chain(&topology.consumers) {
        let body = match reqwest::get(format!("http://{}/metrics", member.ops)).await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(e) => format!("unreachable: {e}"),
        };
        let path = env.work_dir.join(format!("metrics-{}.txt", member.label));
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
