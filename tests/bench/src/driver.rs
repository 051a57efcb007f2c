//! The benchmark's load: the order generator of the `load` command ([`pipeline_load`]) with request
//! pacing. Request `i` is due at `t0 + i / rate`, whatever the service's speed, and every figure
//! is taken from that intended time, so a stall shows as latency instead of hiding in a slower
//! send rate (no coordinated omission). Every request is one event; an order's events are about
//! 200 ms apart, in sequence. Requests are not retried: a failure counts as one.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use pipeline_load::figures::{max_ms, micros_histogram, quantile_ms};
use pipeline_load::{
    drive as drive_orders, ClientSettings, DriveSettings, OnStop, OrderClient, Pacing, Recorder,
    RetryPolicy, StepRecord, Timetable,
};
use reqwest::Url;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::orders::order_plan;

/// Delay between an order's steps.
const STEP_GAP: Duration = Duration::from_millis(200);
/// A response within this long after the last request was due still counts as on time.
const ON_TIME_GRACE: Duration = Duration::from_secs(1);
/// Timeout of a request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What to drive.
#[derive(Debug, Clone)]
pub struct DriveSpec {
    /// Requests (events) per second.
    pub rate: f64,
    /// Requests before this are load, not measured.
    pub warmup: Duration,
    pub measure: Duration,
    pub products: u32,
    pub max_in_flight: usize,
}

/// An event whose request was measured.
#[derive(Debug, Clone, Copy)]
pub struct SentEvent {
    pub order_id: Uuid,
    pub sequence: i64,
    /// When its request was due, in µs since the epoch on this machine's clock.
    pub intended_us: i64,
}

/// What the driver did.
#[derive(Debug)]
pub struct DriveOutcome {
    pub planned: u64,
    pub sent: u64,
    pub ok: u64,
    /// Successful responses by one second after the last request was due.
    pub ok_on_time: u64,
    pub errors: BTreeMap<String, u64>,
    /// Measured events, for the end-to-end latencies.
    pub measured: Vec<SentEvent>,
    /// Dispatch time − intended time of every request, µs.
    pub timetable_lag: Histogram<u64>,
    /// Response time − intended time of measured requests, µs.
    pub response: Histogram<u64>,
    /// Seconds from the first to the last request's intended time.
    pub timetable_seconds: f64,
    pub stopped_early: bool,
}

/// Drives `spec` against the order service at `base` until done or `stop`.
pub async fn drive(
    base: &Url,
    spec: &DriveSpec,
    stop: &CancellationToken,
) -> anyhow::Result<DriveOutcome> {
    let client = OrderClient::new(
        base.clone(),
        ClientSettings {
            request_timeout: REQUEST_TIMEOUT,
            connect_timeout: REQUEST_TIMEOUT,
            retry: RetryPolicy::attempts(0),
        },
    )
    .context("building the HTTP client")?;
    let requests = ((spec.warmup + spec.measure).as_secs_f64() * spec.rate).round() as u64;
    let settings = DriveSettings {
        pacing: Pacing::Requests {
            rate: spec.rate,
            requests,
            step_gap: STEP_GAP,
        },
        concurrency: spec.max_in_flight,
        key_prefix: "bench".to_owned(),
        on_stop: OnStop::Finish,
    };
    let mut figures = Figures::new((spec.warmup.as_secs_f64() * spec.rate).round() as u64);
    let products = spec.products;
    let run = drive_orders(
        &client,
        &settings,
        |g| order_plan(g, products),
        &mut figures,
        stop,
    )
    .await?;
    let last_due = run.timetable.last_due().unwrap_or(run.timetable.start());
    Ok(DriveOutcome {
        planned: requests,
        sent: run.started,
        ok: figures.ok,
        ok_on_time: figures.ok_on_time,
        errors: figures.errors,
        measured: figures.measured,
        timetable_lag: figures.timetable_lag,
        response: figures.response,
        timetable_seconds: (last_due - run.timetable.start()).as_secs_f64(),
        stopped_early: run.stopped,
    })
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The benchmark's [`Recorder`]: every request's timetable lag, and for those that went through,
/// whether on time, and, past the warm-up, the event and its response time.
struct Figures {
    first_measured: u64,
    /// Set by `start`.
    timetable: Option<Timetable>,
    on_time_by: Option<Instant>,
    measured_from: Option<Instant>,
    ok: u64,
    ok_on_time: u64,
    errors: BTreeMap<String, u64>,
    measured: Vec<SentEvent>,
    timetable_lag: Histogram<u64>,
    response: Histogram<u64>,
}

impl Figures {
    fn new(first_measured: u64) -> Figures {
        Figures {
            first_measured,
            timetable: None,
            on_time_by: None,
            measured_from: None,
            ok: 0,
            ok_on_time: 0,
            errors: BTreeMap::new(),
            measured: Vec::new(),
            timetable_lag: micros_histogram(),
            response: micros_histogram(),
        }
    }
}

impl Recorder for Figures {
    fn start(&mut self, timetable: &Timetable) {
        self.on_time_by = timetable.last_due().map(|due| due + ON_TIME_GRACE);
        self.measured_from = Some(timetable.due(self.first_measured));
        self.timetable = Some(timetable.clone());
    }

    fn record(&mut self, step: StepRecord) {
        self.timetable_lag
            .saturating_record(micros(step.started.saturating_duration_since(step.due)));
        if let Err(failure) = &step.outcome {
            *self.errors.entry(failure.label()).or_insert(0) += 1;
            return;
        }
        self.ok += 1;
        if self.on_time_by.is_none_or(|by| step.finished <= by) {
            self.ok_on_time += 1;
        }
        let (Some(timetable), Some(order_id)) = (&self.timetable, step.order_id) else {
            return;
        };
        if self.measured_from.is_some_and(|from| step.due >= from) {
            self.response
                .saturating_record(micros(step.finished.saturating_duration_since(step.due)));
            self.measured.push(SentEvent {
                order_id,
                sequence: step.sequence,
                intended_us: timetable.unix_micros(step.due),
            });
        }
    }
}

/// The driver's figures, for the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DriveSummary {
    pub planned: u64,
    pub sent: u64,
    pub ok: u64,
    pub ok_on_time: u64,
    pub errors: BTreeMap<String, u64>,
    /// Successful responses on time per second of timetable.
    pub achieved_rps: f64,
    pub timetable_lag_p99_ms: f64,
    pub timetable_lag_max_ms: f64,
    /// Intended send time → response, measured requests only.
    pub response_p50_ms: f64,
    pub response_p99_ms: f64,
    pub response_max_ms: f64,
    pub stopped_early: bool,
}

impl DriveSummary {
    pub fn of(o: &DriveOutcome) -> DriveSummary {
        DriveSummary {
            planned: o.planned,
            sent: o.sent,
            ok: o.ok,
            ok_on_time: o.ok_on_time,
            errors: o.errors.clone(),
            achieved_rps: (o.ok_on_time as f64 / o.timetable_seconds.max(1e-3)).round(),
            timetable_lag_p99_ms: quantile_ms(&o.timetable_lag, 0.99),
            timetable_lag_max_ms: max_ms(&o.timetable_lag),
            response_p50_ms: quantile_ms(&o.response, 0.5),
            response_p99_ms: quantile_ms(&o.response, 0.99),
            response_max_ms: max_ms(&o.response),
            stopped_early: o.stopped_early,
        }
    }

    /// Failed requests.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}
