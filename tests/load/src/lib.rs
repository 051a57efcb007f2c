//! The order load generator: the `load` binary, the benchmark (`tests/bench`) and the
//! verification run (`tests/verify`) all drive the demonstration's order service through it. It
//! knows the service only by its HTTP API ([`api`]) and the demonstration's event contract
//! (`demo-events`).
//!
//! Open loop: the slots of a [`Timetable`] are due at `start + i / rate` whatever the service's
//! speed, unless `concurrency` jobs are already in flight. A slot starts an order (placed with
//! an idempotency key, then cancelled unpaid, or paid then shipped or cancelled), or, with
//! [`Pacing::Requests`], sends one step of an order. Each step's [`StepRecord`] goes to the
//! caller's [`Recorder`], which keeps what its run needs: `load` a [`Tally`] and its
//! [`Summary`], the benchmark each event's intended time and latency, the verification run each
//! acknowledged event.
//!
//! - [`api`]: the order API's bodies and actions, as the generator sends and reads them;
//! - `plan`: the orders ([`OrderPlan`], [`Fate`]) and the seeded mix;
//! - `client`: the HTTP client ([`OrderClient`]) and its retries;
//! - `timetable`, `drive`, `interleave`, `steps`: the timetable, the generator's loop
//!   ([`drive()`]), request pacing, and what one slot sends;
//! - `record`: what a run keeps of each step ([`StepRecord`], [`Recorder`]);
//! - [`figures`]: latency histograms; `summary`, `command`: the `load` command's tally, summary
//!   and command line.

pub mod api;
mod client;
mod command;
mod drive;
pub mod figures;
mod interleave;
mod plan;
mod record;
mod steps;
mod summary;
mod timetable;

pub use client::{ClientSettings, OrderClient, RequestFailure, RequestStats, RetryPolicy};
pub use command::{run, LoadArgs};
pub use drive::{drive, Drive, DriveSettings, OnStop, Pacing};
pub use plan::{Fate, OrderPlan, MEAN_EVENTS_PER_ORDER};
pub use record::{Recorder, StepFailure, StepRecord};
pub use summary::{Latency, Summary, Tally};
pub use timetable::Timetable;
