//! What a run keeps of each step: the [`StepRecord`] of every request the generator sent (or
//! skipped), handed to the caller's [`Recorder`].

use std::fmt;

use tokio::time::Instant;
use uuid::Uuid;

use crate::api::Action;
use crate::client::{RequestFailure, RequestStats};
use crate::timetable::Timetable;

/// Why a step did not go through.
#[derive(Debug)]
pub enum StepFailure {
    /// Its request failed for good.
    Request(RequestFailure),
    /// Not sent: the order's step before it did not go through.
    Skipped,
}

impl StepFailure {
    /// A bounded label for error tallies: [`RequestFailure::label`], or `skipped`.
    pub fn label(&self) -> String {
        match self {
            StepFailure::Request(e) => e.label(),
            StepFailure::Skipped => "skipped".to_owned(),
        }
    }
}

impl fmt::Display for StepFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepFailure::Request(e) => e.fmt(f),
            StepFailure::Skipped => f.write_str("skipped: the step before did not go through"),
        }
    }
}

/// One step of one order: placing it, or one action.
#[derive(Debug)]
pub struct StepRecord {
    /// The order's index in the run.
    pub order: u64,
    /// Known once placed.
    pub order_id: Option<Uuid>,
    /// The event number the step makes: 1 for placing, then 2, 3…
    pub sequence: i64,
    /// `None` for placing.
    pub action: Option<Action>,
    /// When it was meant to be sent: its slot's due time, or, for an action following the
    /// answer to the step before, when that answer came.
    pub due: Instant,
    /// When the generator started it (late when every slot of `concurrency` was taken).
    pub started: Instant,
    /// When its answer came (retries included).
    pub finished: Instant,
    pub stats: RequestStats,
    pub outcome: Result<(), StepFailure>,
}

impl StepRecord {
    /// The event type the step records when it goes through.
    pub fn event_type(&self) -> &'static str {
        match self.action {
            None => demo_events::order_events::ORDER_PLACED,
            Some(action) => action.target().event_type(),
        }
    }
}

/// Keeps what a run needs of its steps.
pub trait Recorder {
    /// Called once, before the first slot, with the run's timetable.
    fn start(&mut self, _timetable: &Timetable) {}

    /// One step done. Called from the generator's loop, as the jobs finish.
    fn record(&mut self, step: StepRecord);

    /// Checked before each slot: `false` ends the run (the jobs in flight finish).
    fn wants_more(&self) -> bool {
        true
    }
}
