//! The pipeline benchmark (`bench` binary, `scripts/bench.sh`): one run measures the broker's
//! and PostgreSQL's ceilings, the relay's and each consumer group's drain rates, end-to-end
//! latency at fixed open-loop rates, the highest sustained rate and each process's CPU and peak
//! memory, each phase in its own database, topic and consumer groups.
//!
//! - [`run`]: the phases asked for, in order, and the clean-up ([`run_and_clean_up`]);
//! - [`config`]: the command line and the settings it resolves to;
//! - the phases: [`idle`], [`broker`], [`database`], [`relay_drain`], [`consumer_drain`], [`latency`]
//!   ([`broker_latency`]), [`sustained`], [`delayed`], [`retention`], [`relay_cost`];
//! - [`driver`] (the load) and [`orders`] (the events' shape); [`services`] and [`envs`]: the
//!   binaries and the environments they run in;
//! - [`procstat`], [`cpuprofile`], [`dbprofile`], [`statements`]: CPU, where it goes by function,
//!   memory, database activity and what each program asked of the database;
//! - [`report`] and [`table`]: the figures, the targets and their table.

pub mod broker;
pub mod broker_latency;
pub mod config;
pub mod consumer_drain;
pub mod cpuprofile;
pub mod database;
pub mod dbprofile;
pub mod delayed;
pub mod driver;
pub mod envs;
pub mod idle;
pub mod latency;
pub mod orders;
pub mod procstat;
pub mod relay_cost;
pub mod relay_drain;
pub mod report;
pub mod retention;
pub mod run;
pub mod services;
pub mod statements;
pub mod sustained;
pub mod table;

pub use run::{run_and_clean_up, say};
