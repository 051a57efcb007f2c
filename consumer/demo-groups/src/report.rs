//! `consumer report`: a snapshot of what the pipeline did, for the run script and for operators.

use std::time::Duration;

use anyhow::Context;
use pipeline_core::kafka::{group_lag, KafkaArgs};
use serde::Serialize;
use sqlx::PgPool;

use crate::cli::ReportArgs;

/// Figures of one consumer group.
#[derive(Debug, Serialize)]
pub struct GroupReport {
    /// The group's name, as its `processed_message` rows carry it.
    pub group: String,
    /// Events the group recorded processed (one `processed_message` row each, any outcome).
    pub processed: i64,
    /// Effects the group recorded applied (`applied_effect` rows).
    pub applied_effects: i64,
    /// Events still parked, waiting for an earlier sequence of their order.
    pub parked: i64,
    /// Events whose outcome is dead-lettered (a replayed one counts as applied).
    pub dead_lettered: i64,
    /// Effects recorded more than once for one event: must be zero.
    pub duplicate_effects: i64,
    /// Messages between committed and end offsets, over partitions with a commit.
    pub lag: i64,
    /// Partitions where the group has not committed yet.
    pub uncommitted_partitions: usize,
    /// Outbox insert to this group's commit, by the database clock, in milliseconds.
    pub e2e_ms_p50: Option<f64>,
    /// The same delay at the 99th percentile, in milliseconds.
    pub e2e_ms_p99: Option<f64>,
}

/// The whole pipeline's figures.
#[derive(Debug, Serialize)]
pub struct PipelineReport {
    /// Orders in the `orders` table.
    pub orders: i64,
    /// Outbox rows not yet published.
    pub outbox_pending: i64,
    /// Outbox rows published to Kafka.
    pub outbox_published: i64,
    /// Outbox rows the relay failed to publish for good.
    pub outbox_failed: i64,
    /// Outbox insert to the relay's mark after the delivery report, in milliseconds.
    pub publish_delay_ms_p50: Option<f64>,
    /// The same delay at the 99th percentile, in milliseconds.
    pub publish_delay_ms_p99: Option<f64>,
    /// One report per requested group, in the order requested.
    pub groups: Vec<GroupReport>,
}

/// Reads the report; `groups` pairs the dedupe name with the Kafka group id.
pub async fn build(
    pool: &PgPool,
    kafka: &KafkaArgs,
    groups: &[(String, String)],
    topics: &[String],
) -> anyhow::Result<PipelineReport> {
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(pool)
        .await?;
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM outbox_status GROUP BY state")
            .fetch_all(pool)
            .await?;
    let state = |s: &str| {
        states
            .iter()
            .find(|(k, _)| k == s)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    };
    let (publish_p50, publish_p99): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP (ORDER BY d)
         FROM (SELECT EXTRACT(EPOCH FROM d.published_at - o.created_at)::float8 * 1000 AS d
               FROM outbox o JOIN outbox_delivery d USING (id)) x",
    )
    .fetch_one(pool)
    .await?;
    let mut out = Vec::new();
    for (name, kafka_group) in groups {
        let (processed, parked, dead): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE outcome = 'parked'),
                    count(*) FILTER (WHERE outcome = 'dead_lettered')
             FROM processed_message WHERE group_name = $1",
        )
        .bind(name)
        .fetch_one(pool)
        .await?;
        let (effects, duplicate_effects): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(sum(n), 0)::bigint, COALESCE(sum(n - 1), 0)::bigint
             FROM (SELECT count(*) AS n FROM applied_effect WHERE group_name = $1 GROUP BY event_id) e",
        )
        .bind(name)
        .fetch_one(pool)
        .await?;
        let (e2e_p50, e2e_p99): (Option<f64>, Option<f64>) = sqlx::query_as(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP (ORDER BY d)
             FROM (SELECT EXTRACT(EPOCH FROM a.applied_at - o.created_at)::float8 * 1000 AS d
                   FROM applied_effect a JOIN outbox o USING (event_id) WHERE a.group_name = $1) x",
        )
        .bind(name)
        .fetch_one(pool)
        .await?;
        let kafka = kafka.clone();
        let kafka_group2 = kafka_group.clone();
        let topics2 = topics.to_vec();
        let lag = tokio::task::spawn_blocking(move || {
            group_lag(&kafka, &kafka_group2, &topics2, Duration::from_secs(10))
        })
        .await
        .context("lag task")??;
        out.push(GroupReport {
            group: name.clone(),
            processed,
            applied_effects: effects,
            parked,
            dead_lettered: dead,
            duplicate_effects,
            lag: lag.iter().filter_map(|p| p.lag()).sum(),
            uncommitted_partitions: lag
                .iter()
                .filter(|p| p.committed.is_none() && p.end > 0)
                .count(),
            e2e_ms_p50: e2e_p50,
            e2e_ms_p99: e2e_p99,
        });
    }
    Ok(PipelineReport {
        orders,
        outbox_pending: state("pending"),
        outbox_published: state("published"),
        outbox_failed: state("failed"),
        publish_delay_ms_p50: publish_p50,
        publish_delay_ms_p99: publish_p99,
        groups: out,
    })
}

/// Runs `consumer report`: prints the report of `args.groups` as a table, or as JSON.
pub async fn run(args: ReportArgs) -> anyhow::Result<()> {
    // Reads only: it changes no table, migrations included.
    let pool = args.db.connect(&[]).await?;
    let groups: Vec<(String, String)> = args
        .groups
        .iter()
        .map(|g| {
            let id = format!("{}{g}", args.group_prefix);
            (id.clone(), id)
        })
        .collect();
    let report = build(&pool, &args.kafka, &groups, &args.topics).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

impl std::fmt::Display for PipelineReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "orders            {}", self.orders)?;
        writeln!(
            f,
            "outbox            published {}  pending {}  failed {}",
            self.outbox_published, self.outbox_pending, self.outbox_failed
        )?;
        writeln!(
            f,
            "publish delay     p50 {}  p99 {}  (outbox insert to published)",
            ms(self.publish_delay_ms_p50),
            ms(self.publish_delay_ms_p99)
        )?;
        writeln!(
            f,
            "{:<14} {:>10} {:>10} {:>7} {:>6} {:>10} {:>6} {:>11} {:>10} {:>10}",
            "group",
            "processed",
            "effects",
            "parked",
            "dead",
            "dup-effect",
            "lag",
            "uncommitted",
            "e2e p50",
            "e2e p99"
        )?;
        for g in &self.groups {
            writeln!(
                f,
                "{:<14} {:>10} {:>10} {:>7} {:>6} {:>10} {:>6} {:>11} {:>10} {:>10}",
                g.group,
                g.processed,
                g.applied_effects,
                g.parked,
                g.dead_lettered,
                g.duplicate_effects,
                g.lag,
                g.uncommitted_partitions,
                ms(g.e2e_ms_p50),
                ms(g.e2e_ms_p99)
            )?;
        }
        Ok(())
    }
}

fn ms(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1} ms"))
        .unwrap_or_else(|| "-".into())
}
