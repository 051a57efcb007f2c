//! Shared transactions: order changes requested at the same time are written in one
//! transaction.
//!
//! Each change on its own costs a transaction: `BEGIN`, its statement, its event's statement and
//! a `COMMIT`, each a round trip, and a WAL flush. Under load, requests arrive while others are
//! being written; a runner takes every change waiting (up to `max_ops`) and makes them in one
//! transaction: places together (one statement for each round of distinct idempotency keys, see
//! [`place_all_in`]), transitions together (two statements for each round of distinct orders,
//! see [`transition_all_in`]), and all their events in one statement
//! ([`outbox::enqueue_all`]), so the `BEGIN`, the statements, the `COMMIT` and the flush are
//! shared. At most `runners` transactions run at once; when the service is idle a
//! change waits for nobody.
//!
//! Nothing a client sees changes. Each change is answered only after the transaction holding it
//! committed. A change the lifecycle or the catalogue refuses writes nothing, so it is answered
//! with its refusal and the others commit. A change that needs its writes undone (a database
//! error, an event already in the outbox) rolls the whole transaction back, and every change in it
//! is handed back to its request, which then runs in a transaction of its own, where it gets
//! exactly the answer it would have had without shared transactions. Changes are written in the
//! order of the rows they lock (idempotency key or order id, arrival order among equals), so two
//! shared transactions can not deadlock on each other.

use std::sync::Arc;
use std::time::Duration;

use pipeline_core::db::HeldSession;
use pipeline_core::overlap::Overlap;
use prometheus::{
    register_histogram_with_registry, register_int_counter_with_registry,
    register_int_gauge_with_registry, Histogram, HistogramOpts, IntCounter, IntGauge, Registry,
};
use sqlx::{Connection, PgConnection, Postgres, Transaction};
use tokio::sync::{mpsc, oneshot, Mutex};
use uuid::Uuid;

use super::error::OrderError;
use super::model::{Action, Order};
use super::place::{place_all_in, place_in, Placed};
use super::transition::{transition_all_in, transition_in};
use super::writer::Writer;
use crate::validation::ValidOrder;

/// How changes share transactions.
#[derive(Debug, Clone, Copy)]
pub struct SharedTransactionSettings {
    /// Shared transactions running at once.
    pub runners: usize,
    /// Most changes in one transaction.
    pub max_ops: usize,
    /// How long a runner with changes waits for the transactions already running to finish
    /// before it starts another beside them (see [`Overlap`]); zero starts it at once.
    pub patience: Duration,
}

/// Prometheus series of the shared transactions, registered on a registry the caller owns.
#[derive(Debug, Clone)]
pub struct SharedTransactionMetrics {
    ops: Histogram,
    failures: IntCounter,
    queued: IntGauge,
}

impl SharedTransactionMetrics {
    /// Creates the metrics and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let ops = register_histogram_with_registry!(
            HistogramOpts::new(
                "order_transaction_changes",
                "Order changes written per order-service transaction (shared transactions).",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
            registry
        )?;
        let failures = register_int_counter_with_registry!(
            "order_shared_transaction_failures_total",
            "Shared order-service transactions rolled back; their changes were retried alone.",
            registry
        )?;
        let queued = register_int_gauge_with_registry!(
            "order_shared_transaction_queued_changes",
            "Order changes waiting for a shared order-service transaction.",
            registry
        )?;
        Ok(Self {
            ops,
            failures,
            queued,
        })
    }
}

/// A request's answer; `None`: its shared transaction failed, run it alone.
pub(super) type Answer<T> = Option<Result<T, OrderError>>;

/// A change waiting for a transaction, with where its answer goes.
pub(super) enum Job {
    Place(Place),
    Transition(Transition),
}

/// A place waiting for a transaction.
pub(super) struct Place {
    pub(super) order: ValidOrder,
    pub(super) idempotency_key: Option<String>,
    pub(super) traceparent: Option<String>,
    pub(super) reply: oneshot::Sender<Answer<Placed>>,
}

/// A pay, cancel or ship waiting for a transaction.
pub(super) struct Transition {
    pub(super) order_id: Uuid,
    pub(super) action: Action,
    pub(super) traceparent: Option<String>,
    pub(super) reply: oneshot::Sender<Answer<Order>>,
}

impl Job {
    /// The rows this change locks, as one sortable key: its idempotency key or its order id. A
    /// place without a key locks nothing another change could wait for.
    fn lock_key(&self) -> (u8, String) {
        match self {
            Job::Place(p) => (0, p.idempotency_key.clone().unwrap_or_default()),
            Job::Transition(t) => (1, t.order_id.to_string()),
        }
    }

