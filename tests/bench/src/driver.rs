//! An open-loop HTTP driver of the order service: request `i` is due at `t0 + i / rate`, whatever
//! the service's speed, and every figure is taken from that intended time, so a stall shows as
//! latency instead of hiding in a slower send rate (no coordinated omission).
//!
//! Each request records one event: slot `3q` places order `q`; slot `3q+1` pays order `q - D`
//! and slot `3q+2` ships it (every tenth: cancels) `D` orders later, about 200 ms after the step
//! before, so each order's events are 1, 2, 3 in sequence. Slots whose order does not exist yet
//! (the first 2D) place extra orders instead.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use hdrhistogram::Histogram;
use reqwest::{Client, Url};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::histogram::{max_ms, micros_histogram, quantile_ms};
use super::orders::create_request;

/// Delay between an order's steps.
const STEP_DELAY_SECONDS: f64 = 0.2;
/// A response within this long after the last request was due still counts as on time.
const ON_TIME_GRACE: Duration = Duration::from_secs(1);

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
    pub schedule_lag: Histogram<u64>,
    /// Response time − intended time of measured requests, µs.
    pub response: Histogram<u64>,
    /// Seconds from the first to the last request's intended time.
    pub schedule_seconds: f64,
    pub stopped_early: bool,
}

enum Step {
    Place {
        key: String,
        g: u64,
        next: Option<oneshot::Sender<Option<Uuid>>>,
    },
    Pay {
        after: oneshot::Receiver<Option<Uuid>>,
        next: oneshot::Sender<Option<Uuid>>,
    },
    Finish {
        after: oneshot::Receiver<Option<Uuid>>,
        cancel: bool,
    },
}

/// Which request each slot sends, and the hand-over of an order from one step to the next.
struct Schedule {
    /// Unique to the run, in idempotency keys.
    run: String,
    /// D: orders between an order's steps.
    gap: u64,
    /// Per order, the outcome of its latest step, awaited by its next one.
    waiting: HashMap<u64, oneshot::Receiver<Option<Uuid>>>,
    /// Extra orders placed so far.
    extra: u64,
}

impl Schedule {
    fn new(rate: f64) -> Schedule {
        Schedule {
            run: Uuid::new_v4().simple().to_string(),
            gap: ((rate * STEP_DELAY_SECONDS / 3.0).ceil() as u64).max(1),
            waiting: HashMap::new(),
            extra: 0,
        }
    }

    /// The request of slot `i` (slots are asked for in order).
    fn step(&mut self, i: u64) -> Step {
        let (q, gap) = (i / 3, self.gap);
        let step = match i % 3 {
            0 => {
                let (next, rx) = oneshot::channel();
                let _ = self.waiting.insert(q, rx);
                Some(Step::Place {
                    key: format!("bench-{}-{q}", self.run),
                    g: q,
                    next: Some(next),
                })
            }
            1 if q >= gap => self.waiting.remove(&(q - gap)).map(|after| {
                let (next, rx) = oneshot::channel();
                let _ = self.waiting.insert(q - gap, rx);
                Step::Pay { after, next }
            }),
            2 if q >= 2 * gap => self
                .waiting
                .remove(&(q - 2 * gap))
                .map(|after| Step::Finish {
                    after,
                    cancel: (q - 2 * gap) % 10 == 9,
                }),
            _ => None,
        };
        step.unwrap_or_else(|| {
            self.extra += 1;
            Step::Place {
                key: format!("bench-{}-x{}", self.run, self.extra),
                // Far above the regular orders' numbers, so lines and keys do not repeat theirs.
                g: u64::from(u32::MAX) + self.extra,
                next: None,
            }
        })
    }
}

struct Done {
    measured: bool,
    due: Instant,
    intended_us: i64,
    finished: Instant,
    result: Result<(Uuid, i64), String>,
}

