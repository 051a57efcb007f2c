//! End-to-end latency at fixed open-loop rates: from the moment each order-service request was
//! due to the moment each consumer group applied its event, in the database's clock.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use pipeline_load::figures::{micros_histogram, quantile_ms};
use pipeline_testkit::TestEnv;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::broker_latency::{self, BrokerLatency};
use super::config::Settings;
use super::cpuprofile::{self, ProcessProfile};
use super::dbprofile::{DbActivity, DbProfiler};
use super::driver::{drive, DriveSpec, DriveSummary, SentEvent};
use super::envs::EnvRegistry;
use super::procstat::{CpuMeter, CpuUse};
use super::services::{self, Pipeline, GROUPS};

/// One rate's figures.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRun {
    pub rate: f64,
    pub warmup_seconds: f64,
    pub measured_seconds: f64,
    pub relay_args: Vec<String>,
    pub consumer_args: Vec<String>,
    pub requests: DriveSummary,
    /// Database clock − local clock, subtracted from nothing but added to intended times.
    pub clock_offset_ms: f64,
    pub groups: BTreeMap<String, GroupLatency>,
    /// CPU while the driver ran.
    pub cpu: CpuUse,
    /// What the pipeline's database connections were doing while the driver ran.
    pub db_activity: DbActivity,
    /// Where each process's CPU went while the driver ran, by function (empty: not taken).
    pub cpu_profiles: BTreeMap<String, ProcessProfile>,
    pub peak_rss_mb: BTreeMap<String, f64>,
    /// The broker alone at the same rate, measured just before the pipeline (None if it failed;
    /// the notes say why).
    pub broker: Option<BrokerLatency>,
}

/// Latencies of one group at one rate, in ms.
#[derive(Debug, Clone, Serialize)]
pub struct GroupLatency {
    /// Measured events the group applied.
    pub events: u64,
    /// Measured events it never applied.
    pub missing: u64,
    /// What became of (up to five of) them.
    pub missing_detail: Vec<String>,
    /// processed_message outcomes of the whole run (applied, parked, stale, dead_lettered).
    pub outcomes: BTreeMap<String, i64>,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub e2e_p999_ms: f64,
    pub e2e_max_ms: f64,
    /// Intended send → outbox row written: HTTP and the order service's transaction.
    pub service_p50_ms: f64,
    pub service_p99_ms: f64,
    /// Outbox row written → marked published: the relay's claim, produce, acks and mark.
    pub relay_p50_ms: f64,
    pub relay_p99_ms: f64,
    /// Outbox row written → applied by this group.
    pub outbox_to_applied_p50_ms: f64,
    pub outbox_to_applied_p99_ms: f64,
}

/// Runs every rate of `settings.rates`, each in a fresh environment.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<LatencyRun>> {
    let mut runs = Vec::new();
    for &rate in &settings.rates {
        let env = envs
            .create(&format!("bench_e2e_{}", rate.round()), settings.partitions)
            .await?;
        let result = measure(settings, envs, &env, rate, notes).await;
        let odd = result
            .as_ref()
            .is_ok_and(|r| r.groups.values().any(|g| g.missing > 0));
        if odd {
            notes.push(envs.retain(&env));
            env.pool.close().await;
        } else {
            notes.extend(envs.release(env).await);
        }
        runs.push(result?);
    }
    Ok(runs)
}

