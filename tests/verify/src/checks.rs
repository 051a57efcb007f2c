//! The checks of the history against the database and the topic, once the pipeline has drained
//! (see [`super::drain`]).
//!
//! - lost: per group, an expected event (acknowledged, or committed to the outbox without an
//!   acknowledgement) with neither an applied effect nor a dead letter;
//! - duplicate effects: per group, effects beyond the first for one event id (`applied_effect`
//!   has no unique constraint, so a broken dedupe shows here);
//! - reorders: per group and order, effects (in id order) whose sequence is not the previous
//!   one + 1 (the first must be 1);
//! - Kafka duplicates: records of the topic whose event id came before (reported, not failed).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::driver::History;
use super::environment::{Environment, GROUP_KINDS};
use super::queries::{EXPECTED_EVENTS, LOST_EVENTS, REORDERED_EFFECTS};
use super::topic_scan;
use super::topology::{Topology, STOCK};

/// Counts of one consumer group.
#[derive(Debug, Default, Clone, Serialize)]
pub struct GroupCounts {
    pub applied: i64,
    pub lost: i64,
    pub duplicate_effects: i64,
    pub reorders: i64,
    pub dead_lettered: i64,
    pub parked: i64,
}

/// What the checks found.
#[derive(Debug, Default, Clone, Serialize)]
pub struct CheckResults {
    pub outbox_events: i64,
    pub unacknowledged_committed: i64,
    /// Acknowledged changes the outbox does not hold (counted as lost in every group).
    pub acknowledged_not_in_outbox: i64,
    /// Acknowledged (order, sequence) whose outbox event has another type than the change.
    pub sequence_type_mismatches: i64,
    pub lost: i64,
    pub duplicate_effects: i64,
    pub reorders: i64,
    pub dead_lettered: i64,
    pub parked: i64,
    pub by_group: BTreeMap<String, GroupCounts>,
    /// Products whose available + reserved + shipped quantity differs from the seeded stock.
    pub stock_mismatched_products: i64,
    pub topic_records: u64,
    pub kafka_duplicates: u64,
    pub topic_records_without_event_id: u64,
    /// Events the outbox marks published that the topic does not hold.
    pub published_missing_from_topic: i64,
    /// Delivery records whose partition and offset do not hold their event (a sentinel offset
    /// among them).
    pub deliveries_at_wrong_position: i64,
    /// Delivery records that say Kafka confirmed the write without its offset.
    pub deliveries_offset_unknown: i64,
    /// Partitions a group had not caught up on when the drain gave up (empty when drained).
    pub undrained_partitions: Vec<String>,
    /// Rows retention removed during the run, by table (`retention_state`).
    pub retention_removed: BTreeMap<String, i64>,
    /// Events the groups flagged stale (redeliveries their dedupe rows no longer knew, caught by
    /// their orders' progress), over every group.
    pub stale: i64,
    /// Up to 20 examples of each failure, for the investigation.
    pub examples: BTreeMap<String, Vec<String>>,
}

/// Runs every check.
pub async fn run(
    env: &Environment,
    topology: &Topology,
    history: &History,
) -> anyhow::Result<CheckResults> {
    let pool = &env.pool;
    let groups: Vec<String> = GROUP_KINDS.iter().map(|k| env.group(k)).collect();
    let mut results = database_checks(pool, &groups, history).await?;
    let (kafka, topic) = (topology.kafka(), env.topic.clone());
    let scan = tokio::task::spawn_blocking(move || {
        topic_scan::scan(&kafka, &topic, Duration::from_secs(300))
    })
    .await??;
    results.topic_records = scan.records;
    results.kafka_duplicates = scan.duplicates;
    results.topic_records_without_event_id = scan.without_event_id;
    // Marked published: with a delivery record (the queue), or streamed past the horizon (no
    // position recorded: the topic must hold it somewhere).
    let published: Vec<(Uuid, Option<i32>, Option<i64>)> = sqlx::query_as(&format!(
        "SELECT o.event_id, d.kafka_partition, d.kafka_offset FROM outbox o
         LEFT JOIN outbox_delivery d USING (id) WHERE {}",
        crate::publishing::PUBLISHED
    ))
    .fetch_all(pool)
    .await?;
    results.published_missing_from_topic = published
        .iter()
        .filter(|(id, ..)| !scan.event_ids.contains(id))
        .count() as i64;
    results.deliveries_offset_unknown = published
        .iter()
        .filter(|(_, p, o)| p.is_some() && o.is_none())
        .count() as i64;
    // Where the record says the event is, the topic holds it there: at that partition and offset,
    // or in that partition when the offset is unknown (an event the topic does not hold at all is
    // counted above).
    let partitions: HashSet<(Uuid, i32)> =
        scan.positions.iter().map(|(id, p, _)| (*id, *p)).collect();
    let wrong: Vec<String> = published
        .iter()
        .filter_map(|(id, p, o)| Some((id, (*p)?, o)))
        .filter(|(id, p, o)| {
            scan.event_ids.contains(id)
                && match o {
                    Some(o) => !scan.positions.contains(&(**id, *p, *o)),
                    None => !partitions.contains(&(**id, *p)),
                }
        })
        .map(|(id, p, o)| match o {
            Some(o) => format!("event {id} recorded at {p}/{o}"),
            None => format!("event {id} recorded in partition {p}"),
        })
        .collect();
    results.deliveries_at_wrong_position = wrong.len() as i64;
    if !wrong.is_empty() {
        let _ = results.examples.insert(
            "delivery at a wrong position".to_owned(),
            wrong.into_iter().take(20).collect(),
        );
    }
    Ok(results)
}

