//! Why the consumer runtime could not start, or had to stop: what [`crate::run`],
//! [`crate::Runtime::start`] and [`crate::Runtime::wait`] return, for a host to branch on.

use crate::handlers::UnknownGroup;
use crate::settings::InvalidSettings;

/// Why the consumer runtime could not start, or had to stop; the cause is its `source()`
/// (anyhow's `{:#}` prints the whole chain). Failures it waits out (the
/// database or the brokers away for a while, a batch that failed, a dependency a handler reports
/// unavailable) are not errors: the partitions retry and wait by themselves.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The settings do not make a working runtime: fix them.
    #[error(transparent)]
    InvalidSettings(#[from] InvalidSettings),
    /// A group the settings name is not registered with the program.
    #[error(transparent)]
    UnknownGroup(#[from] UnknownGroup),
    /// The settings name no group and the program registers none.
    #[error("no consumer group to run: the program registers none")]
    NoGroup,
    /// Its metrics could not be registered: the registry already has metrics of these names
    /// (one runtime per registry).
    #[error("registering the consumer runtime's metrics")]
    Metrics(#[from] prometheus::Error),
    /// A group's own metrics (registered with [`crate::Groups`]) could not be registered; the
    /// source names the group.
    #[error("registering a group's own metrics")]
    GroupMetrics(#[source] anyhow::Error),
    /// A start-up step could not use the groups' database (unreachable, or without the
    /// library's tables: `consumer::MIGRATOR`); the source says which step.
    #[error("the groups' database")]
    Database(#[source] anyhow::Error),
    /// A Kafka client could not be made, or the dead-letter topics created; the source says
    /// which.
    #[error("Kafka")]
    Kafka(#[source] anyhow::Error),
    /// A group stopped on an error it cannot wait out (its source says which), or the runtime
    /// stopped on a fatal error of one of its parts.
    #[error("the consumer runtime stopped")]
    Stopped(#[source] anyhow::Error),
}