    /// Makes the change inside `tx`, without its event.
    async fn run(self, tx: &mut Transaction<'_, Postgres>) -> Done {
        match self {
            Job::Place(p) => {
                let result = place_in(tx, &p.order, p.idempotency_key.as_deref()).await;
                Done::Place(p.reply, result, p.traceparent)
            }
            Job::Transition(t) => {
                let result = transition_in(tx, t.order_id, t.action).await;
                Done::Transition(t.reply, result, t.traceparent)
            }
        }
    }

    /// Hands the change back to its request, unwritten.
    fn hand_back(self) {
        match self {
            Job::Place(p) => drop(p.reply.send(None)),
            Job::Transition(t) => drop(t.reply.send(None)),
        }
    }

    /// Answers `error` without running the change.
    fn fail(self, error: OrderError) {
        match self {
            Job::Place(p) => drop(p.reply.send(Some(Err(error)))),
            Job::Transition(t) => drop(t.reply.send(Some(Err(error)))),
        }
    }
}

/// A change made inside the open transaction, with its result and its request's traceparent.
enum Done {
    Place(
        oneshot::Sender<Answer<Placed>>,
        Result<Placed, OrderError>,
        Option<String>,
    ),
    Transition(
        oneshot::Sender<Answer<Order>>,
        Result<Order, OrderError>,
        Option<String>,
    ),
}

impl Done {
    /// The order whose new status needs its event, with the traceparent for it: none for a
    /// refusal or an idempotent replay of a create.
    fn changed(&self) -> Option<(&Order, Option<&str>)> {
        match self {
            Done::Place(_, Ok(placed), traceparent) if placed.created => {
                Some((&placed.order, traceparent.as_deref()))
            }
            Done::Transition(_, Ok(order), traceparent) => Some((order, traceparent.as_deref())),
            Done::Place(..) | Done::Transition(..) => None,
        }
    }

    /// True when the change's writes must be undone: everything but a refusal that wrote
    /// nothing.
    fn needs_rollback(&self) -> bool {
        let error = match self {
            Done::Place(_, result, _) => result.as_ref().err(),
            Done::Transition(_, result, _) => result.as_ref().err(),
        };
        error.is_some_and(|e| !e.wrote_nothing())
    }

    /// Sends the result: the transaction committed, or the change was alone in it.
    fn answer(self) {
        match self {
            Done::Place(reply, result, _) => drop(reply.send(Some(result))),
            Done::Transition(reply, result, _) => drop(reply.send(Some(result))),
        }
    }

    /// Sends `error` instead of the result.
    fn fail(self, error: OrderError) {
        match self {
            Done::Place(reply, ..) => drop(reply.send(Some(Err(error)))),
            Done::Transition(reply, ..) => drop(reply.send(Some(Err(error)))),
        }
    }

    /// Hands the change back to its request: its writes were rolled back.
    fn hand_back(self) {
        match self {
            Done::Place(reply, ..) => drop(reply.send(None)),
            Done::Transition(reply, ..) => drop(reply.send(None)),
        }
    }
}

/// The entry to the service's shared transactions. The runners stop when the last clone of the
/// service holding it is dropped.
#[derive(Debug, Clone)]
pub(super) struct SharedTransactions {
    tx: mpsc::UnboundedSender<Job>,
    queued: IntGauge,
}

struct Queue {
    rx: mpsc::UnboundedReceiver<Job>,
}

impl SharedTransactions {
    /// Starts the runners; `writer` writes each transaction.
    pub(super) fn start(
        writer: Writer,
        settings: SharedTransactionSettings,
        metrics: SharedTransactionMetrics,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Mutex::new(Queue { rx }));
        let queued = metrics.queued.clone();
        let overlap = Arc::new(Overlap::new(settings.patience));
        for _ in 0..settings.runners.max(1) {
            let (queue, overlap) = (queue.clone(), overlap.clone());
            let (writer, metrics) = (writer.clone(), metrics.clone());
            let max_ops = settings.max_ops.max(1);
            tokio::spawn(async move { run(&queue, &overlap, &writer, max_ops, &metrics).await });
        }
        SharedTransactions { tx, queued }
    }

    /// Writes the job `make` builds around its reply channel in a shared transaction and waits
    /// for its answer; `None` when it was not written (its transaction failed, or the runners are
    /// gone): the caller runs it alone.
    pub(super) async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Answer<T>>) -> Job,
    ) -> Answer<T> {
        let (reply, answer) = oneshot::channel();
        self.queued.inc();
        if self.tx.send(make(reply)).is_err() {
            self.queued.dec();
            return None;
        }
        answer.await.ok().flatten()
    }
}

