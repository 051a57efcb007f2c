//! A member's settings: what its Kafka consumer is configured with, read by the poll loop
//! (`member`), its client context (`rebalance`) and its partition tasks (`tasks`).

use std::time::Duration;

/// Settings of a member's Kafka consumer.
#[derive(Debug, Clone)]
pub struct MemberSettings {
    /// Topics the group subscribes to.
    pub topics: Vec<String>,
    /// `group.protocol`.
    pub group_protocol: GroupProtocol,
    /// `partition.assignment.strategy` (classic protocol only).
    pub assignment_strategy: String,
    /// `session.timeout.ms` (classic protocol only: the consumer protocol's is the broker's).
    pub session_timeout: Duration,
    /// `max.poll.interval.ms`; polling runs on its own thread, so slow batches do not count.
    pub max_poll_interval: Duration,
    /// `fetch.wait.max.ms`.
    pub fetch_wait_max: Duration,
    /// Shortest time between two commits of finished offsets.
    pub commit_interval: Duration,
    /// How long a revoke waits for in-flight batches before giving up on them.
    pub revoke_timeout: Duration,
    /// Messages queued for one partition's task before the partition is paused.
    pub max_queued: usize,
    /// How long the database may be out of reach before the member leaves the group.
    pub leave_after_database_unreachable: Duration,
}

/// The consumer group protocol a member speaks (`group.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[cfg_attr(feature = "cli", value(rename_all = "lower"))]
pub enum GroupProtocol {
    /// The classic protocol: the members' leader computes the assignment (here incrementally,
    /// with the `cooperative-sticky` assignor), each member sends its own session timeout.
    #[default]
    Classic,
    /// KIP-848 (Apache Kafka 4.0 or newer): the broker computes each member's assignment and
    /// changes it incrementally; the session timeout, the heartbeat interval and the assignor
    /// are the broker's settings.
    Consumer,
}

impl GroupProtocol {
    /// The value of librdkafka's `group.protocol`.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
}
