//! Each consumer group draining the topic the relay filled: batched (the default `--max-batch`)
//! and one message per transaction (`--max-batch 1`), one group at a time, each run with fresh
//! consumer tables and a fresh group id.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use chrono::{DateTime, Utc};
use pipeline_testkit::{scrape_sum, TestEnv};
use serde::Serialize;
use uuid::Uuid;

use super::broker::round3;
use super::config::Settings;
use super::dbprofile::{DbActivity, DbProfiler};
use super::procstat::{round1, shared_processes, CpuMeter, CpuUse, Watched};
use super::services::{self, lag, peak_rss, GROUPS};

/// One group's drains.
#[derive(Debug, Clone, Serialize)]
pub struct GroupDrain {
    pub group: String,
    pub batched: DrainRun,
    pub per_message: DrainRun,
    /// batched eps / per-message eps.
    pub batched_vs_per_message: f64,
}

/// One consumer run over the whole topic.
#[derive(Debug, Clone, Serialize)]
pub struct DrainRun {
    pub max_batch: u32,
    pub consumer_args: Vec<String>,
    /// Events in the topic.
    pub events: u64,
    /// Events the group processed in this run.
    pub processed: i64,
    /// Whether the lag reached zero; a run stops at its time limit (`--consumer-max-seconds`,
    /// `--per-message-max-seconds`) and then reports the rate over what it processed.
    pub complete: bool,
    /// From starting the consumer to lag zero (or to the time limit).
    pub seconds: f64,
    /// processed / (seconds - startup_seconds): from the first processed event to lag zero.
    pub eps: f64,
    /// processed / seconds: from process start to lag zero.
    pub eps_from_start: f64,
    /// From starting the consumer to its first processed event (process start, joining the
    /// group, the broker's `group.initial.rebalance.delay.ms`, the first fetch).
    pub startup_seconds: f64,
    /// From the first to the last processed event.
    pub active_seconds: f64,
    pub active_eps: f64,
    /// processed_message outcomes (applied, parked, stale, dead_lettered).
    pub outcomes: BTreeMap<String, i64>,
    pub avg_batch_size: f64,
    pub avg_batch_ms: f64,
    /// Partition batches per database transaction (`consumer_transaction_partition_batches`).
    pub avg_partition_batches_per_transaction: f64,
    pub cpu: CpuUse,
    /// What the group's database connections were doing.
    pub db_activity: DbActivity,
    pub peak_rss_mb: BTreeMap<String, f64>,
}

