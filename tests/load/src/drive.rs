//! The generator's loop: takes the slots of the [`Timetable`] in turn, starts the job of each (an
//! order, or one request of an order with [`Pacing::Requests`]) with at most `concurrency` in
//! flight, and hands every step's [`StepRecord`] to the caller's [`Recorder`], which keeps what
//! its run needs.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::client::OrderClient;
use crate::interleave::Interleave;
use crate::plan::OrderPlan;
use crate::record::{Recorder, StepRecord};
use crate::steps::Job;
use crate::timetable::Timetable;

/// With request pacing, how long after the run is set up its first slot is due, so the first
/// slots are not late before the run has begun (every figure is taken from the due times).
const REQUEST_LEAD: Duration = Duration::from_millis(20);

/// How the timetable's slots are filled.
#[derive(Debug, Clone)]
pub enum Pacing {
    /// A slot starts an order: placing, then each action as soon as the one before is answered.
    Orders {
        /// Orders started per second; 0 starts them as fast as `concurrency` allows.
        rate: f64,
        /// Orders to start; `None`: until stopped or the recorder wants no more.
        orders: Option<u64>,
        /// How far behind its timetable the run may fall (every order slot taken) before it drops
        /// the starts it missed rather than sending them in a burst; `None`: never dropped.
        max_catch_up: Option<Duration>,
    },
    /// A slot is one request, so one event: `rate` requests per second, `requests` in all. An
    /// order's steps are about `step_gap` apart, each in a slot of its own; a slot no order has
    /// a step for yet (the first ones) places an extra order, so the rate is even from the
    /// start.
    Requests {
        rate: f64,
        requests: u64,
        step_gap: Duration,
    },
}

/// What happens to the jobs in flight when the run is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStop {
    /// They finish, and are recorded.
    Finish,
    /// They are dropped, unrecorded.
    Abandon,
}

/// How a run goes.
#[derive(Debug, Clone)]
pub struct DriveSettings {
    pub pacing: Pacing,
    /// Most jobs in flight: orders, or requests with [`Pacing::Requests`].
    pub concurrency: usize,
    /// Start of the idempotency keys: `<prefix>-<run id>-<order index>`, unique to the run, so
    /// a rerun with the same seed places new orders.
    pub key_prefix: String,
    pub on_stop: OnStop,
}

/// What the generator did.
#[derive(Debug)]
pub struct Drive {
    pub timetable: Timetable,
    /// Jobs started: orders, or requests with [`Pacing::Requests`].
    pub started: u64,
    /// `stop` ended the run before its timetable did.
    pub stopped: bool,
    /// From the start of the run to the end of its last job.
    pub elapsed: Duration,
}

/// Runs the load `settings` describe against `client`, with the orders `mix` makes for each
/// index, until its timetable ends, `recorder` wants no more or `stop` fires.
pub async fn drive<M, R>(
    client: &OrderClient,
    settings: &DriveSettings,
    mut mix: M,
    recorder: &mut R,
    stop: &CancellationToken,
) -> anyhow::Result<Drive>
where
    M: FnMut(u64) -> OrderPlan,
    R: Recorder + ?Sized,
{
    let began = Instant::now();
    let run_id = Uuid::new_v4().simple().to_string();
    let (mut timetable, mut interleave) = settings.pacing.timetable();
    recorder.start(&timetable);
    let permits = Arc::new(Semaphore::new(settings.concurrency.max(1)));
    let mut in_flight: JoinSet<Vec<StepRecord>> = JoinSet::new();
    let (mut started, mut stopped) = (0u64, false);
    for slot in 0..timetable.slots().unwrap_or(u64::MAX) {
        if !recorder.wants_more() {
            break;
        }
        let due = timetable.next_due(slot);
        let Some(permit) = wait_for_slot(due, &permits, stop).await else {
            stopped = true;
            break;
        };
        while let Some(done) = in_flight.try_join_next() {
            done.context("a load task failed")?
                .into_iter()
                .for_each(|step| recorder.record(step));
        }
        let job = match interleave.as_mut() {
            None => Job::Order(mix(slot)),
            Some(interleave) => interleave.job(slot, &mut mix),
        };
        let key = job
            .order()
            .map(|order| format!("{}-{run_id}-{order}", settings.key_prefix));
        let (client, started_at) = (client.clone(), Instant::now());
        let _ = in_flight.spawn(async move {
            let steps = job.run(&client, key.as_deref(), due, started_at).await;
            drop(permit);
            steps
        });
        started += 1;
    }
    if stopped {
        match settings.on_stop {
            OnStop::Finish => tracing::warn!("interrupted: finishing the orders in flight"),
            OnStop::Abandon => in_flight.abort_all(),
        }
    }
    while let Some(done) = in_flight.join_next().await {
        match done {
            Ok(steps) => steps.into_iter().for_each(|step| recorder.record(step)),
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(e).context("a load task failed"),
        }
    }
    Ok(Drive {
        timetable,
        started,
        stopped,
        elapsed: began.elapsed(),
    })
}

impl Pacing {
    /// The run's timetable, and with request pacing which request each slot sends.
    fn timetable(&self) -> (Timetable, Option<Interleave>) {
        match *self {
            Pacing::Orders {
                rate,
                orders,
                max_catch_up,
            } => (
                Timetable::new(rate, orders, max_catch_up, Duration::ZERO),
                None,
            ),
            Pacing::Requests {
                rate,
                requests,
                step_gap,
            } => (
                Timetable::new(rate, Some(requests), None, REQUEST_LEAD),
                Some(Interleave::new(rate, step_gap)),
            ),
        }
    }
}

/// Waits until `due`, then for a free place among the jobs in flight; `None` once `stop` fires.
async fn wait_for_slot(
    due: Instant,
    permits: &Arc<Semaphore>,
    stop: &CancellationToken,
) -> Option<OwnedSemaphorePermit> {
    let ready = async {
        tokio::time::sleep_until(due).await;
        permits.clone().acquire_owned().await.ok()
    };
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        permit = ready => permit,
    }
}
