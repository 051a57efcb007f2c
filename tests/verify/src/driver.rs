//! The load and its history: orders placed and moved through pay → ship or cancel by the order
//! generator of the `load` command ([`pipeline_load`]) at a set rate (open loop, bounded by a
//! number of orders in flight), every acknowledged state change recorded as (order id,
//! sequence) with create = 1 and each later acknowledged change + 1.
//!
//! A step is acknowledged when the order service answered 2xx, or, after an ambiguous failure
//! (5xx, 429, timeout, lost connection) answered by a 409 on the retry, when reading the order
//! back shows the status the change leads to: the earlier attempt was committed and only its
//! answer was lost. Each step retries for up to two minutes (a PostgreSQL restart takes a few
//! seconds); one still ambiguous then is left unresolved: its event may or may not be committed,
//! and the checks find out from the outbox.
//!
//! The driver stops starting orders once it has at least `min_events` acknowledged events and the
//! fault plan is done, so faults always hit a loaded pipeline.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pipeline_load::{
    drive as drive_orders, ClientSettings, DriveSettings, OnStop, OrderClient, OrderPlan, Pacing,
    Recorder, RetryPolicy, StepFailure, StepRecord, MEAN_EVENTS_PER_ORDER,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::topology::PRODUCTS;

/// How long one step keeps retrying (a PostgreSQL restart takes a few seconds).
const STEP_DEADLINE: Duration = Duration::from_secs(120);
/// How far behind its timetable the driver may catch up in a burst; starts missed beyond that
/// (every order slot taken during a stall) are dropped, so the offered rate never exceeds the
/// target.
const MAX_CATCH_UP: Duration = Duration::from_millis(200);
/// Step problems kept for the report.
const PROBLEMS_KEPT: usize = 20;

/// How the driver runs.
#[derive(Debug, Clone)]
pub struct DriverSettings {
    pub base_url: String,
    pub seed: u64,
    /// Events per second aimed at.
    pub rate: f64,
    pub min_events: u64,
    pub concurrency: usize,
}

/// One acknowledged state change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckedEvent {
    pub order_id: Uuid,
    pub sequence: i64,
    pub event_type: &'static str,
}

/// What the driver did.
#[derive(Debug, Default)]
pub struct History {
    pub acknowledged: Vec<AckedEvent>,
    pub orders: u64,
    /// Steps still ambiguous at their deadline (committed or not: the outbox tells).
    pub unresolved_steps: u64,
    /// Steps refused for good (none expected).
    pub refused_steps: u64,
    /// The first few refusals and unresolved steps, for the report.
    pub step_problems: Vec<String>,
    pub retries: u64,
    pub failed_attempts: BTreeMap<String, u64>,
    pub seconds: f64,
}

impl History {
    fn problem(&mut self, what: String) {
        if self.step_problems.len() < PROBLEMS_KEPT {
            self.step_problems.push(what);
        }
    }
}

/// The verification's [`Recorder`]: the history, a live count of acknowledged events, and when
/// to stop.
struct Recording<'a> {
    history: History,
    acknowledged: &'a AtomicU64,
    min_events: u64,
    faults_done: &'a CancellationToken,
}

impl Recorder for Recording<'_> {
    fn record(&mut self, step: StepRecord) {
        let event_type = step.event_type();
        let history = &mut self.history;
        history.retries += step.stats.retries;
        for (cause, n) in step.stats.failed_attempts {
            *history.failed_attempts.entry(cause).or_default() += n;
        }
        let what = match (step.action, step.order_id) {
            (None, _) => "place".to_owned(),
            (Some(action), Some(id)) => format!("{id} {}", action.verb()),
            (Some(action), None) => action.verb().to_owned(),
        };
        match step.outcome {
            Ok(()) => {
                if let Some(order_id) = step.order_id {
                    history.acknowledged.push(AckedEvent {
                        order_id,
                        sequence: step.sequence,
                        event_type,
                    });
                    let _ = self.acknowledged.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(StepFailure::Request(e)) if e.is_ambiguous() => {
                history.unresolved_steps += 1;
                history.problem(format!("unresolved: {what}: {e}"));
            }
            Err(e) => {
                history.refused_steps += 1;
                history.problem(format!("refused: {what}: {e}"));
            }
        }
    }

    fn wants_more(&self) -> bool {
        self.acknowledged.load(Ordering::Relaxed) < self.min_events
            || !self.faults_done.is_cancelled()
    }
}

/// Drives orders until `min_events` are acknowledged and `faults_done` is cancelled, or until
/// `abort` (orders in flight are then dropped: the run will not be checked); `acknowledged`
/// counts acknowledged events as they come.
pub async fn drive(
    settings: &DriverSettings,
    faults_done: &CancellationToken,
    abort: &CancellationToken,
    acknowledged: &Arc<AtomicU64>,
) -> anyhow::Result<History> {
    let client = OrderClient::new(
        settings
            .base_url
            .parse()
            .context("the order service's URL")?,
        ClientSettings {
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            retry: RetryPolicy::for_at_most(STEP_DEADLINE),
        },
    )?;
    let generator = DriveSettings {
        pacing: Pacing::Orders {
            rate: settings.rate / MEAN_EVENTS_PER_ORDER,
            orders: None,
            max_catch_up: Some(MAX_CATCH_UP),
        },
        concurrency: settings.concurrency,
        key_prefix: "verify".to_owned(),
        on_stop: OnStop::Abandon,
    };
    let mut recording = Recording {
        history: History::default(),
        acknowledged,
        min_events: settings.min_events,
        faults_done,
    };
    let seed = settings.seed;
    let run = drive_orders(
        &client,
        &generator,
        |index| OrderPlan::generate(seed, index, PRODUCTS),
        &mut recording,
        abort,
    )
    .await?;
    let mut history = recording.history;
    history.orders = run.started;
    history.seconds = run.elapsed.as_secs_f64();
    Ok(history)
}