async fn measure(
    settings: &Settings,
    envs: &EnvRegistry,
    env: &TestEnv,
    rate: f64,
    notes: &mut Vec<String>,
) -> anyhow::Result<LatencyRun> {
    let broker = match broker_latency::measure(settings, envs, rate).await {
        Ok(b) => {
            notes.extend(envs.release_topic(&b.topic).await);
            Some(b)
        }
        Err(e) => {
            notes.push(format!("{rate}/s: broker alone not measured: {e:#}"));
            None
        }
    };
    let pipeline = Pipeline::start(env, settings).await?;
    let offset_us = db_clock_offset_us(env).await?;
    let spec = DriveSpec {
        rate,
        warmup: settings.warmup,
        measure: settings.rate_duration,
        products: settings.products,
        max_in_flight: settings.max_in_flight,
    };
    let meter = CpuMeter::start(pipeline.watched());
    let label = format!("latency-{}", rate.round());
    let cpu_profiler = cpuprofile::begin(settings.cpu_profiles.as_deref(), &label, notes).await;
    let profiler = DbProfiler::start(&env.database_url).await?;
    let url = pipeline.url.parse()?;
    let outcome = drive(&url, &spec, &CancellationToken::new()).await?;
    // Every request is one event.
    let cpu = meter.finish();
    let cpu_profiles = cpuprofile::end(cpu_profiler, &pipeline.watched(), notes).await;
    let db_activity = profiler.finish().await;
    let cpu = db_activity.charge_sampler(cpu).with_events(outcome.ok);
    env.wait_drained(&GROUPS, settings.drain_timeout).await?;
    let peak_rss_mb = pipeline.peak_rss();
    let consumer_args = pipeline.consumer_args.clone();
    notes.extend(pipeline.stop().await);

    // Streamed from the write-ahead log, an event has no delivery record: its publish time is
    // its Kafka record's (the producer's send time, in milliseconds).
    let kafka_times = if settings.relay_source == "wal" {
        kafka_record_times(env).await?
    } else {
        HashMap::new()
    };
    let mut groups = BTreeMap::new();
    for group in GROUPS {
        let latency = group_latency(
            env,
            &env.group(group),
            &outcome.measured,
            offset_us,
            &kafka_times,
        )
        .await?;
        if latency.missing > 0 {
            notes.push(format!(
                "{rate}/s: {group} never applied {} measured events: {}",
                latency.missing,
                latency.missing_detail.join("; ")
            ));
        }
        for (outcome, n) in &latency.outcomes {
            if outcome != "applied" {
                notes.push(format!("{rate}/s: {group}: {n} events {outcome}"));
            }
        }
        let _ = groups.insert(group.to_owned(), latency);
    }
    Ok(LatencyRun {
        rate,
        warmup_seconds: settings.warmup.as_secs_f64(),
        measured_seconds: settings.rate_duration.as_secs_f64(),
        relay_args: services::relay_args(settings),
        consumer_args,
        requests: DriveSummary::of(&outcome),
        clock_offset_ms: offset_us as f64 / 1000.0,
        groups,
        cpu,
        db_activity,
        cpu_profiles,
        peak_rss_mb,
        broker,
    })
}

fn now_us() -> i64 {
    Utc::now().timestamp_micros()
}

/// Database clock − local clock, in µs: `clock_timestamp()` against the midpoint of the local
/// clock around the query, from the fastest of a few round trips.
pub async fn db_clock_offset_us(env: &TestEnv) -> anyhow::Result<i64> {
    let mut best: Option<(i64, i64)> = None;
    for _ in 0..7 {
        let before = now_us();
        let db: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&env.pool)
            .await?;
        let after = now_us();
        let (rtt, offset) = (after - before, db.timestamp_micros() - (before + after) / 2);
        if best.is_none_or(|(r, _)| rtt < r) {
            best = Some((rtt, offset));
        }
    }
    Ok(best.map_or(0, |(_, offset)| offset))
}

type AppliedRow = (
    String,
    i64,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
    Uuid,
);

/// Each event's Kafka record timestamp on `env`'s topic (µs since the epoch), by event id.
async fn kafka_record_times(env: &TestEnv) -> anyhow::Result<HashMap<Uuid, i64>> {
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE topic = $1")
        .bind(&env.topic)
        .fetch_one(&env.pool)
        .await?;
    let kafka = pipeline_core::kafka::KafkaArgs {
        kafka_brokers: env.brokers.clone(),
        kafka_options: env.kafka_options.clone(),
    };
    let topic = env.topic.clone();
    let records = tokio::task::spawn_blocking(move || {
        pipeline_testkit::kafka::read_topic(
            &kafka,
            &topic,
            usize::try_from(events).unwrap_or(0),
            std::time::Duration::from_secs(60),
        )
    })
    .await??;
    use rdkafka::message::Message;
    Ok(records
        .iter()
        .filter_map(|r| {
            let envelope =
                pipeline_core::envelope::Envelope::from_record(r.key(), r.headers()).ok()?;
            Some((envelope.event_id, r.timestamp().to_millis()? * 1000))
        })
        .collect())
}

