//! What the outbox's relay, the consumer runtime and the operator command share: the event
//! envelope and record headers, database and Kafka settings, a producer whose delivery reports are
//! futures and whose idle polling costs nothing, the operations endpoint, telemetry,
//! the overlap of shared transactions, the retention runner that keeps tables flat, and crash
//! points for fault-injection runs.
//!
//! The command-line forms of the settings (`clap`) come with the `cli` feature, for binaries.

pub mod crash_point;
pub mod db;
pub mod envelope;
pub mod http_server;
pub mod kafka;
pub mod ops_http;
pub mod overlap;
pub mod producer;
pub mod record;
pub mod retention;
pub mod telemetry;