/// Drives `spec` against the order service at `base` until done or `stop`.
pub async fn drive(
    base: &Url,
    spec: &DriveSpec,
    stop: &CancellationToken,
) -> anyhow::Result<DriveOutcome> {
    let client = Client::builder()
        .timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")?;
    let total = ((spec.warmup + spec.measure).as_secs_f64() * spec.rate).round() as u64;
    let first_measured = (spec.warmup.as_secs_f64() * spec.rate).round() as u64;
    let slots = Arc::new(Semaphore::new(spec.max_in_flight));
    let (done_tx, done_rx) = mpsc::unbounded_channel::<Done>();

    let (start, wall_start) = (Instant::now(), SystemTime::now());
    let wall_start_us = i64::try_from(wall_start.duration_since(UNIX_EPOCH)?.as_micros())?;
    let t0 = start + Duration::from_millis(20);
    let due_of = |i: u64| t0 + Duration::from_secs_f64(i as f64 / spec.rate);
    let last_due = due_of(total.saturating_sub(1));
    let collector = tokio::spawn(collect(done_rx, last_due + ON_TIME_GRACE));

    let mut schedule = Schedule::new(spec.rate);
    let mut schedule_lag = micros_histogram();
    let (mut sent, mut stopped_early) = (0u64, false);
    for i in 0..total {
        let due = due_of(i);
        if due > Instant::now() {
            tokio::select! {
                biased;
                () = stop.cancelled() => { stopped_early = true; break; }
                () = tokio::time::sleep_until(due) => {}
            }
        }
        let permit = tokio::select! {
            biased;
            () = stop.cancelled() => { stopped_early = true; break; }
            permit = slots.clone().acquire_owned() => permit?,
        };
        let now = Instant::now();
        schedule_lag.saturating_record(micros(now.saturating_duration_since(due)));

        let step = schedule.step(i);
        let (client, base, tx, products) =
            (client.clone(), base.clone(), done_tx.clone(), spec.products);
        let intended_us = wall_start_us + i64::try_from(micros(due - start))?;
        let measured = i >= first_measured;
        drop(tokio::spawn(async move {
            let result = execute(&client, &base, step, products).await;
            let _ = tx.send(Done {
                measured,
                due,
                intended_us,
                finished: Instant::now(),
                result,
            });
            drop(permit);
        }));
        sent += 1;
    }
    drop(done_tx);
    let mut outcome = collector.await?;
    outcome.planned = total;
    outcome.sent = sent;
    outcome.schedule_lag = schedule_lag;
    outcome.schedule_seconds = (last_due - t0).as_secs_f64();
    outcome.stopped_early = stopped_early;
    Ok(outcome)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Gathers the requests' results until every request task has finished.
async fn collect(mut done: mpsc::UnboundedReceiver<Done>, on_time_by: Instant) -> DriveOutcome {
    let mut out = DriveOutcome {
        planned: 0,
        sent: 0,
        ok: 0,
        ok_on_time: 0,
        errors: BTreeMap::new(),
        measured: Vec::new(),
        schedule_lag: micros_histogram(),
        response: micros_histogram(),
        schedule_seconds: 0.0,
        stopped_early: false,
    };
    while let Some(d) = done.recv().await {
        match d.result {
            Ok((order_id, sequence)) => {
                out.ok += 1;
                if d.finished <= on_time_by {
                    out.ok_on_time += 1;
                }
                if d.measured {
                    out.response.saturating_record(micros(d.finished - d.due));
                    out.measured.push(SentEvent {
                        order_id,
                        sequence,
                        intended_us: d.intended_us,
                    });
                }
            }
            Err(label) => *out.errors.entry(label).or_insert(0) += 1,
        }
    }
    out
}

#[derive(Deserialize)]
struct OrderId {
    order_id: Uuid,
}

/// Sends one step's request; returns the event it recorded (order, sequence) or an error label.
async fn execute(
    client: &Client,
    base: &Url,
    step: Step,
    products: u32,
) -> Result<(Uuid, i64), String> {
    match step {
        Step::Place { key, g, next } => {
            let url = base.join("orders").map_err(|_| "url".to_owned())?;
            let request = client
                .post(url)
                .header("Idempotency-Key", key)
                .json(&create_request(g, products));
            let id = send(request).await;
            if let Some(next) = next {
                let _ = next.send(id.as_ref().ok().copied());
            }
            Ok((id?, 1))
        }
        Step::Pay { after, next } => {
            let id = after
                .await
                .ok()
                .flatten()
                .ok_or_else(|| "skipped".to_owned())?;
            let paid = act(client, base, id, "pay").await;
            let _ = next.send(paid.as_ref().ok().copied());
            Ok((paid?, 2))
        }
        Step::Finish { after, cancel } => {
            let id = after
                .await
                .ok()
                .flatten()
                .ok_or_else(|| "skipped".to_owned())?;
            Ok((
                act(client, base, id, if cancel { "cancel" } else { "ship" }).await?,
                3,
            ))
        }
    }
}

async fn act(client: &Client, base: &Url, id: Uuid, verb: &str) -> Result<Uuid, String> {
    let url = base
        .join(&format!("orders/{id}/{verb}"))
        .map_err(|_| "url".to_owned())?;
    send(client.post(url)).await
}

/// Sends a request and reads the order id from a 2xx answer; otherwise an error label.
async fn send(request: reqwest::RequestBuilder) -> Result<Uuid, String> {
    let response = request.send().await.map_err(|e| label(&e))?;
    let status = response.status();
    if !status.is_success() {
        return Err(status.as_u16().to_string());
    }
    let order: OrderId = response.json().await.map_err(|e| label(&e))?;
    Ok(order.order_id)
}

fn label(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else if e.is_decode() {
        "decode"
    } else {
        "transport"
    }
    .to_owned()
}

/// The driver's figures, for the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DriveSummary {
    pub planned: u64,
    pub sent: u64,
    pub ok: u64,
    pub ok_on_time: u64,
    pub errors: BTreeMap<String, u64>,
    /// Successful responses on time per second of schedule.
    pub achieved_rps: f64,
    pub schedule_lag_p99_ms: f64,
    pub schedule_lag_max_ms: f64,
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
            achieved_rps: (o.ok_on_time as f64 / o.schedule_seconds.max(1e-3)).round(),
            schedule_lag_p99_ms: quantile_ms(&o.schedule_lag, 0.99),
            schedule_lag_max_ms: max_ms(&o.schedule_lag),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_is_one_event_and_orders_go_through_their_steps_in_order() {
        let mut schedule = Schedule::new(150.0);
        let gap = schedule.gap;
        assert!((10..=11).contains(&gap), "about 200 ms of slots: {gap}");
        let (mut placed, mut paid, mut finished, mut extra) = (Vec::new(), 0, 0, 0);
        for i in 0..300 {
            match schedule.step(i) {
                Step::Place {
                    next: Some(_), g, ..
                } => placed.push(g),
                Step::Place { next: None, .. } => extra += 1,
                Step::Pay { .. } => paid += 1,
                Step::Finish { .. } => finished += 1,
            }
        }
        assert_eq!(placed, (0..100).collect::<Vec<_>>());
        assert_eq!((paid, finished, extra), (100 - gap, 100 - 2 * gap, 3 * gap));
    }
}