/// Latencies of `group_id` for the `measured` events.
async fn group_latency(
    env: &TestEnv,
    group_id: &str,
    measured: &[SentEvent],
    offset_us: i64,
    kafka_times: &HashMap<Uuid, i64>,
) -> anyhow::Result<GroupLatency> {
    let intended: HashMap<(Uuid, i64), i64> = measured
        .iter()
        .map(|e| ((e.order_id, e.sequence), e.intended_us + offset_us))
        .collect();
    let rows: Vec<AppliedRow> = sqlx::query_as(
        "SELECT a.aggregate_id, a.sequence, o.created_at, d.published_at, a.applied_at, o.event_id
         FROM applied_effect a JOIN outbox o ON o.event_id = a.event_id
         LEFT JOIN outbox_delivery d ON d.id = o.id
         WHERE a.group_name = $1",
    )
    .bind(group_id)
    .fetch_all(&env.pool)
    .await?;
    let (mut e2e, mut service, mut relay, mut to_applied) = (
        micros_histogram(),
        micros_histogram(),
        micros_histogram(),
        micros_histogram(),
    );
    let record = |h: &mut Histogram<u64>, us: i64| {
        h.saturating_record(u64::try_from(us).unwrap_or(0));
    };
    let mut seen: HashSet<(Uuid, i64)> = HashSet::new();
    for (order_id, sequence, created, published, applied, event_id) in rows {
        let Ok(order_id) = Uuid::parse_str(&order_id) else {
            continue;
        };
        let Some(&due) = intended.get(&(order_id, sequence)) else {
            continue;
        };
        let _ = seen.insert((order_id, sequence));
        let (created, applied) = (created.timestamp_micros(), applied.timestamp_micros());
        record(&mut e2e, applied - due);
        record(&mut service, created - due);
        record(&mut to_applied, applied - created);
        let published = published
            .map(|p| p.timestamp_micros())
            .or_else(|| kafka_times.get(&event_id).copied());
        if let Some(published) = published {
            record(&mut relay, published - created);
        }
    }
    let missing: Vec<(Uuid, i64)> = intended
        .keys()
        .filter(|k| !seen.contains(k))
        .copied()
        .collect();
    let mut missing_detail = Vec::new();
    for &(order_id, sequence) in missing.iter().take(5) {
        missing_detail.push(what_became_of(env, group_id, order_id, sequence).await?);
    }
    let outcomes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT outcome, count(*) FROM processed_message WHERE group_name = $1 GROUP BY outcome",
    )
    .bind(group_id)
    .fetch_all(&env.pool)
    .await?;
    Ok(GroupLatency {
        events: seen.len() as u64,
        missing: missing.len() as u64,
        missing_detail,
        outcomes: outcomes.into_iter().collect(),
        e2e_p50_ms: quantile_ms(&e2e, 0.5),
        e2e_p99_ms: quantile_ms(&e2e, 0.99),
        e2e_p999_ms: quantile_ms(&e2e, 0.999),
        e2e_max_ms: quantile_ms(&e2e, 1.0),
        service_p50_ms: quantile_ms(&service, 0.5),
        service_p99_ms: quantile_ms(&service, 0.99),
        relay_p50_ms: quantile_ms(&relay, 0.5),
        relay_p99_ms: quantile_ms(&relay, 0.99),
        outbox_to_applied_p50_ms: quantile_ms(&to_applied, 0.5),
        outbox_to_applied_p99_ms: quantile_ms(&to_applied, 0.99),
    })
}

type Trace = (
    uuid::Uuid,
    String,
    String,
    Option<i32>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// One line on an event a group never applied: its outbox row, Kafka position and what the
/// group recorded for it.
async fn what_became_of(
    env: &TestEnv,
    group_id: &str,
    order_id: Uuid,
    sequence: i64,
) -> anyhow::Result<String> {
    let row: Option<Trace> = sqlx::query_as(
        "SELECT o.event_id, o.event_type, o.state, o.kafka_partition, o.kafka_offset, pm.outcome,
                (SELECT d.reason FROM dead_letter d
                 WHERE d.group_name = $1 AND d.event_id = o.event_id LIMIT 1),
                pe.reason
         FROM outbox_status o
         LEFT JOIN processed_message pm ON pm.group_name = $1 AND pm.event_id = o.event_id
         LEFT JOIN parked_event pe ON pe.group_name = $1 AND pe.event_id = o.event_id
         WHERE o.aggregate_id = $2 AND o.sequence = $3",
    )
    .bind(group_id)
    .bind(order_id.to_string())
    .bind(sequence)
    .fetch_optional(&env.pool)
    .await?;
    Ok(match row {
        None => format!("order {order_id} seq {sequence}: answered OK but no outbox row"),
        Some((event_id, kind, state, partition, offset, outcome, dead, parked)) => format!(
            "order {order_id} seq {sequence} ({kind}, event {event_id}): outbox {state} at \
             partition {partition:?} offset {offset:?}; processed_message {outcome:?}; \
             dead letter {dead:?}; parked {parked:?}"
        ),
    })
}
