//! The member's offset commits. Partition tasks report the offset after each batch once its
//! database transaction has committed; the member collects them, commits them to Kafka together,
//! and commits again what failed while the partition is still its own. Only the latest commit
//! asked for per partition is retried, so a late failure of an older one cannot move the group's
//! offset back.

use std::collections::HashMap;
use std::sync::{mpsc, Mutex};
use std::time::Instant;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};

use super::tasks::{lock, PartitionKey, PartitionTasks};
use crate::metrics::ConsumerMetrics;
use crate::partition::FinishedOffset;

/// Offsets finished by the member's tasks, and those it asked Kafka to commit.
pub(crate) struct Offsets {
    group: String,
    metrics: ConsumerMetrics,
    finished: Mutex<mpsc::Receiver<FinishedOffset>>,
    /// Offsets finished by tasks and not yet committed.
    pending: Mutex<HashMap<PartitionKey, i64>>,
    /// The offset of the latest commit asked for, per partition: only its failure is retried,
    /// so a late failure of an older commit cannot move the group's offset back.
    requested: Mutex<HashMap<PartitionKey, i64>>,
}

impl Offsets {
    /// Nothing finished yet; tasks report to the sender of `finished`.
    pub(crate) fn new(
        group: String,
        metrics: ConsumerMetrics,
        finished: mpsc::Receiver<FinishedOffset>,
    ) -> Self {
        Offsets {
            group,
            metrics,
            finished: Mutex::new(finished),
            pending: Mutex::new(HashMap::new()),
            requested: Mutex::new(HashMap::new()),
        }
    }

    /// Moves finished offsets reported by tasks into `pending`.
    pub(crate) fn collect_finished(&self) {
        let rx = lock(&self.finished);
        let mut pending = lock(&self.pending);
        while let Ok(p) = rx.try_recv() {
            let slot = pending
                .entry((p.topic, p.partition))
                .or_insert(p.next_offset);
            *slot = (*slot).max(p.next_offset);
        }
    }

    /// Takes pending offsets, of `keys` only when given.
    pub(crate) fn take_pending(&self, keys: Option<&[PartitionKey]>) -> Vec<(PartitionKey, i64)> {
        let mut pending = lock(&self.pending);
        match keys {
            None => pending.drain().collect(),
            Some(keys) => keys
                .iter()
                .filter_map(|k| pending.remove(k).map(|o| (k.clone(), o)))
                .collect(),
        }
    }

    /// Commits `offsets`; an asynchronous commit that cannot even be queued is retried while
    /// its partition has a task in `tasks`.
    pub(crate) fn commit<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        tasks: &PartitionTasks,
        offsets: &[(PartitionKey, i64)],
        mode: CommitMode,
    ) {
        if offsets.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::with_capacity(offsets.len());
        for ((topic, partition), offset) in offsets {
            if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
                tracing::error!(group = %self.group, error = %e, "cannot build commit list");
                return;
            }
        }
        {
            let mut requested = lock(&self.requested);
            for (key, offset) in offsets {
                let _ = requested.insert(key.clone(), *offset);
            }
        }
        let started = Instant::now();
        let result = consumer.commit(&tpl, mode);
        self.metrics
            .commit_duration
            .with_label_values(&[&self.group])
            .observe(started.elapsed().as_secs_f64());
        // A synchronous commit's answer also reaches the commit callback; an asynchronous one
        // that could not even be queued does not.
        if let (Err(e), CommitMode::Async) = (result, mode) {
            self.commit_failed(&e.to_string());
            self.retry_commit(tasks, offsets);
        }
    }

    /// Counts and logs a failed commit.
    pub(crate) fn commit_failed(&self, error: &str) {
        self.metrics
            .commit_failures
            .with_label_values(&[&self.group])
            .inc();
        tracing::warn!(group = %self.group, error, "offset commit failed; retrying while the partition is ours");
    }

    /// Commits again, asynchronously, the latest offset asked for on every partition this member
    /// still owns. Repeating a commit is harmless, and it heals commits that failed without a
    /// callback reporting it: librdkafka drops a manual commit made while the group is between
    /// generations ("generation id not valid"), and a partition that then stays quiet would keep
    /// its lag until the next rebalance.
    pub(crate) fn recommit_owned<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        tasks: &PartitionTasks,
    ) {
        let offsets: Vec<(PartitionKey, i64)> = {
            let tasks = tasks.running();
            let requested = lock(&self.requested);
            requested
                .iter()
                .filter(|(key, _)| tasks.contains_key(*key))
                .map(|(key, offset)| (key.clone(), *offset))
                .collect()
        };
        self.commit(consumer, tasks, &offsets, CommitMode::Async);
    }

    /// The next offset after the last message of `key` this member's tasks finished (applied or
    /// otherwise settled in the database), as far as the member knows: pending or asked to be
    /// committed.
    pub(crate) fn latest_finished(&self, key: &PartitionKey) -> Option<i64> {
        self.collect_finished();
        let pending = lock(&self.pending).get(key).copied();
        let requested = lock(&self.requested).get(key).copied();
        pending.max(requested)
    }

    /// Forgets the commits asked for on `keys`: a partition that comes back later must not have
    /// this member's old offset committed again.
    pub(crate) fn forget_requested(&self, keys: &[PartitionKey]) {
        let mut requested = lock(&self.requested);
        for key in keys {
            let _ = requested.remove(key);
        }
    }

    /// Puts offsets whose commit failed back into `pending`, for partitions this member still
    /// owns (has a task in `tasks` for); a revoked or lost partition's offsets are dropped, its
    /// next owner redelivers and skips them as duplicates.
    pub(crate) fn retry_commit(&self, tasks: &PartitionTasks, offsets: &[(PartitionKey, i64)]) {
        let tasks = tasks.running();
        let requested = lock(&self.requested);
        let mut pending = lock(&self.pending);
        requeue_failed_commits(
            offsets,
            |key| tasks.contains_key(key),
            &requested,
            &mut pending,
        );
    }
}

/// Moves the offsets of failed commits back into `pending`: only for partitions still `owned`,
/// and only when no later commit was asked for since (that one's own outcome decides).
fn requeue_failed_commits(
    failed: &[(PartitionKey, i64)],
    owned: impl Fn(&PartitionKey) -> bool,
    requested: &HashMap<PartitionKey, i64>,
    pending: &mut HashMap<PartitionKey, i64>,
) {
    for (key, offset) in failed {
        let latest = requested.get(key).is_none_or(|r| *offset >= *r);
        if latest && owned(key) {
            let slot = pending.entry(key.clone()).or_insert(*offset);
            *slot = (*slot).max(*offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{requeue_failed_commits, PartitionKey};

    fn key(p: i32) -> PartitionKey {
        ("orders".to_owned(), p)
    }

    #[test]
    fn a_failed_commit_is_retried_only_while_owned_and_latest() {
        let requested: HashMap<PartitionKey, i64> =
            [(key(0), 150), (key(1), 40), (key(2), 70)].into();
        let mut pending: HashMap<PartitionKey, i64> = [(key(2), 90)].into();
        requeue_failed_commits(
            &[(key(0), 100), (key(1), 40), (key(2), 70), (key(3), 5)],
            |k| k.1 != 3,
            &requested,
            &mut pending,
        );
        // 0: an older commit failed after 150 was asked for: not retried (no rewind).
        // 1: the latest commit failed: retried. 2: a later finished offset is already pending.
        // 3: no longer ours: dropped.
        assert_eq!(pending, [(key(1), 40), (key(2), 90)].into());
    }
}
