//! An example to copy: a payments service that appends its own aggregate's events through the
//! outbox library inside its own transactions ([`Payments`]), and a consumer group of its own,
//! `shipping` ([`Shipping`]), run by the consumer runtime inside the example's program
//! ([`program`]), beside the relay, which makes its own pool and Prometheus registry, serves the
//! libraries' metrics on its own router and sets up only the libraries' tables and its own.
//! docs/embedding.md walks through it step by step.
//!
//! ```no_run
//! # async fn main_of_the_program() -> anyhow::Result<()> {
//! use payments_example::program::{self, Config};
//!
//! let mut config = Config::default();
//! config.consumer.topics = vec!["payment-events".to_owned()];
//! config.db.database_url = "postgres://app@db.internal/payments".to_owned();
//! program::run(config, tokio_util::sync::CancellationToken::new()).await
//! # }
//! ```
//!
//! - [`payments`]: the service's writes, each with its event, through the outbox.
//! - [`shipping`]: the `shipping` group's handler.
//! - [`program`]: the program: its pool, tables, registry and router, the group run on the
//!   consumer runtime, and the relay.
//!
//! `tests/end_to_end.rs` runs the service and the group with the relay on the real broker and
//! PostgreSQL; `tests/tables.rs` checks that the program sets up no table of the demonstration.

#![deny(missing_docs)]

pub mod payments;
pub mod program;
pub mod shipping;

use sqlx::migrate::Migrator;

pub use payments::Payments;
pub use shipping::Shipping;

/// The example's own tables (payments, and the shipping group's log), beside the outbox's and
/// the consumer library's.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};
