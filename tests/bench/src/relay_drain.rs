//! The relay draining a preloaded outbox backlog into a fresh topic.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use chrono::{DateTime, Utc};
use pipeline_testkit::{metric_sum, scrape, scrape_sum, TestEnv};
use serde::Serialize;

use super::broker::{round3, BrokerResult};
use super::config::Settings;
use super::dbprofile::{DbActivity, DbProfiler};
use super::envs::EnvRegistry;
use super::orders::{preload_outbox, EVENTS_PER_ORDER};
use super::procstat::{round1, shared_processes, CpuMeter, CpuUse, Watched};
use super::services::{self, peak_rss};

/// How fast the relay emptied the outbox.
#[derive(Debug, Clone, Serialize)]
pub struct RelayResult {
    pub events: u64,
    pub orders: u64,
    pub partitions: i32,
    /// Average bytes of the payloads as the relay reads them (`payload::text`).
    pub payload_bytes: f64,
    pub preload_seconds: f64,
    /// `relay` arguments (the rest are its defaults).
    pub relay_args: Vec<String>,
    /// From the commit that made the backlog visible to the running relay until its metrics
    /// count every event published (polled every 10 ms).
    pub drain_seconds: f64,
    /// From starting the relay process to it holding the lock (`relay_active` 1): process start,
    /// migrations, connections, producer, leader lock.
    pub startup_seconds: f64,
    /// events / drain_seconds.
    pub relay_drain_eps: f64,
    /// From the first to the last `published_at`: the relay's own work, without start-up.
    pub active_seconds: f64,
    pub relay_active_eps: f64,
    /// relay_drain_eps / broker produce_eps of this run.
    pub relay_vs_broker: Option<f64>,
    /// relay_drain_eps / the broker's relay-like batched produce eps.
    pub relay_vs_broker_batched: Option<f64>,
    pub batches: f64,
    pub avg_batch_size: f64,
    pub avg_batch_ms: f64,
    pub cpu: CpuUse,
    /// What the relay's database connections were doing.
    pub db_activity: DbActivity,
    pub peak_rss_mb: BTreeMap<String, f64>,
}

/// Starts the relay, commits the backlog in one transaction while it runs, waits until it has
/// published every event, and returns the environment (its topic now holds the events) for the
/// consumer phase.
///
/// The relay is already running and active, its producer warm, when the backlog appears: the
/// drain is timed from that commit to the last event marked published, as for a running relay
/// hit by a burst or a warm standby taking over a backlog. Process start is reported apart.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    broker: Option<&BrokerResult>,
    notes: &mut Vec<String>,
) -> anyhow::Result<(RelayResult, TestEnv)> {
    let env = envs.create("bench_relay", settings.partitions).await?;
    let orders = settings.backlog.div_ceil(EVENTS_PER_ORDER as u64);

    let relay_args = services::relay_args(settings);
    let spawned = Instant::now();
    let (mut relay, metrics) = services::start_relay(&env, settings).await?;
    while scrape_sum(&metrics, "relay_active", &[]).await? < 1.0 {
        if spawned.elapsed() > Duration::from_secs(60) || relay.exited() {
            bail!(
                "relay not active 60 s after start (log: {})",
                relay.log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let startup_seconds = spawned.elapsed().as_secs_f64();

    let mut backlog = env.pool.begin().await?;
    let started = Instant::now();
    let events = preload_outbox(&mut backlog, &env.topic, orders, settings.products).await?;
    let preload_seconds = started.elapsed().as_secs_f64();
    let payload_bytes: f64 =
        sqlx::query_scalar("SELECT avg(octet_length(payload::text))::float8 FROM outbox")
            .fetch_one(&mut *backlog)
            .await?;
    // The preload's dirty pages are written now, not during the drain.
    sqlx::query("CHECKPOINT").execute(&env.pool).await?;

    let mut watched = vec![Watched::Pid("relay", relay.pid().as_raw().unsigned_abs())];
    watched.extend(shared_processes());
    let meter = CpuMeter::start(watched);
    let profiler = DbProfiler::start(&env.database_url).await?;
    let committed = Instant::now();
    backlog.commit().await?;
    let deadline = committed + settings.drain_timeout;
    loop {
        // One scrape a round: the relay renders its metrics while it drains.
        let page = scrape(&metrics).await?;
        let published = metric_sum(&page, "outbox_published_total", &["outcome=\"published\""]);
        if published >= events as f64 {
            break;
        }
        let failed = metric_sum(&page, "outbox_published_total", &["outcome=\"failed\""]);
        if failed > 0.0 {
            bail!(
                "{failed} events failed for good (log: {})",
                relay.log_path.display()
            );
        }
        if Instant::now() > deadline || relay.exited() {
            bail!(
                "relay did not drain {events} events within {:?} (log: {})",
                settings.drain_timeout,
                relay.log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drain_seconds = committed.elapsed().as_secs_f64();
    let cpu = meter.finish();
    let db_activity = profiler.finish().await;
    let cpu = db_activity.charge_sampler(cpu).with_events(events);
    let peak_rss_mb = peak_rss(&[("relay", &relay)]);

    let batches = scrape_sum(&metrics, "relay_batch_size_count", &[]).await?;
    let batch_events = scrape_sum(&metrics, "relay_batch_size_sum", &[]).await?;
    let batch_seconds = scrape_sum(&metrics, "relay_batch_duration_seconds_sum", &[]).await?;
    notes.extend(services::stop(relay).await);

    let (first, last, unpublished): (Option<DateTime<Utc>>, Option<DateTime<Utc>>, i64) =
        sqlx::query_as(
            "SELECT min(published_at), max(published_at),
                    (SELECT count(*) FROM outbox_unpublished)
             FROM outbox_delivery",
        )
        .fetch_one(&env.pool)
        .await?;
    if unpublished > 0 {
        bail!("{unpublished} events left unpublished (failed)");
    }
    let active_seconds = match (first, last) {
        (Some(f), Some(l)) => (l - f).num_microseconds().unwrap_or(0) as f64 / 1e6,
        _ => 0.0,
    };
    let n = events as f64;
    let relay_drain_eps = (n / drain_seconds.max(1e-3)).round();
    let result = RelayResult {
        events,
        orders,
        partitions: settings.partitions,
        payload_bytes: round1(payload_bytes),
        preload_seconds: round3(preload_seconds),
        relay_args,
        drain_seconds: round3(drain_seconds),
        startup_seconds: round3(startup_seconds),
        relay_drain_eps,
        active_seconds: round3(active_seconds),
        relay_active_eps: if active_seconds > 0.0 {
            (n / active_seconds).round()
        } else {
            0.0
        },
        relay_vs_broker: broker.map(|b| round3(relay_drain_eps / b.produce_eps)),
        relay_vs_broker_batched: broker.map(|b| round3(relay_drain_eps / b.produce_batched_eps)),
        batches,
        avg_batch_size: round1(batch_events / batches.max(1.0)),
        avg_batch_ms: round1(batch_seconds * 1000.0 / batches.max(1.0)),
        cpu,
        db_activity,
        peak_rss_mb,
    };
    Ok((result, env))
}