async fn run(
    queue: &Mutex<Queue>,
    overlap: &Overlap,
    writer: &Writer,
    max_ops: usize,
    metrics: &SharedTransactionMetrics,
) {
    // The session this runner's transactions run on, kept between them.
    let mut session = HeldSession::default();
    loop {
        let (jobs, _running) = {
            let mut q = queue.lock().await;
            let Some(first) = q.rx.recv().await else {
                return;
            };
            metrics.queued.dec();
            // Changes arriving while another transaction is written join the next one.
            overlap.wait_turn().await;
            let mut jobs = vec![first];
            while jobs.len() < max_ops {
                let Ok(job) = q.rx.try_recv() else { break };
                metrics.queued.dec();
                jobs.push(job);
            }
            (jobs, overlap.start())
        };
        metrics.ops.observe(jobs.len() as f64);
        if !write(writer, &mut session, jobs).await {
            metrics.failures.inc();
        }
    }
}

/// One step of a shared transaction: a change made on its own, a round of places of distinct
/// idempotency keys made together (see [`place_all_in`]), or a round of transitions of distinct
/// orders made together (see [`transition_all_in`]).
enum Step {
    One(Job),
    Places(Vec<Place>),
    Transitions(Vec<Transition>),
}

/// The steps a shared transaction makes `jobs` (sorted by [`Job::lock_key`]) in: the places in
/// rounds of distinct idempotency keys (a place without a key conflicts with none), then the
/// transitions in rounds of distinct orders; a key used twice, or an order changed twice, is in
/// two rounds, in arrival order. A round of one change is a step of its own.
fn steps(jobs: Vec<Job>) -> Vec<Step> {
    let (mut places, mut transitions) = (Vec::new(), Vec::new());
    for job in jobs {
        match job {
            Job::Place(p) => places.push(p),
            Job::Transition(t) => transitions.push(t),
        }
    }
    let mut steps = Vec::new();
    for mut round in rounds(places, |p| p.idempotency_key.clone()) {
        match round.len() {
            1 => steps.extend(round.pop().map(|p| Step::One(Job::Place(p)))),
            _ => steps.push(Step::Places(round)),
        }
    }
    for mut round in rounds(transitions, |t| Some(t.order_id)) {
        match round.len() {
            1 => steps.extend(round.pop().map(|t| Step::One(Job::Transition(t)))),
            _ => steps.push(Step::Transitions(round)),
        }
    }
    steps
}

/// Splits `changes` (sorted, so equal keys are adjacent) into rounds of distinct keys: the n-th
/// change of a key goes in round n, so a key's changes keep their order. A change without a key
/// conflicts with none and goes in the first round.
fn rounds<T, K: PartialEq>(changes: Vec<T>, key: impl Fn(&T) -> Option<K>) -> Vec<Vec<T>> {
    let mut rounds: Vec<Vec<T>> = Vec::new();
    let (mut last, mut round) = (None, 0);
    for change in changes {
        let k = key(&change);
        round = match (&k, &last) {
            (Some(k), Some(last)) if k == last => round + 1,
            _ => 0,
        };
        last = k;
        if rounds.len() <= round {
            rounds.push(Vec::new());
        }
        rounds[round].push(change);
    }
    rounds
}

impl Step {
    /// Makes the step's changes inside `tx`. The step comes back when a shared statement
    /// failed, so nothing is known of any of its changes.
    async fn run(self, tx: &mut Transaction<'_, Postgres>) -> Result<Vec<Done>, Step> {
        match self {
            Step::One(job) => Ok(vec![job.run(tx).await]),
            Step::Places(round) => {
                let places: Vec<(&ValidOrder, Option<&str>)> = round
                    .iter()
                    .map(|p| (&p.order, p.idempotency_key.as_deref()))
                    .collect();
                let results = place_all_in(tx, &places).await;
                drop(places);
                match results {
                    Ok(results) => Ok(round
                        .into_iter()
                        .zip(results)
                        .map(|(p, result)| Done::Place(p.reply, result, p.traceparent))
                        .collect()),
                    Err(e) => {
                        tracing::debug!(error = %e, "places of a shared transaction failed");
                        Err(Step::Places(round))
                    }
                }
            }
            Step::Transitions(round) => {
                let changes: Vec<(Uuid, Action)> =
                    round.iter().map(|t| (t.order_id, t.action)).collect();
                match transition_all_in(tx, &changes).await {
                    Ok(results) => Ok(round
                        .into_iter()
                        .zip(results)
                        .map(|(t, result)| Done::Transition(t.reply, result, t.traceparent))
                        .collect()),
                    Err(e) => {
                        tracing::debug!(error = %e, "transitions of a shared transaction failed");
                        Err(Step::Transitions(round))
                    }
                }
            }
        }
    }

