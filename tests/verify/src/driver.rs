//! The load and its history: orders placed and moved through pay → ship or cancel at a set rate
//! (open loop, bounded by a number of orders in flight), every acknowledged state change recorded
//! as (order id, sequence) with create = 1 and each later acknowledged change + 1.
//!
//! The driver stops starting orders once it has at least `min_events` acknowledged events and the
//! fault schedule is done, so faults always hit a loaded pipeline.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::client::{AttemptStats, OrderClient, Resolution};
use super::orders::{OrderPlan, Step, EVENTS_PER_ORDER};
use super::topology::PRODUCTS;

/// How far behind its schedule the driver may catch up in a burst.
const MAX_CATCH_UP: Duration = Duration::from_millis(200);

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

/// One order's share of the history.
#[derive(Debug, Default)]
struct OrderRun {
    acknowledged: Vec<AckedEvent>,
    unresolved: Option<String>,
    refused: Option<String>,
    stats: AttemptStats,
}

/// Drives orders until `min_events` are acknowledged and `faults_done` is cancelled, or until
/// `abort`; `acknowledged` counts acknowledged events as they come.
pub async fn drive(
    settings: &DriverSettings,
    faults_done: &CancellationToken,
    abort: &CancellationToken,
    acknowledged: &Arc<AtomicU64>,
) -> anyhow::Result<History> {
    let client = OrderClient::new(settings.base_url.clone())?;
    // Keys unique to this run: a rerun with the same seed places new orders.
    let run_key = Uuid::new_v4().simple().to_string();
    let order_rate = settings.rate / EVENTS_PER_ORDER;
    let slots = Arc::new(Semaphore::new(settings.concurrency));
    let mut in_flight = JoinSet::new();
    let mut history = History::default();
    let started = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / order_rate);
    let mut due = started;
    for index in 0u64.. {
        if acknowledged.load(Ordering::Relaxed) >= settings.min_events && faults_done.is_cancelled()
        {
            break;
        }
        // Open loop, but after a stall (every slot taken) the missed starts are dropped rather
        // than fired in a burst: the offered rate never exceeds the target.
        due = (due + interval).max(Instant::now() - MAX_CATCH_UP);
        let slot = tokio::select! {
            () = abort.cancelled() => break,
            slot = async {
                tokio::time::sleep_until(due).await;
                slots.clone().acquire_owned().await
            } => slot?,
        };
        while let Some(done) = in_flight.try_join_next() {
            record(&mut history, done?);
        }
        let plan = OrderPlan::generate(settings.seed, index, PRODUCTS);
        let (client, counter) = (client.clone(), acknowledged.clone());
        let key = format!("verify-{run_key}-{index}");
        let _ = in_flight.spawn(async move {
            let run = run_order(&client, &plan, &key, &counter).await;
            drop(slot);
            run
        });
        history.orders += 1;
    }
    if abort.is_cancelled() {
        // Interrupted: the run will not be checked, so orders still retrying are not waited for.
        in_flight.abort_all();
    }
    while let Some(done) = in_flight.join_next().await {
        match done {
            Ok(run) => record(&mut history, run),
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(e.into()),
        }
    }
    history.seconds = started.elapsed().as_secs_f64();
    Ok(history)
}

fn record(history: &mut History, run: OrderRun) {
    history.acknowledged.extend(run.acknowledged);
    history.retries += run.stats.retries;
    for (cause, n) in run.stats.failures {
        *history.failed_attempts.entry(cause).or_default() += n;
    }
    if let Some(why) = run.unresolved {
        history.unresolved_steps += 1;
        if history.step_problems.len() < 20 {
            history.step_problems.push(format!("unresolved: {why}"));
        }
    }
    if let Some(why) = run.refused {
        history.refused_steps += 1;
        if history.step_problems.len() < 20 {
            history.step_problems.push(format!("refused: {why}"));
        }
    }
}

/// Places one order and takes it through its actions, stopping at the first step that is not
/// acknowledged (its later steps would depend on it).
async fn run_order(
    client: &OrderClient,
    plan: &OrderPlan,
    key: &str,
    counter: &AtomicU64,
) -> OrderRun {
    let mut run = OrderRun::default();
    let order_id = match client.place(&plan.request, key, &mut run.stats).await {
        Resolution::Acknowledged(id) => id,
        Resolution::Refused(why) => {
            run.refused = Some(format!("place: {why}"));
            return run;
        }
        Resolution::Unresolved(why) => {
            run.unresolved = Some(format!("place: {why}"));
            return run;
        }
    };
    let ack = |run: &mut OrderRun, step: Step| {
        let sequence = run.acknowledged.len() as i64 + 1;
        run.acknowledged.push(AckedEvent {
            order_id,
            sequence,
            event_type: step.event_type(),
        });
        let _ = counter.fetch_add(1, Ordering::Relaxed);
    };
    ack(&mut run, Step::Place);
    let mut status = Step::Place.target_status();
    for &step in plan.actions {
        match client.act(order_id, step, status, &mut run.stats).await {
            Resolution::Acknowledged(()) => {
                ack(&mut run, step);
                status = step.target_status();
            }
            Resolution::Refused(why) => {
                run.refused = Some(format!("{order_id} {}: {why}", step.verb()));
                break;
            }
            Resolution::Unresolved(why) => {
                run.unresolved = Some(format!("{order_id} {}: {why}", step.verb()));
                break;
            }
        }
    }
    run
}