/// Runs both groups in both modes over `env`'s topic, which holds `events` events.
pub async fn run(
    settings: &Settings,
    env: &mut TestEnv,
    events: u64,
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<GroupDrain>> {
    let mut out = Vec::new();
    for group in GROUPS {
        let batched = drain(
            settings,
            env,
            group,
            settings.consumer_max_batch,
            events,
            notes,
        )
        .await?;
        let per_message = drain(settings, env, group, 1, events, notes).await?;
        out.push(GroupDrain {
            group: group.to_owned(),
            batched_vs_per_message: round1(batched.eps / per_message.eps.max(1e-9)),
            batched,
            per_message,
        });
    }
    Ok(out)
}

/// Empties every consumer-side table and restocks, so each run starts as the first did.
async fn reset_consumer_tables(env: &TestEnv, settings: &Settings) -> anyhow::Result<()> {
    sqlx::query(
        "TRUNCATE processed_message, aggregate_progress, parked_event, parked_record, dead_letter,
                  applied_effect, inventory_stock, inventory_reservation_line,
                  inventory_reservation, notification",
    )
    .execute(&env.pool)
    .await?;
    services::seed_stock(env, settings)?;
    sqlx::query("CHECKPOINT").execute(&env.pool).await?;
    Ok(())
}

async fn drain(
    settings: &Settings,
    env: &mut TestEnv,
    group: &str,
    max_batch: u32,
    events: u64,
    notes: &mut Vec<String>,
) -> anyhow::Result<DrainRun> {
    reset_consumer_tables(env, settings).await?;
    env.group_prefix = format!("b{}-", &Uuid::new_v4().simple().to_string()[..10]);
    let group_id = env.group(group);
    let per_message = max_batch == 1;
    let limit = if per_message {
        settings.per_message_max
    } else {
        settings.consumer_max
    };

    let consumer_args = services::consumer_args(env, &[group], max_batch);
    let spawned = Instant::now();
    let spawned_at = Utc::now();
    let label = format!("consumer-{group}-batch{max_batch}");
    let (mut consumer, metrics) = services::start(
        env,
        "consumer",
        &label,
        &consumer_args,
        "consumer metrics listening on ",
    )
    .await?;
    let mut watched = vec![Watched::Pid(
        "consumer",
        consumer.pid().as_raw().unsigned_abs(),
    )];
    watched.extend(shared_processes());
    let meter = CpuMeter::start(watched);
    let profiler = DbProfiler::start(&env.database_url).await?;
    let complete = loop {
        if lag(env, group)? == Some(0) {
            break true;
        }
        if consumer.exited() {
            bail!("{label} exited (log: {})", consumer.log_path.display());
        }
        if spawned.elapsed() > limit {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let seconds = spawned.elapsed().as_secs_f64();
    let cpu = meter.finish();
    let db_activity = profiler.finish().await;
    let outcomes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT outcome, count(*) FROM processed_message WHERE group_name = $1 GROUP BY outcome",
    )
    .bind(&group_id)
    .fetch_all(&env.pool)
    .await?;
    let outcomes: BTreeMap<String, i64> = outcomes.into_iter().collect();
    let processed: i64 = outcomes.values().sum();
    let cpu = db_activity
        .charge_sampler(cpu)
        .with_events(u64::try_from(processed)?);
    let (first, last): (Option<DateTime<Utc>>, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT min(processed_at), max(processed_at) FROM processed_message WHERE group_name = $1",
    )
    .bind(&group_id)
    .fetch_one(&env.pool)
    .await?;
    let peak_rss_mb = peak_rss(&[("consumer", &consumer)]);
    let labels = [format!("group=\"{group_id}\"")];
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    let batches = scrape_sum(&metrics, "consumer_batch_size_count", &labels).await?;
    let batch_events = scrape_sum(&metrics, "consumer_batch_size_sum", &labels).await?;
    let batch_seconds =
        scrape_sum(&metrics, "consumer_batch_duration_seconds_sum", &labels).await?;
    let transactions = scrape_sum(
        &metrics,
        "consumer_transaction_partition_batches_count",
        &labels,
    )
    .await?;
    let shared_batches = scrape_sum(
        &metrics,
        "consumer_transaction_partition_batches_sum",
        &labels,
    )
    .await?;
    notes.extend(services::stop(consumer).await);

    for (outcome, n) in &outcomes {
        if outcome != "applied" {
            notes.push(format!(
                "{group} --max-batch {max_batch}: {n} events {outcome}"
            ));
        }
    }
    if !complete && !per_message {
        notes.push(format!(
            "{group} --max-batch {max_batch}: not drained within {limit:?} ({processed} of {events} \
             events); rate taken over what it processed"
        ));
    }
    if complete && processed != i64::try_from(events)? {
        notes.push(format!(
            "{group} --max-batch {max_batch}: lag 0 but {processed} of {events} events processed"
        ));
    }
    let seconds_between =
        |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_microseconds().unwrap_or(0) as f64 / 1e6;
    let startup_seconds = first.map_or(0.0, |f| seconds_between(spawned_at, f));
    let active_seconds = match (first, last) {
        (Some(f), Some(l)) => seconds_between(f, l),
        _ => 0.0,
    };
    Ok(DrainRun {
        max_batch,
        consumer_args,
        events,
        processed,
        complete,
        seconds: round3(seconds),
        eps: (processed as f64 / (seconds - startup_seconds).max(1e-3)).round(),
        eps_from_start: (processed as f64 / seconds).round(),
        startup_seconds: round3(startup_seconds),
        active_seconds: round3(active_seconds),
        active_eps: if active_seconds > 0.0 {
            (processed as f64 / active_seconds).round()
        } else {
            0.0
        },
        outcomes,
        avg_batch_size: round1(batch_events / batches.max(1.0)),
        avg_batch_ms: round1(batch_seconds * 1000.0 / batches.max(1.0)),
        avg_partition_batches_per_transaction: if transactions > 0.0 {
            round1(shared_batches / transactions)
        } else {
            1.0
        },
        cpu,
        db_activity,
        peak_rss_mb,
    })
}
