//! The test kit: runs the real `producer`, `load`, `relay` and `consumer` binaries against
//! PostgreSQL and a Kafka-protocol broker, each test in its own database, topic and consumer
//! groups. The end-to-end tests (`tests/kit/tests/`), the benchmark (`tests/bench`) and the
//! verification run (`tests/verify`) use it, and the other crates' tests take their database URLs
//! from it.
//!
//! - [`TestEnv`] (`env`): one isolated environment and the binaries started in it;
//! - [`Service`] (`service`): a running binary, its log and its signals;
//! - [`db`]: test databases (the server, their URLs, making and dropping them);
//! - [`history`]: outbox rows of a given age, written as the library and the relay would;
//! - [`kafka`]: the broker, consumer groups' committed lag, and reading a topic;
//! - [`secure`]: certificates, a three-node SASL/SCRAM-over-TLS Kafka cluster and PostgreSQL
//!   over TLS;
//! - [`wait_until`] (`wait`): waiting for a condition with a deadline;
//! - [`scrape_sum`] (`metrics`): reading a binary's `/metrics`; [`one_active_relay`].
//!
//! Environment: `DATABASE_URL` (a server URL whose database is used only to create test
//! databases; default `postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable`),
//! `KAFKA_BROKERS` (default `127.0.0.1:9092`), `PIPELINE_BIN_DIR` (default: the directory of the
//! test executable's parent, i.e. `target/<profile>`). Build the binaries first
//! (`cargo build --release --bins`).

pub mod db;
pub mod effects;
mod env;
pub mod history;
pub mod kafka;
mod metrics;
pub mod secure;
mod service;
mod wait;

pub use env::{TestEnv, Transport};
pub use metrics::{metric_sum, one_active_relay, scrape, scrape_sum};
pub use service::{bin_dir, Service};
pub use wait::wait_until;
