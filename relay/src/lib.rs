//! The outbox relay: tails the outbox table and publishes its events to Kafka with `acks=all`,
//! the idempotent producer and the aggregate id as key. One relay among those sharing a lease
//! key is active; the others stand by and take over when it dies, freezes or is cut off.
//!
//! A program embeds it with its own pool, Prometheus registry and shutdown token; the `relay`
//! binary (package `relay-cli`) is such a program, adding the command line, logging and the ops
//! endpoint:
//!
//! ```no_run
//! # async fn embed() -> anyhow::Result<()> {
//! use pipeline_core::db::DbArgs;
//! use relay::RelaySettings;
//!
//! let settings = RelaySettings {
//!     batch_size: 1000,
//!     ..RelaySettings::default()
//! };
//! let db = DbArgs {
//!     database_url: "postgres://app@db.internal/shop".to_owned(),
//!     ..DbArgs::default()
//! };
//! let pool = relay::connect(&db, &settings).await?;
//! relay::MIGRATOR.run(&pool).await?; // only if this program sets up the outbox's tables
//! let registry = prometheus::Registry::new();
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! relay::run(settings, pool, &registry, shutdown).await?;
//! # Ok(())
//! # }
//! ```
//!
//! The modules, along an event's way:
//! - `settings`: [`RelaySettings`] and the database sessions they call for ([`connect`]).
//! - `runtime`: [`Relay`], the whole: standing by, taking turns with other relays, and what
//!   runs beside.
//! - `lease`: the election of the one active relay, and the fence its writes carry.
//! - `active`: the loop while the lease is held, up to `pipeline_depth` batches at once.
//! - `wakeup`: waiting for new events on LISTEN, and telling writers when to notify.
//! - `batch`: one batch's two steps, claim and publish.
//! - `claim`: reading the next due events from the queue.
//! - `publish`: the Kafka producer and one batch's delivery.
//! - `mark`: recording what Kafka did, fenced by the lease.
//! - `backoff`: when a failed event is tried again, and when it is given up.
//! - `release`: moving delayed events that fell due into the outbox.
//! - `backlog`: the queue, lease and delayed-event gauges.
//! - `vacuum`: keeping the queue table small.
//! - `wal`: the outbox's inserts read from PostgreSQL's write-ahead log through a logical
//!   replication slot (the `outbox_events` publication), each committed transaction with the
//!   position that confirms it.
//! - `metrics`: the relay's Prometheus metrics.

#![deny(missing_docs)]

mod error;
pipeline_core::inner_modules!(
    active, backlog, backoff, batch, claim, lease, mark, metrics, publish, release, runtime,
    schedule, settings, vacuum, wakeup, wal,
);
pub mod retention;

pub use error::RelayError;
/// The tables the relay reads and writes: the outbox's. Apply them only where the program is
/// meant to set up the database.
pub use outbox::MIGRATOR;
pub use runtime::{run, Relay};
pub use settings::{
    connect, session_options, InvalidSettings, RelaySettings, Source, SourceSettings, DEFAULT_SLOT,
};

// The relay publishes what the outbox accepted, and consumers read it through the envelope: the
// two crates' limits must agree (pipeline-core does not depend on the outbox).
const _: () = assert!(pipeline_core::envelope::MAX_KEY_BYTES == outbox::MAX_AGGREGATE_ID_BYTES);
const _: () =
    assert!(pipeline_core::envelope::MAX_EVENT_TYPE_BYTES == outbox::MAX_EVENT_TYPE_BYTES);
