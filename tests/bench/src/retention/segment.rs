//! One stretch of steady load on the running pipeline, retention off or on: what it did to
//! latency, to the relay's claim and the consumers' transactions, and what retention removed
//! meanwhile.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pipeline_testkit::{Service, TestEnv};
use reqwest::Url;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::applied::{AppliedWatch, Latencies};
use super::background::{BackgroundWatch, MinuteBackground};
use super::histogram::{Buckets, HistogramFigures};
use super::locks::LockWaits;
use super::processes::{removed_since, retention_series, rows_removed, Process};
use super::server_writes::{Counters, ServerWrites};
use super::sizes::{self, Sizes};
use crate::config::Settings;
use crate::dbprofile::{DbActivity, DbProfiler};
use crate::driver::{drive, DriveSpec, DriveSummary};
use crate::latency::db_clock_offset_us;
use crate::procstat::{shared_processes, CpuMeter, CpuUse, Watched};
use crate::services::{peak_rss, GROUPS};

/// The figures of one segment.
#[derive(Debug, Clone, Serialize)]
pub struct Segment {
    pub retention: bool,
    pub rate: f64,
    pub warmup_seconds: f64,
    pub measured_seconds: f64,
    pub relay_args: Vec<String>,
    pub consumer_args: Vec<String>,
    pub requests: DriveSummary,
    pub clock_offset_ms: f64,
    /// Intended send → applied, per group, from the effects as they were applied.
    pub latency: Latencies,
    /// The consumer's own `pipeline_end_to_end_latency_seconds` (outbox row → group's commit)
    /// over the measured part, by group.
    pub consumer_e2e: BTreeMap<String, HistogramFigures>,
    /// `consumer_db_transaction_duration_seconds` over the measured part, by group.
    pub consumer_transaction: BTreeMap<String, HistogramFigures>,
    /// The relay's `relay_batch_stage_seconds` over the measured part, by stage (claim,
    /// produce, mark): the claim is the statement retention could slow down.
    pub relay_stages: BTreeMap<String, HistogramFigures>,
    /// Rows retention removed over the measured part, by table (relay and consumer).
    pub rows_removed: BTreeMap<String, f64>,
    /// Rows retention removed since the relay and the consumer started, by table.
    pub rows_removed_since_start: BTreeMap<String, f64>,
    /// Every `retention_*` series of the relay and the consumer at the end.
    pub retention_metrics: BTreeMap<String, f64>,
    pub cpu: CpuUse,
    pub db_activity: DbActivity,
    pub peak_rss_mb: BTreeMap<String, f64>,
    /// Lock waits over the segment (set by the caller, who watches them).
    pub lock_waits: LockWaits,
    /// Autovacuum and the checkpointer by the minute, on the minutes of `latency.by_minute`.
    pub background: Vec<MinuteBackground>,
    /// WAL, checkpoints and block reads over the measured part.
    pub server_writes: ServerWrites,
}

/// The order service and the relay the load goes through.
pub struct Running<'a> {
    pub env: &'a TestEnv,
    pub order_service: &'a Service,
    pub url: &'a Url,
    pub relay: &'a Process,
}

impl Running<'_> {
    /// The processes whose CPU counts, with `consumer`.
    pub fn watched(&self, consumer: &Process) -> Vec<Watched> {
        let pid = |s: &Service| s.pid().as_raw().unsigned_abs();
        let mut w = vec![
            Watched::Pid("order-service", pid(self.order_service)),
            Watched::Pid("relay", pid(&self.relay.service)),
            Watched::Pid("consumer", pid(&consumer.service)),
        ];
        w.extend(shared_processes());
        w
    }

    /// The relay's and `consumer`'s metrics pages.
    async fn pages(&self, consumer: &Process) -> anyhow::Result<(String, String)> {
        Ok((self.relay.page().await?, consumer.page().await?))
    }
}

