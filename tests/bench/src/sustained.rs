//! The highest rate the whole pipeline holds: open-loop steps of rising rate, each in a fresh
//! environment, until one is not held; then the rate halfway between the last held and the one
//! not held is tried once. When not even the first is held, the rate is halved until one is (down
//! to 250/s), then the rate halfway to the lowest one not held is tried once, so the report still
//! says where the pipeline stands.
//!
//! A step is held when the driver kept its timetable (p99 dispatch delay ≤ 100 ms), at least 99%
//! of the requests succeeded on time and at most 0.1% failed, and, at the end of the step, the
//! outbox backlog and each group's lag are below the bound (`--lag-bound-seconds` of events) and
//! were not growing over the step's second half (least-squares slope × half-duration ≤ half the
//! bound). A step whose backlog passes ten times the bound is stopped early.

use std::collections::BTreeMap;
use std::time::Duration;

use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::kafka::committed_lag;
use pipeline_testkit::TestEnv;
use serde::Serialize;
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::Settings;
use super::dbprofile::{DbActivity, DbProfiler};
use super::driver::{drive, DriveSpec, DriveSummary};
use super::envs::EnvRegistry;
use super::procstat::{round1, CpuMeter, CpuUse};
use super::services::{Pipeline, GROUPS};

/// Longest p99 delay of a request's dispatch behind its timetable.
const TIMETABLE_MARGIN_MS: f64 = 100.0;
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Lowest rate tried when the first step is not held.
const MIN_PROBE_RATE: f64 = 250.0;

#[derive(Debug, Clone, Serialize)]
pub struct SustainedResult {
    /// The highest step held; 0 when not even the first was.
    pub events_per_s: f64,
    pub lag_bound_seconds: f64,
    pub steps: Vec<SustainStep>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SustainStep {
    pub rate: f64,
    pub warmup_seconds: f64,
    pub seconds: f64,
    pub held: bool,
    /// Why the step was not held.
    pub reasons: Vec<String>,
    pub requests: DriveSummary,
    /// Backlog at the end of the step.
    pub end: Sample,
    /// Growth over the second half, events/s, per series.
    pub growth_eps: BTreeMap<String, f64>,
    /// One sample a second from the start of the warm-up.
    pub samples: Vec<Sample>,
    pub cpu: CpuUse,
    /// What the pipeline's database connections were doing.
    pub db_activity: DbActivity,
    pub peak_rss_mb: BTreeMap<String, f64>,
}

/// Backlog at one moment: pending outbox events and each group's lag (`None`: a partition with
/// data has no commit yet).
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t: f64,
    pub outbox: i64,
    pub lag: BTreeMap<String, Option<i64>>,
}

impl Sample {
    /// (series, value) pairs; an unknown lag counts as unbounded.
    fn series(&self) -> Vec<(String, f64)> {
        let mut v = vec![("outbox".to_owned(), self.outbox as f64)];
        for (g, l) in &self.lag {
            v.push((format!("{g}_lag"), l.map_or(f64::INFINITY, |l| l as f64)));
        }
        v
    }
}

pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<SustainedResult> {
    let mut steps = Vec::new();
    let mut held = 0.0;
    let mut ascending = settings.sustain_rates.iter().copied();
    let mut next = ascending.next();
    let mut going_down = false;
    // The lowest rate not held, and whether the midpoint below it was tried already.
    let mut failed_at: Option<f64> = None;
    let mut refined = false;
    while let Some(rate) = next {
        let name = format!("bench_sustain_{}", rate.round());
        let env = envs.create(&name, settings.partitions).await?;
        let step = step(settings, &env, rate, notes).await;
        notes.extend(envs.release(env).await);
        let step = step?;
        let ok = step.held;
        steps.push(step);
        if ok {
            held = rate;
        } else {
            failed_at = Some(failed_at.map_or(rate, |f: f64| f.min(rate)));
        }
        next = if refined {
            // The step halfway was the last.
            None
        } else if ok && !going_down {
            ascending.next()
        } else if held > 0.0 {
            // Between a rate held and the lowest not held: one step halfway, so the figure is
            // within a quarter of the gap rather than all of it.
            refined = true;
            failed_at.map(|f| ((held + f) / 2.0).round())
        } else {
            // Not even the first step: halve until one holds, to say where the pipeline is.
            going_down = true;
            let lower = (rate / 2.0).round();
            (lower >= MIN_PROBE_RATE).then_some(lower)
        };
    }
    Ok(SustainedResult {
        events_per_s: held,
        lag_bound_seconds: settings.lag_bound_seconds,
        steps,
    })
}

