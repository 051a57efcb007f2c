//! After the load: waiting until the outbox is drained and both groups have caught up, and, when
//! that does not happen in time, a snapshot of where each group stands for the investigation.

use std::time::{Duration, Instant};

use anyhow::Context;
use pipeline_core::kafka::group_lag;

use super::environment::{Environment, GROUP_KINDS};
use super::topology::Topology;
use crate::wait_until;

/// Waits until the outbox is drained and both groups have committed up to the end of the topic.
pub async fn wait_drained(
    env: &Environment,
    topology: &Topology,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let kafka = topology.kafka();
    wait_until(
        "outbox drained and both groups caught up",
        timeout,
        || async {
            let pending: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE state <> 'published'")
                    .fetch_one(&env.pool)
                    .await?;
            if pending > 0 {
                return Ok(None);
            }
            for kind in GROUP_KINDS {
                let (kafka, group, topic) = (kafka.clone(), env.group(kind), env.topic.clone());
                let parts = tokio::task::spawn_blocking(move || {
                    group_lag(&kafka, &group, &[topic], Duration::from_secs(10))
                })
                .await??;
                if parts.iter().any(|p| p.end > 0 && p.lag() != Some(0)) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await?;
    Ok(started.elapsed().as_secs_f64())
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
    for member in topology.relays.iter().chain(&topology.consumers) {
        let body = match reqwest::get(format!("http://{}/metrics", member.ops)).await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(e) => format!("unreachable: {e}"),
        };
        let path = env.work_dir.join(format!("metrics-{}.txt", member.label));
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(lines)
}
