//! The consumer runtime: consumer groups that apply events exactly once and in order per
//! aggregate, each a [`Handler`] a program registers by name and runs with its own pool,
//! Prometheus registry and shutdown token.
//!
//! ```no_run
//! use consumer::{ConsumerSettings, Event, Groups, Handler, HandlerError, HandlerTransaction};
//! use futures::future::BoxFuture;
//! use pipeline_core::db::DbArgs;
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
//! # async fn embed() -> anyhow::Result<()> {
//! let settings = ConsumerSettings {
//!     topics: vec!["tally-events".to_owned()],
//!     ..ConsumerSettings::default()
//! };
//! let db = DbArgs {
//!     database_url: "postgres://app@db.internal/shop".to_owned(),
//!     ..DbArgs::default()
//! };
//! // The sessions the runtime needs: statement and idle-in-transaction timeouts, key lookups.
//! let pool = consumer::connect(&db, &settings).await?;
//! consumer::MIGRATOR.run(&pool).await?; // only if this program sets up the library's tables
//! let registry = prometheus::Registry::new(); // serve it where the program serves its metrics
//! let groups = Groups::new().register("tally", |group| Tally { group });
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! consumer::run(settings, pool, &registry, &groups, shutdown).await?;
//! # Ok(())
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
//! transactions; an optional rate limit; a pause an operator can set and lift; metrics and lag.
//!
//! The runtime serves no HTTP endpoint and applies no migration: the program serves the registry
//! it passed (`pipeline_core::ops_http` offers `/metrics`, `/healthz` and `/readyz`) and applies
//! [`MIGRATOR`] where it sets up the database.
//!
//! # Layout
//!
//! The modules follow the data's path, and each uses only the stages below it:
//!
//! - `kafka`: this process's member of each Kafka consumer group: a poll thread whose
//!   rebalance callbacks start and stop the partition tasks, offsets committed only after the
//!   database commits, leaving the group while the database is out of reach; and the lag
//!   collector.
//! - `partition`: one task per assigned partition: takes its messages in order, hands them as
//!   batches to a transaction, retries, isolates a failing message, reports the offset to commit.
//! - `transaction`: the batch transaction: the message types, dedupe rows, per-aggregate
//!   sequence with parking, dead letters, shared transactions of several partitions' batches.
//! - `handlers`: what a group does with an event ([`Handler`]) and the registry of the groups
//!   a program runs ([`Groups`]).
//!
//! Beside the path: `settings`, what [`run`] takes ([`ConsumerSettings`]) and the database
//! sessions it needs ([`connect`]); `runtime`, the composition root that [`run`] starts;
//! [`retention`], the rules that keep the groups' tables flat, run beside the groups;
//! `rate_limit`, a group's cap on the events it applies (a token bucket the partition tasks
//! take from before each batch); `pause`, an operator's pause of a group (read every second;
//! the partition tasks start no batch and the members pause their partitions' fetch while it
//! holds);
//! [`operator`], what the operator command (consumer/operator) needs: dead-letter resolution with
//! a group's handler; `metrics`; and `backoff`, the retry delays.
//!
//! # Words
//!
//! - *group*: a consumer group: a [`Handler`] registered in [`Groups`] under a name and run as
//!   the Kafka consumer group whose id is `group_prefix` + name; the id is also its dedupe
//!   scope (the tables' `group_name`).
//! - *member*: this process's part in a group: a poll thread, its rebalance callbacks, its
//!   partition tasks and offset commits.
//! - *batch*: messages of one partition, in offset order, that the partition's task hands over
//!   together (up to `max_batch`); its offset is committed only after the transaction that
//!   applied it.
//! - *transaction*: one database transaction applying one or more batches of a group, or of
//!   several (the batch transaction); a handler's part of it is a [`HandlerTransaction`].
//! - *shared transaction*: a transaction applying the batches of several partitions, of one
//!   group or of several groups of the process (`transaction::SharedTransactions`,
//!   `shared_transactions`, `shared_transaction_gather`).
//! - *finished offset*: the offset after a batch whose transaction committed, for the member to
//!   commit to Kafka; an aggregate's *progress* is its last applied sequence (`aggregate_progress`).
//! - *paused group*: a group an operator paused (`group_pause`, see `pause`); a partition's
//!   *fetch pause* is librdkafka's, set while its group is paused or its task has too much
//!   queued.

#![deny(missing_docs)]

mod error;
pipeline_core::inner_modules!(
    backoff,
    handlers,
    kafka,
    metrics,
    partition,
    pause,
    rate_limit,
    runtime,
    settings,
    transaction,
);
pub mod operator;
pub mod retention;

use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use crate::backoff::backoff;
pub use crate::error::ConsumerError;
pub use crate::handlers::{
    Event, Groups, Handler, HandlerError, HandlerTransaction, UnknownGroup, Waiting,
};
pub use crate::kafka::GroupProtocol;
pub use crate::rate_limit::{InvalidRateLimit, RateLimit, RatePeriod, MAX_EVENTS_PER_SECOND};
pub use crate::runtime::Runtime;
pub use crate::settings::{connect, session_options, ConsumerSettings, InvalidSettings};

/// The consumer library's migrations: what any group needs besides its own effect tables
/// (dedupe rows, progress, parked events, dead letters, effect history, partition ownership,
/// retention's state, the groups' rate limits, paused groups).
/// Apply them only where the program is meant to set up the database.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// Runs the groups `settings` names (each looked up in `groups`; every registered group when it
/// names none) on `pool`, with their metrics on `registry`, until `shutdown` (or a fatal error,
/// which is returned). See [`Runtime::start`] for its steps.
pub async fn run(
    settings: ConsumerSettings,
    pool: PgPool,
    registry: &Registry,
    groups: &Groups,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    Runtime::start(settings, pool, registry, groups, shutdown)
        .await?
        .wait()
        .await
}
