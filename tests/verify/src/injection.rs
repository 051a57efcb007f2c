//! What one injection did, handed from the injector's fault methods to the fault's record, and
//! the bounds they share.

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// A fault is abandoned when the pipeline has not recovered this long after it ended.
pub(crate) const RECOVERY_DEADLINE: Duration = Duration::from_secs(180);
/// After two nodes went down: acknowledgements already on their way, and the relay's marking
/// of a batch wholly acknowledged before, end within this. From then on until a node is back,
/// the count of events marked published must not grow.
pub const OUTAGE_GRACE: Duration = Duration::from_secs(3);

/// What an injection did, once the faulted part is back.
pub(crate) struct Injected {
    pub(crate) target: String,
    pub(crate) happened: bool,
    pub(crate) note: Option<String>,
    /// How long after the fault was in place (the relay stopped, or its database cut off)
    /// another process took over.
    pub(crate) takeover: Option<Duration>,
    /// When both groups applied events after that takeover.
    pub(crate) recovered: Option<Instant>,
    /// For a Kafka node fault: whether a failover was awaited, and when the faulted node's
    /// partitions all had new leaders.
    pub(crate) failover: Option<Option<Instant>>,
    /// For a Kafka node fault: when an event committed after it began was marked published.
    pub(crate) publish_resumed: Option<Instant>,
    pub(crate) write_outage: Option<WriteOutage>,
}

/// What the relay marked published while two Kafka nodes were down.
#[derive(Debug, Clone, Serialize)]
pub struct WriteOutage {
    /// How long both nodes were down (until the first was started again).
    pub seconds: f64,
    /// Events marked published between [`OUTAGE_GRACE`] after the nodes went down and the
    /// first node's start: must be 0.
    pub published_during: i64,
    /// Events committed after the nodes went down that were marked published before the first
    /// node's start: must be 0.
    pub published_early: i64,
    /// Events waiting in the outbox when the first node was started again.
    pub unpublished_at_return: i64,
    /// From the first node's start until an event committed during the outage was marked
    /// published.
    pub resumed_after_return_seconds: Option<f64>,
}

impl WriteOutage {
    /// Whether the relay marked nothing published while the cluster could take no writes.
    pub fn held(&self) -> bool {
        self.published_during == 0 && self.published_early == 0
    }
}

/// A fault that happened to `target`, nothing more known yet.
pub(crate) fn done(target: &str) -> Injected {
    Injected {
        happened: true,
        ..not_injected(target.to_owned())
    }
}

/// A fault meant for `target` that did not happen.
pub(crate) fn not_injected(target: String) -> Injected {
    Injected {
        target,
        happened: false,
        note: None,
        takeover: None,
        recovered: None,
        failover: None,
        publish_resumed: None,
        write_outage: None,
    }
}
