//! What a partition task is given: the group's database, handler and settings it shares with the
//! group's other tasks, where it reports each finished offset, and how it stops the process.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use pipeline_core::retention::Backlog;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::handlers::Handler;
use crate::metrics::ConsumerMetrics;
use crate::rate_limit::GroupRateLimiter;
use crate::transaction::{DeadLetterSink, SharedTransactions};

/// A finished offset: a batch's transaction committed, so the member may commit `next_offset`
/// for this partition to Kafka.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedOffset {
    /// Topic of the partition.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset after the batch's last message: the one to commit.
    pub next_offset: i64,
}

/// Stops the whole process with a reason, for errors no retry can fix.
#[derive(Clone, Default)]
pub struct FatalSignal {
    /// Cancelled when the signal is raised.
    pub token: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
}

impl FatalSignal {
    /// Records `reason` (the first one raised is kept) and cancels [`FatalSignal::token`].
    pub fn raise(&self, reason: String) {
        if let Ok(mut slot) = self.reason.lock() {
            slot.get_or_insert(reason);
        }
        self.token.cancel();
    }

    /// The first reason raised, if any.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

/// What a partition task runs with: the group's database, handler and settings, the same for
/// every task of the group.
#[derive(Clone)]
pub struct TaskContext {
    /// The group's database.
    pub pool: PgPool,
    /// The group's handler.
    pub handler: Arc<dyn Handler>,
    /// When set, dead letters are also published to the dead-letter topic before commit.
    pub dead_letters: Option<Arc<DeadLetterSink>>,
    /// Where batches, outcomes, retries and delays are counted.
    pub metrics: ConsumerMetrics,
    /// Where tasks report a batch's offset to commit, only after its database commit.
    pub finished: mpsc::Sender<FinishedOffset>,
    /// Raised on an error no retry fixes, to stop the whole process.
    pub fatal: FatalSignal,
    /// Most messages in one batch (with a rate limit, at most its bucket's size).
    pub max_batch: usize,
    /// Transactions of at most this many messages plan with their values.
    pub custom_plans_up_to: usize,
    /// Retry delay after a batch's first failure; it doubles with each further attempt, with
    /// jitter, up to `retry_max`.
    pub retry_base: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// How long a batch may keep failing, with the database answering, before its messages are
    /// isolated and the failing one dead-lettered.
    pub retry_budget: Duration,
    /// When set, batches go through the group's shared transactions (see [`SharedTransactions`]).
    pub shared_transactions: Option<Arc<SharedTransactions>>,
    /// When set, the group's rate limit in this process: each batch takes a token per message
    /// before its transaction.
    pub rate_limit: Option<Arc<GroupRateLimiter>>,
    /// Raised when a batch takes as many messages as it may (the partition is behind, not held
    /// back by a rate limit): retention in this process waits while it is.
    pub backlog: Backlog,
}
