//! A consumer catching up: with the consumer stopped, the load piles events up on the topic
//! (the relay keeps publishing), then a consumer starts and empties both groups' backlog. Its
//! rate is read from its own counters every 100 ms, since retention may already have removed
//! the first events' dedupe rows by the time the drain ends.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use pipeline_testkit::{metric_sum, wait_until};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::locks::LockWaits;
use super::processes::{start_consumer, Process};
use super::segment::Running;
use crate::config::Settings;
use crate::dbprofile::{DbActivity, DbProfiler};
use crate::driver::{drive, DriveSpec};
use crate::procstat::{round1, CpuMeter, CpuUse};
use crate::services::{lag, GROUPS};

const POLL_EVERY: Duration = Duration::from_millis(100);

/// One drain.
#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    pub retention: bool,
    pub consumer_args: Vec<String>,
    /// Requests that went through while the consumer was stopped.
    pub events_sent: u64,
    pub groups: BTreeMap<String, GroupDrain>,
    /// From starting the consumer until both groups were through.
    pub seconds: f64,
    pub cpu: CpuUse,
    pub db_activity: DbActivity,
    /// Lock waits over the drain and the load before it (set by the caller, who watches them).
    pub lock_waits: LockWaits,
}

/// One group's drain.
#[derive(Debug, Clone, Serialize)]
pub struct GroupDrain {
    /// The group's lag when the consumer started.
    pub backlog: i64,
    /// From starting the consumer to its first message of the group handled.
    pub startup_seconds: f64,
    /// From starting the consumer to the whole backlog handled.
    pub seconds: f64,
    /// backlog / (seconds − startup_seconds).
    pub eps: f64,
    /// backlog / seconds.
    pub eps_from_start: f64,
}

/// Piles up the phase's drain events with no consumer running (the relay in `running` publishes
/// them), then starts a consumer (retention as given) and times it through the backlog. Returns
/// the figures and the consumer, still running.
pub async fn run(
    settings: &Settings,
    running: &Running<'_>,
    retention: bool,
    label: &str,
) -> anyhow::Result<(Drain, Process)> {
    let env = running.env;
    let rate = settings.retention.rate;
    let spec = DriveSpec {
        rate,
        warmup: Duration::ZERO,
        measure: Duration::from_secs_f64(settings.retention.drain_events as f64 / rate),
        products: settings.products,
        max_in_flight: settings.max_in_flight,
    };
    let outcome = drive(running.url, &spec, &CancellationToken::new()).await?;
    wait_until("outbox published", settings.drain_timeout, || async {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
            .fetch_one(&env.pool)
            .await?;
        Ok((pending == 0).then_some(()))
    })
    .await?;
    let mut backlog = BTreeMap::new();
    for kind in GROUPS {
        let _ = backlog.insert(kind, lag(env, kind)?.unwrap_or(0));
    }

    let spawned = Instant::now();
    let mut consumer = start_consumer(env, settings, retention, label, false).await?;
    let meter = CpuMeter::start(running.watched(&consumer));
    let profiler = DbProfiler::start(&env.database_url).await?;
    let mut first: BTreeMap<&str, f64> = BTreeMap::new();
    let mut done: BTreeMap<&str, f64> = BTreeMap::new();
    while done.len() < GROUPS.len() {
        if spawned.elapsed() > settings.drain_timeout || consumer.service.exited() {
            bail!(
                "{label} did not drain {backlog:?} within {:?} (log: {})",
                settings.drain_timeout,
                consumer.service.log_path.display()
            );
        }
        tokio::time::sleep(POLL_EVERY).await;
        let Ok(page) = consumer.page().await else {
            continue;
        };
        let t = spawned.elapsed().as_secs_f64();
        for kind in GROUPS {
            let group = format!("group=\"{}\"", env.group(kind));
            let handled = metric_sum(&page, "consumer_messages_total", &[&group])
                - metric_sum(
                    &page,
                    "consumer_messages_total",
                    &[&group, "outcome=\"unparked\""],
                );
            if handled > 0.0 {
                let _ = first.entry(kind).or_insert(t);
            }
            if handled >= backlog.get(kind).copied().unwrap_or(0) as f64 {
                let _ = done.entry(kind).or_insert(t);
            }
        }
    }
    let seconds = spawned.elapsed().as_secs_f64();
    let cpu = meter.finish().with_events(outcome.ok);
    let db_activity = profiler.finish().await;
    let groups = GROUPS
        .iter()
        .map(|&kind| {
            let n = backlog.get(kind).copied().unwrap_or(0);
            let end = done.get(kind).copied().unwrap_or(seconds);
            let start = first.get(kind).copied().unwrap_or(end);
            (
                kind.to_owned(),
                GroupDrain {
                    backlog: n,
                    startup_seconds: round1(start),
                    seconds: round1(end),
                    eps: (n as f64 / (end - start).max(1e-3)).round(),
                    eps_from_start: (n as f64 / end.max(1e-3)).round(),
                },
            )
        })
        .collect();
    let drain = Drain {
        retention,
        consumer_args: consumer.args.clone(),
        events_sent: outcome.ok,
        groups,
        seconds: round1(seconds),
        cpu,
        db_activity,
        lock_waits: LockWaits::default(),
    };
    Ok((drain, consumer))
}