    /// Hands every change of the step back to its request, unwritten.
    fn hand_back(self) {
        match self {
            Step::One(job) => job.hand_back(),
            Step::Places(round) => round.into_iter().for_each(|p| drop(p.reply.send(None))),
            Step::Transitions(round) => {
                round.into_iter().for_each(|t| drop(t.reply.send(None)));
            }
        }
    }
}

/// Writes `jobs` in one transaction on the runner's `session` (see [`HeldSession`]) and answers
/// each. Returns false when several changes were handed back because the transaction failed; a
/// session whose transaction did not commit goes back to the pool.
async fn write(writer: &Writer, session: &mut HeldSession, jobs: Vec<Job>) -> bool {
    let conn = match session.get(&writer.pool).await {
        Ok(conn) => conn,
        Err(e) => return not_written(jobs, e),
    };
    let (handed_back, committed) = write_on(writer, conn, jobs).await;
    if !committed {
        session.failed();
    }
    !handed_back
}

/// Answers `jobs` when no session could be had for them: one change gets the error, several are
/// handed back (returns false).
fn not_written(mut jobs: Vec<Job>, e: sqlx::Error) -> bool {
    if jobs.len() == 1 {
        if let Some(job) = jobs.pop() {
            job.fail(OrderError::Database(e));
        }
        return true;
    }
    tracing::debug!(error = %e, "could not open a shared transaction");
    jobs.into_iter().for_each(Job::hand_back);
    false
}

/// [`write`] on `conn`: whether several changes were handed back, and whether the transaction
/// committed.
async fn write_on(writer: &Writer, conn: &mut PgConnection, mut jobs: Vec<Job>) -> (bool, bool) {
    let alone = jobs.len() == 1;
    // Stable: changes of one order keep their arrival order.
    jobs.sort_by_cached_key(Job::lock_key);
    let mut tx = match conn.begin().await {
        Ok(tx) => tx,
        Err(e) => return (!not_written(jobs, e), false),
    };
    let mut done = Vec::with_capacity(jobs.len());
    let mut pending = steps(jobs).into_iter();
    for step in pending.by_ref() {
        let changes = match step.run(&mut tx).await {
            Ok(changes) => changes,
            Err(step) => {
                drop(tx);
                tracing::debug!(
                    "shared order transaction's statement failed; each change runs alone"
                );
                done.into_iter().for_each(Done::hand_back);
                step.hand_back();
                pending.for_each(Step::hand_back);
                return (true, false);
            }
        };
        if changes.iter().any(Done::needs_rollback) {
            drop(tx);
            if alone {
                changes.into_iter().for_each(Done::answer);
                return (false, false);
            }
            tracing::debug!("shared order transaction rolled back; each change runs alone");
            done.into_iter().for_each(Done::hand_back);
            changes.into_iter().for_each(Done::hand_back);
            pending.for_each(Step::hand_back);
            return (true, false);
        }
        done.extend(changes);
    }
    // Every change's event in one statement.
    let changed: Vec<(&Order, Option<&str>)> = done.iter().filter_map(Done::changed).collect();
    if let Err(e) = writer.record_events(&mut tx, &changed).await {
        drop(changed);
        drop(tx);
        if alone {
            if let Some(change) = done.pop() {
                change.fail(e);
            }
            return (false, false);
        }
        tracing::debug!(changes = done.len(), error = %e,
            "shared order transaction's events refused; each change runs alone");
        done.into_iter().for_each(Done::hand_back);
        return (true, false);
    }
    drop(changed);
    match tx.commit().await {
        Ok(()) => {
            done.into_iter().for_each(Done::answer);
            return (false, true);
        }
        // The commit's outcome is unknown to us (the connection failed during it): running the
        // changes again could write them twice, so each request gets the failure, as it would
        // alone.
        Err(e) if alone => {
            if let Some(change) = done.pop() {
                change.fail(OrderError::Database(e));
            }
        }
        Err(e) => {
            let message = e.to_string();
            done.into_iter()
                .for_each(|change| change.fail(OrderError::CommitFailed(message.clone())));
        }
    }
    (false, false)
}