async fn step(
    settings: &Settings,
    env: &TestEnv,
    rate: f64,
    notes: &mut Vec<String>,
) -> anyhow::Result<SustainStep> {
    let pipeline = Pipeline::start(env, settings).await?;
    let bound = settings.lag_bound_seconds * rate;
    let spec = DriveSpec {
        rate,
        warmup: settings.warmup,
        measure: settings.sustain_duration,
        products: settings.products,
        max_in_flight: settings.max_in_flight,
    };
    let probe = Probe {
        pool: env.pool.clone(),
        kafka: env.kafka(),
        topic: env.topic.clone(),
        groups: GROUPS
            .iter()
            .map(|g| ((*g).to_owned(), env.group(g)))
            .collect(),
    };
    let (stop, done) = (CancellationToken::new(), CancellationToken::new());
    // Its own task: lag reads block, and must not delay the driver's timetable.
    let started = Instant::now();
    let monitor = tokio::spawn(probe.clone().watch(
        started,
        bound * 10.0,
        stop.clone(),
        done.clone(),
    ));
    let meter = CpuMeter::start(pipeline.watched());
    let profiler = DbProfiler::start(&env.database_url).await?;
    let url = pipeline.url.parse()?;
    let outcome = drive(&url, &spec, &stop).await;
    done.cancel();
    let cpu = meter.finish();
    let db_activity = profiler.finish().await;
    let mut samples = monitor.await?;
    let end = probe.sample(started.elapsed().as_secs_f64()).await?;
    samples.push(end.clone());
    let peak_rss_mb = pipeline.peak_rss();
    notes.extend(pipeline.stop().await);
    let outcome = outcome?;
    let requests = DriveSummary::of(&outcome);
    // Every request is one event.
    let cpu = db_activity.charge_sampler(cpu).with_events(outcome.ok);

    let warmup = settings.warmup.as_secs_f64();
    let half_from = warmup + settings.sustain_duration.as_secs_f64() / 2.0;
    let half_seconds = (end.t - half_from).max(1.0);
    let mut growth_eps = BTreeMap::new();
    let mut reasons = Vec::new();
    for (name, _) in end.series() {
        let points: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.t >= half_from)
            .filter_map(|s| {
                s.series()
                    .into_iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (s.t, v))
            })
            .filter(|(_, v)| v.is_finite())
            .collect();
        let slope = slope(&points);
        if slope * half_seconds > bound / 2.0 {
            reasons.push(format!(
                "{name} growing by {slope:.0} events/s over the second half"
            ));
        }
        let _ = growth_eps.insert(name, round1(slope));
    }
    for (name, value) in end.series() {
        if value >= bound {
            reasons.push(format!("{name} {value} at the end, bound {bound:.0}"));
        }
    }
    if outcome.stopped_early {
        reasons.push(format!("stopped early: backlog above {:.0}", bound * 10.0));
    }
    if requests.timetable_lag_p99_ms > TIMETABLE_MARGIN_MS {
        reasons.push(format!(
            "driver behind timetable: p99 {:.0} ms (max in flight {})",
            requests.timetable_lag_p99_ms, settings.max_in_flight
        ));
    }
    let planned = requests.planned as f64;
    if (requests.ok_on_time as f64) < 0.99 * planned {
        reasons.push(format!(
            "{} of {} requests answered on time ({:.0}/s)",
            requests.ok_on_time, requests.planned, requests.achieved_rps
        ));
    }
    if requests.failed() as f64 > 0.001 * planned {
        reasons.push(format!(
            "{} requests failed: {:?}",
            requests.failed(),
            requests.errors
        ));
    }
    Ok(SustainStep {
        rate,
        warmup_seconds: warmup,
        seconds: settings.sustain_duration.as_secs_f64(),
        held: reasons.is_empty(),
        reasons,
        requests,
        end,
        growth_eps,
        samples,
        cpu,
        db_activity,
        peak_rss_mb,
    })
}

/// Least-squares slope of (t, v) points; 0 with fewer than three.
fn slope(points: &[(f64, f64)]) -> f64 {
    if points.len() < 3 {
        return 0.0;
    }
    let n = points.len() as f64;
    let (mt, mv) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (t, v)| (a + t / n, b + v / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(num, den), (t, v)| {
        (num + (t - mt) * (v - mv), den + (t - mt) * (t - mt))
    });
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// Reads the backlog of one environment.
#[derive(Clone)]
struct Probe {
    pool: PgPool,
    kafka: KafkaArgs,
    topic: String,
    /// (kind, group id).
    groups: Vec<(String, String)>,
}

impl Probe {
    async fn sample(&self, t: f64) -> anyhow::Result<Sample> {
        let outbox: i64 = sqlx::query_scalar(
            "/* bench */ SELECT count(*) FROM outbox_unpublished WHERE state = 'pending'",
        )
        .fetch_one(&self.pool)
        .await?;
        let mut lag = BTreeMap::new();
        for (kind, id) in &self.groups {
            let (kafka, id, topic) = (self.kafka.clone(), id.clone(), self.topic.clone());
            let total =
                tokio::task::spawn_blocking(move || committed_lag(&kafka, &id, &topic)).await??;
            let _ = lag.insert(kind.clone(), total);
        }
        Ok(Sample { t, outbox, lag })
    }

    /// Samples every second until `done`; cancels `stop` when a series passes `abort_above`.
    async fn watch(
        self,
        started: Instant,
        abort_above: f64,
        stop: CancellationToken,
        done: CancellationToken,
    ) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut next = started;
        while !done.is_cancelled() {
            if let Ok(s) = self.sample(started.elapsed().as_secs_f64()).await {
                // Early on a group may not have committed yet: only known values abort.
                if s.series()
                    .iter()
                    .any(|(_, v)| v.is_finite() && *v > abort_above)
                {
                    stop.cancel();
                }
                samples.push(s);
            }
            next += SAMPLE_EVERY;
            tokio::select! {
                () = done.cancelled() => {}
                () = tokio::time::sleep_until(next) => {}
            }
        }
        samples
    }
}