/// Drives the pipeline (`running` and `consumer`) at the phase's rate for `duration` (after the
/// warm-up) and waits until every event is applied; returns the figures and the sizes halfway
/// through. `phase_started` is the phase's clock.
pub async fn run(
    settings: &Settings,
    running: &Running<'_>,
    consumer: &Process,
    retention: bool,
    duration: Duration,
    phase_started: Instant,
) -> anyhow::Result<(Segment, Sizes)> {
    let env = running.env;
    let rate = settings.retention.rate;
    let offset_us = db_clock_offset_us(env).await?;
    let groups: Vec<(String, String)> = GROUPS
        .iter()
        .map(|g| ((*g).to_owned(), env.group(g)))
        .collect();
    let watch = AppliedWatch::start(&env.pool, groups.clone()).await?;
    let spec = DriveSpec {
        rate,
        warmup: settings.warmup,
        measure: duration,
        products: settings.products,
        max_in_flight: settings.max_in_flight,
    };
    let meter = CpuMeter::start(running.watched(consumer));
    let profiler = DbProfiler::start(&env.database_url).await?;
    let background = BackgroundWatch::start(&env.database_url, settings.warmup).await?;
    let stop = CancellationToken::new();
    // The metrics and the server's counters at the end of the warm-up, and the sizes halfway
    // through.
    let observe = async {
        tokio::time::sleep(settings.warmup).await;
        let before = running.pages(consumer).await;
        let counters = Counters::read(&env.pool).await;
        tokio::time::sleep(duration / 2).await;
        let mid = sizes::read(&env.pool, phase_started.elapsed().as_secs_f64()).await;
        (before, counters, mid)
    };
    let (outcome, (before, counters_before, mid)) =
        tokio::join!(drive(running.url, &spec, &stop), observe);
    let outcome = outcome?;
    let (before, counters_before, mid) = (before?, counters_before?, mid?);
    let after = running.pages(consumer).await?;
    let server_writes = ServerWrites::between(
        &counters_before,
        &Counters::read(&env.pool).await?,
        outcome.measured.len() as u64,
    );
    let cpu = meter.finish().with_events(outcome.ok);
    let db_activity = profiler.finish().await;
    let background = background.finish().await;
    env.wait_drained(&GROUPS, settings.drain_timeout).await?;
    let latency = watch.finish(&outcome.measured, offset_us).await?;

    let mut consumer_e2e = BTreeMap::new();
    let mut consumer_transaction = BTreeMap::new();
    for (kind, id) in &groups {
        let label = format!("group=\"{id}\"");
        let _ = consumer_e2e.insert(
            kind.clone(),
            observed(
                &after.1,
                &before.1,
                "pipeline_end_to_end_latency_seconds",
                &label,
            ),
        );
        let _ = consumer_transaction.insert(
            kind.clone(),
            observed(
                &after.1,
                &before.1,
                "consumer_db_transaction_duration_seconds",
                &label,
            ),
        );
    }
    let relay_stages = ["claim", "produce", "mark"]
        .iter()
        .map(|stage| {
            let label = format!("stage=\"{stage}\"");
            (
                (*stage).to_owned(),
                observed(&after.0, &before.0, "relay_batch_stage_seconds", &label),
            )
        })
        .collect();
    let mut rows_removed_total = removed_since(&rows_removed(&before.0), &rows_removed(&after.0));
    for (table, n) in removed_since(&rows_removed(&before.1), &rows_removed(&after.1)) {
        *rows_removed_total.entry(table).or_insert(0.0) += n;
    }
    let mut rows_removed_since_start = rows_removed(&after.0);
    for (table, n) in rows_removed(&after.1) {
        *rows_removed_since_start.entry(table).or_insert(0.0) += n;
    }
    let mut retention_metrics = BTreeMap::new();
    for (process, page) in [("relay", &after.0), ("consumer", &after.1)] {
        for (series, value) in retention_series(page) {
            let _ = retention_metrics.insert(format!("{process} {series}"), value);
        }
    }
    let segment = Segment {
        retention,
        rate,
        warmup_seconds: settings.warmup.as_secs_f64(),
        measured_seconds: duration.as_secs_f64(),
        relay_args: running.relay.args.clone(),
        consumer_args: consumer.args.clone(),
        requests: DriveSummary::of(&outcome),
        clock_offset_ms: offset_us as f64 / 1000.0,
        latency,
        consumer_e2e,
        consumer_transaction,
        relay_stages,
        rows_removed: rows_removed_total,
        rows_removed_since_start,
        retention_metrics,
        cpu,
        db_activity,
        peak_rss_mb: peak_rss(&[
            ("order-service", running.order_service),
            ("relay", &running.relay.service),
            ("consumer", &consumer.service),
        ]),
        lock_waits: LockWaits::default(),
        background,
        server_writes,
    };
    Ok((segment, mid))
}

/// What a histogram of seconds observed between two pages of one process, in ms.
fn observed(after: &str, before: &str, metric: &str, label: &str) -> HistogramFigures {
    Buckets::read(after, metric, &[label])
        .since(&Buckets::read(before, metric, &[label]))
        .seconds_as_ms()
}
