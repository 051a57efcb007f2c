//! The demonstration's contract, shared by the order service, the demo consumer groups, the load
//! generator, the benchmark and the verification run: the events they exchange and the tables
//! the demonstration adds beside the pipeline's own.
//!
//! - [`order_events`]: the order events (`order-events` topic) and the order snapshot they carry.
//! - [`export_events`]: export requests (`export-jobs` topic), their filters and file names.
//! - [`schema`]: the demonstration's migrations, and every set of the demonstration's single
//!   database in one.

pub mod export_events;
pub mod order_events;
pub mod schema;

pub use schema::MIGRATOR;
