//! What the outbox's relay, the consumer runtime and the operator command share: the event
//! envelope and record headers, database and Kafka settings, a producer whose delivery reports are
//! futures and whose idle polling costs nothing, the operations endpoint, telemetry,
//! the overlap of shared transactions, the retention runner that keeps tables flat, and crash
//! points for fault-injection runs.
//!
//! Features, all off by default so that a library depending on this crate brings no HTTP server,
//! log set-up or command line: `cli` (the settings' `clap` forms), `http` ([`http_server`] and
//! [`ops_http`]: axum, hyper, tower) and `telemetry` ([`telemetry`]: tracing-subscriber and
//! signal handling), which binaries turn on.

#![deny(missing_docs)]

/// Declares a library's inner modules: private, so that the library's API is what its root
/// re-exports, or public with the library's `internals` feature, which the workspace's own tests
/// and benchmark turn on to drive one step at a time (not part of the API, and not covered by
/// its versioning). Their items are written `pub` for the second case, so the lints that the first
/// would raise about them (unreachable `pub`, items and
/// re-exports only the tests use) are off there.
#[macro_export]
macro_rules! inner_modules {
    ($($name:ident),* $(,)?) => {
        $(
            #[cfg(feature = "internals")]
            pub mod $name;
            #[cfg(not(feature = "internals"))]
            #[allow(unreachable_pub, dead_code, unused_imports)]
            mod $name;
        )*
    };
}

pub mod crash_point;
pub mod db;
pub mod envelope;
#[cfg(feature = "http")]
pub mod http_server;
pub mod kafka;
#[cfg(feature = "http")]
pub mod ops_http;
pub mod overlap;
pub mod producer;
pub mod record;
pub mod retention;
#[cfg(feature = "telemetry")]
pub mod telemetry;
