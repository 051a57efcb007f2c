//! The consumer runtime: consumer groups that apply events exactly once and in order per
//! aggregate, each a [`Handler`] a program registers by name.
//!
//! ```no_run
//! use consumer::Settings;
//! use consumer::{Event, Handler, HandlerTransaction, HandlerError};
//! use futures::future::BoxFuture;
//! use sqlx::PgConnection;
//!
//! /// Counts events per aggregate: its effects commit in the transaction that records each
//! /// event processed, so each counts once.
//! struct Tally { group: String }
//! struct TallyTransaction;
//!
//! impl Handler for Tally {
//!     fn group(&self) -> &str { &self.group }
//!     fn transaction(&self) -> Box<dyn HandlerTransaction + '_> { Box::new(TallyTransaction) }
//! }
//!
//! impl HandlerTransaction for TallyTransaction {
//!     fn apply<'a>(&'a mut self, conn: &'a mut PgConnection, event: &'a Event)
//!         -> BoxFuture<'a, Result<(), HandlerError>> {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO tally (aggregate_id, events) VALUES ($1, 1)
//!                          ON CONFLICT (aggregate_id) DO UPDATE SET events = tally.events + 1")
//!                 .bind(&event.envelope.aggregate_id)
//!                 .execute(conn)
//!                 .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! # async fn start(args: Settings, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
//! // `args` as parsed from `--group tally --topic …`; the group's database gets the consumer
//! // library's tables from `consumer::MIGRATOR`.
//! let groups = consumer::Groups::new().register("tally", |group| Tally { group });
//! consumer::run(args, &groups, shutdown).await
//! # }
//! ```
//!
//! What every registered group gets: a batch's dedupe rows (`processed_message`) and its
//! effects commit in one transaction, and its Kafka offsets are committed only after it; one task
//! per partition; per-aggregate sequence checks, with events that arrive ahead of their
//! predecessor parked until it is applied; messages that cannot be applied dead-lettered with
//! their reason; a retry budget for batches that keep failing while the database answers; no
//! dead letter at all while the database or an outside dependency is down
//! ([`HandlerError::Unavailable`]); ownership fencing, so a member that lost its partitions
//! (frozen, or cut off from its database) applies nothing; rebalance-safe commits; shared
//! transactions; metrics and lag.
//!
//! # Layout
//!
//! The modules follow the data's path, and each uses only the stages below it:
//!
//! - [`kafka`]: this process's member of each Kafka consumer group: a poll thread whose
//!   rebalance callbacks start and stop the partition tasks, offsets committed only after the
//!   database commits, leaving the group while the database is out of reach; and the lag
//!   collector.
//! - [`partition`]: one task per assigned partition: takes its messages in order, hands them as
//!   batches to a transaction, retries, isolates a failing message, reports the offset to commit.
//! - [`transaction`]: the batch transaction: the message types, dedupe rows, per-order sequence
//!   with parking, dead letters, shared transactions of several partitions' batches.
//! - [`handlers`]: what a group does with an event ([`Handler`]), the registry of the groups a
//!   program runs ([`Groups`]), the demonstration's inventory and notification groups, and the
//!   order service's export group (a worker beside it writes the export files).
//!
//! Beside the path: [`operator`], what the operator command `pipeline` (consumer/operator)
//! needs from the library, dead-letter resolution with a group's handler, and the run's
//! `report` (they use the transaction and the handlers); [`config`], the command line; [`metrics`]; and [`runtime`],
//! the composition root that [`run`] starts.
//!
//! # Words
//!
//! - *group*: a consumer group: a [`Handler`] registered in [`Groups`] under a name and run as
//!   the Kafka consumer group whose id is `--group-prefix` + name; the id is also its dedupe
//!   scope (the tables' `group_name`).
//! - *member*: this process's part in a group: a poll thread, its rebalance callbacks, its
//!   partition tasks and offset commits.
//! - *batch*: messages of one partition, in offset order, that the partition's task hands over
//!   together (up to `--max-batch`); its offset is committed only after the transaction that
//!   applied it.
//! - *transaction*: one database transaction applying one or more batches of a group (the batch
//!   transaction); the handler's part of it is a [`HandlerTransaction`].
//! - *shared transaction*: a transaction applying the batches of several partitions of a group
//!   ([`transaction::SharedTransactions`], `--group-transactions`).
//! - *finished offset*: the offset after a batch whose transaction committed, for the member to
//!   commit to Kafka; an order's *progress* is its last applied sequence (`order_progress`).

#![warn(missing_docs)]

pub mod backoff;
pub mod handlers;
pub mod kafka;
pub mod metrics;
pub mod operator;
pub mod partition;
pub mod runtime;
pub mod settings;
pub mod transaction;

use tokio_util::sync::CancellationToken;

pub use crate::handlers::{Event, Groups, Handler, HandlerError, HandlerTransaction, UnknownGroup};
pub use crate::settings::Settings;

/// The consumer library's migrations: what any group needs besides its own effect tables
/// (dedupe rows, progress, parked events, dead letters, effect history, partition ownership).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../migrations/consumer")
};

/// Runs the groups `args` names, each looked up in `groups`, until `shutdown` (or a fatal
/// error, which is returned). See [`runtime::Runtime`] for its steps.
pub async fn run(
    args: Settings,
    groups: &Groups,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    runtime::Runtime::start(args, groups, shutdown)
        .await?
        .wait()
        .await
}