/// The checks against the database: the history is stored next to the pipeline's tables and
/// compared with the outbox and each group's effects and dead letters.
pub async fn database_checks(
    pool: &PgPool,
    groups: &[String],
    history: &History,
) -> anyhow::Result<CheckResults> {
    store_acknowledged(pool, history).await?;
    let mut results = CheckResults {
        outbox_events: count(pool, "SELECT count(*) FROM outbox").await?,
        unacknowledged_committed: count(
            pool,
            "SELECT count(*) FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM verify_acknowledged a
             WHERE a.order_id = o.aggregate_id AND a.sequence = o.sequence)",
        )
        .await?,
        acknowledged_not_in_outbox: count(
            pool,
            "SELECT count(*) FROM verify_acknowledged a WHERE NOT EXISTS (SELECT 1 FROM outbox o
             WHERE o.aggregate_id = a.order_id AND o.sequence = a.sequence)",
        )
        .await?,
        sequence_type_mismatches: count(
            pool,
            "SELECT count(*) FROM verify_acknowledged a JOIN outbox o
             ON o.aggregate_id = a.order_id AND o.sequence = a.sequence
             WHERE o.event_type <> a.event_type",
        )
        .await?,
        stock_mismatched_products: stock_mismatches(pool).await?,
        ..CheckResults::default()
    };
    for group in groups {
        let counts = group_counts(pool, group).await?;
        results.lost += counts.lost;
        results.duplicate_effects += counts.duplicate_effects;
        results.reorders += counts.reorders;
        results.dead_lettered += counts.dead_lettered;
        results.parked += counts.parked;
        let _ = results.by_group.insert(group.clone(), counts);
    }
    results.retention_removed =
        sqlx::query_as::<_, (String, i64)>("SELECT table_name, total_removed FROM retention_state")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
    results.stale = count(
        pool,
        "SELECT count(*) FROM group_transition WHERE transition = 'stale'",
    )
    .await?;
    results.examples = super::examples::collect(pool, groups).await?;
    Ok(results)
}

/// Copies the acknowledged history into the run's database, so the checks are joins.
async fn store_acknowledged(pool: &PgPool, history: &History) -> anyhow::Result<()> {
    let _ = sqlx::query(
        "CREATE TABLE verify_acknowledged (
             order_id text NOT NULL, sequence bigint NOT NULL, event_type text NOT NULL)",
    )
    .execute(pool)
    .await?;
    for chunk in history.acknowledged.chunks(20_000) {
        let orders: Vec<String> = chunk.iter().map(|e| e.order_id.to_string()).collect();
        let sequences: Vec<i64> = chunk.iter().map(|e| e.sequence).collect();
        let types: Vec<&str> = chunk.iter().map(|e| e.event_type).collect();
        let _ = sqlx::query(
            "INSERT INTO verify_acknowledged
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])",
        )
        .bind(&orders)
        .bind(&sequences)
        .bind(&types)
        .execute(pool)
        .await
        .context("storing the acknowledged history")?;
    }
    let _ = sqlx::query("CREATE INDEX ON verify_acknowledged (order_id, sequence)")
        .execute(pool)
        .await?;
    let _ = sqlx::query("ANALYZE verify_acknowledged")
        .execute(pool)
        .await?;
    Ok(())
}

async fn group_counts(pool: &PgPool, group: &str) -> anyhow::Result<GroupCounts> {
    let one = |sql: String| {
        let group = group.to_owned();
        async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(group)
                .fetch_one(pool)
                .await
                .with_context(|| format!("running {sql}"))
        }
    };
    Ok(GroupCounts {
        applied: one("SELECT count(*) FROM applied_effect WHERE group_name = $1".into()).await?,
        lost: one(format!(
            "WITH expected AS ({EXPECTED_EVENTS}) SELECT count(*) {LOST_EVENTS}"
        ))
        .await?,
        duplicate_effects: one(
            "SELECT count(*) - count(DISTINCT event_id) FROM applied_effect
             WHERE group_name = $1"
                .into(),
        )
        .await?,
        reorders: one(format!("SELECT count(*) {REORDERED_EFFECTS}")).await?,
        dead_lettered: one("SELECT count(*) FROM dead_letter WHERE group_name = $1".into()).await?,
        parked: one("SELECT count(*) FROM parked_event WHERE group_name = $1".into()).await?,
    })
}

/// The inventory's effects are not idempotent by themselves: stock is conserved only if every
/// reservation, release and fulfilment happened exactly once.
async fn stock_mismatches(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM inventory_stock s
         LEFT JOIN (SELECT l.product_id, sum(l.quantity) AS qty FROM inventory_reservation_line l
                    JOIN inventory_reservation r USING (order_id)
                    WHERE r.status = 'fulfilled' GROUP BY l.product_id) f USING (product_id)
         WHERE s.available + s.reserved + COALESCE(f.qty, 0) <> $1",
    )
    .bind(STOCK)
    .fetch_one(pool)
    .await?)
}

async fn count(pool: &PgPool, sql: &str) -> anyhow::Result<i64> {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .with_context(|| format!("running {sql}"))
}

#[cfg(test)]
#[path = "checks_tests.rs"]
mod tests;
