//! The rebalance side of a consumer group: the client context whose callbacks start and stop
//! partition tasks, and the hand-off of polled messages to those tasks.
//!
//! On revoke it stops the revoked partitions' tasks (an in-flight transaction finishes; nothing
//! new starts), then commits synchronously what they finished, while the partitions are still
//! owned. Lost partitions are not committed at all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pipeline_core::envelope::Envelope;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_util::sync::CancellationToken;

use crate::apply::{InboundMessage, RecordHeaders};
use crate::worker::{PartitionWorker, Progress, WorkerShared};

pub(crate) type PartitionKey = (String, i32);

pub(crate) struct PartitionTask {
    sender: UnboundedSender<InboundMessage>,
    queued: Arc<AtomicUsize>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    paused: bool,
}

/// Rebalance callbacks and the state they share with the poll loop.
pub(crate) struct GroupContext {
    group: String,
    runtime: tokio::runtime::Handle,
    shared: WorkerShared,
    tasks: Mutex<HashMap<PartitionKey, PartitionTask>>,
    progress: Mutex<mpsc::Receiver<Progress>>,
    /// Offsets finished by tasks and not yet committed.
    pending: Mutex<HashMap<PartitionKey, i64>>,
    /// The offset of the latest commit asked for, per partition: only its failure is retried,
    /// so a late failure of an older commit cannot move the group's offset back.
    requested: Mutex<HashMap<PartitionKey, i64>>,
    revoke_timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks already stops the process; keep going with the data.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(group = %self.group, fac, "librdkafka: {message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(group = %self.group, fac, "librdkafka: {message}")
            }
            _ => tracing::debug!(group = %self.group, fac, "librdkafka: {message}"),
        }
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let lost = consumer.assignment_lost();
                let kind = if lost { "lost" } else { "revoke" };
                self.shared
                    .metrics
                    .rebalances
                    .with_label_values(&[&self.group, kind])
                    .inc();
                let keys = partition_keys(tpl);
                tracing::info!(group = %self.group, partitions = keys.len(), lost, "partitions revoked");
                self.stop_tasks(&keys);
                self.collect_progress();
                let finished = self.take_pending(Some(&keys));
                if lost {
                    if !finished.is_empty() {
                        tracing::warn!(group = %self.group, partitions = finished.len(),
                            "assignment lost: not committing; the next owner skips these as duplicates");
                    }
                } else {
                    self.commit(consumer, &finished, CommitMode::Sync);
                }
                // After the commit above, which records what it asked for: a partition that
                // comes back later must not have this member's old offset committed again.
                self.forget_requested(&keys);
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => {
                tracing::error!(group = %self.group, error = %e, "rebalance error");
                self.shared
                    .metrics
                    .rebalances
                    .with_label_values(&[&self.group, "error"])
                    .inc();
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.shared
                .metrics
                .rebalances
                .with_label_values(&[&self.group, "assign"])
                .inc();
            let keys = partition_keys(tpl);
            self.forget_requested(&keys);
            for key in &keys {
                let _ = self.task_for(key);
            }
            tracing::info!(group = %self.group, partitions = tpl.count(), "partitions assigned");
        }
        let assigned = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        self.shared
            .metrics
            .assigned_partitions
            .with_label_values(&[&self.group])
            .set(assigned as i64);
    }

    /// Called for every commit the broker answered, synchronous or not. A commit can fail for
    /// some of its partitions only (e.g. "generation id not valid" while the group rebalances):
    /// those offsets go back to `pending` while their partitions are still ours, so the poll loop
    /// commits them again. Without this, the last batch's offsets before a quiet spell stayed
    /// uncommitted, and the group's lag with them.
    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        let failed: Vec<(PartitionKey, i64, String)> = offsets
            .elements()
            .iter()
            .filter_map(|e| {
                let error = match (&result, e.error()) {
                    (_, Err(pe)) => pe.to_string(),
                    (Err(re), Ok(())) => re.to_string(),
                    (Ok(()), Ok(())) => return None,
                };
                match e.offset() {
                    Offset::Offset(o) => Some(((e.topic().to_owned(), e.partition()), o, error)),
                    _ => None,
                }
            })
            .collect();
        if let Some((_, _, error)) = failed.first() {
            self.commit_failed(error);
            let retry: Vec<(PartitionKey, i64)> =
                failed.into_iter().map(|(k, o, _)| (k, o)).collect();
            self.retry_commit(&retry);
        }
    }
}

impl GroupContext {
    pub(crate) fn new(
        group: String,
        runtime: tokio::runtime::Handle,
        shared: WorkerShared,
        progress: mpsc::Receiver<Progress>,
        revoke_timeout: Duration,
    ) -> Self {
        GroupContext {
            group,
            runtime,
            shared,
            tasks: Mutex::new(HashMap::new()),
            progress: Mutex::new(progress),
            pending: Mutex::new(HashMap::new()),
            requested: Mutex::new(HashMap::new()),
            revoke_timeout,
        }
    }

    /// The task of a partition, started on first use.
    pub(crate) fn task_for(&self, key: &PartitionKey) -> UnboundedSender<InboundMessage> {
        let mut tasks = lock(&self.tasks);
        if let Some(t) = tasks.get(key) {
            return t.sender.clone();
        }
        let (sender, rx) = unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let worker = PartitionWorker::new(
            self.shared.clone(),
            key.0.clone(),
            key.1,
            rx,
            queued.clone(),
            stop.clone(),
        );
        let done = self.runtime.spawn(worker.run());
        let _ = tasks.insert(
            key.clone(),
            PartitionTask {
                sender: sender.clone(),
                queued,
                stop,
                done,
                paused: false,
            },
        );
        sender
    }

    /// Stops the tasks of `keys` (all when `None`) and waits for them, up to the revoke timeout.
    pub(crate) fn stop_tasks(&self, keys: &[PartitionKey]) {
        let stopping = self.cancel_tasks(keys);
        let deadline = self.revoke_timeout;
        let waited = self.runtime.block_on(async move {
            tokio::time::timeout(
                deadline,
                futures::future::join_all(stopping.into_iter().map(|t| t.done)),
            )
            .await
        });
        if waited.is_err() {
            tracing::warn!(group = %self.group, "in-flight batches did not finish within the revoke timeout");
        }
    }

    /// Stops the tasks of `keys` without waiting for them: used when the database is out of
    /// reach and their batches may hang until it comes back. Whatever those batches try later
    /// is refused by the ownership check (the partitions' next owner replaced the token).
    pub(crate) fn abandon_tasks(&self, keys: &[PartitionKey]) {
        let abandoned = self.cancel_tasks(keys);
        if !abandoned.is_empty() {
            tracing::warn!(group = %self.group, partitions = abandoned.len(), "partition tasks abandoned");
        }
    }

    /// Takes the tasks of `keys` out of the group and tells each to stop.
    fn cancel_tasks(&self, keys: &[PartitionKey]) -> Vec<PartitionTask> {
        let cancelled: Vec<PartitionTask> = {
            let mut tasks = lock(&self.tasks);
            keys.iter().filter_map(|k| tasks.remove(k)).collect()
        };
        for t in &cancelled {
            t.stop.cancel();
        }
        cancelled
    }

    pub(crate) fn count_database_departure(&self) {
        self.shared
            .metrics
            .database_departures
            .with_label_values(&[&self.group])
            .inc();
    }

    pub(crate) fn all_keys(&self) -> Vec<PartitionKey> {
        lock(&self.tasks).keys().cloned().collect()
    }

    /// Moves finished offsets reported by tasks into `pending`.
    pub(crate) fn collect_progress(&self) {
        let rx = lock(&self.progress);
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

    pub(crate) fn commit(
        &self,
        consumer: &BaseConsumer<Self>,
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
        self.shared
            .metrics
            .commit_duration
            .with_label_values(&[&self.group])
            .observe(started.elapsed().as_secs_f64());
        // A synchronous commit's answer also reaches `commit_callback`; an asynchronous one that
        // could not even be queued does not.
        if let (Err(e), CommitMode::Async) = (result, mode) {
            self.commit_failed(&e.to_string());
            self.retry_commit(offsets);
        }
    }

    fn commit_failed(&self, error: &str) {
        self.shared
            .metrics
            .commit_failures
            .with_label_values(&[&self.group])
            .inc();
        tracing::warn!(group = %self.group, error, "offset commit failed; retrying while the partition is ours");
    }

    /// Commits again, asynchronously, the latest offset asked for on every partition this member
    /// still owns. Repeating a commit is harmless, and it heals commits that failed without a
    /// callback reporting it: librdkafka drops a manual commit made while the group is between
    /// generations ("generation id not valid"), and a partition that then stays quiet kept its
    /// lag until the next rebalance (seen in the verification run).
    pub(crate) fn recommit_owned(&self, consumer: &BaseConsumer<Self>) {
        let offsets: Vec<(PartitionKey, i64)> = {
            let tasks = lock(&self.tasks);
            let requested = lock(&self.requested);
            requested
                .iter()
                .filter(|(key, _)| tasks.contains_key(*key))
                .map(|(key, offset)| (key.clone(), *offset))
                .collect()
        };
        self.commit(consumer, &offsets, CommitMode::Async);
    }

    fn forget_requested(&self, keys: &[PartitionKey]) {
        let mut requested = lock(&self.requested);
        for key in keys {
            let _ = requested.remove(key);
        }
    }

    /// Puts offsets whose commit failed back into `pending`, for partitions this member still
    /// owns; a revoked or lost partition's offsets are dropped, its next owner redelivers and
    /// skips them as duplicates.
    fn retry_commit(&self, offsets: &[(PartitionKey, i64)]) {
        let tasks = lock(&self.tasks);
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

fn partition_keys(tpl: &TopicPartitionList) -> Vec<PartitionKey> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
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

pub(crate) fn dispatch(ctx: &GroupContext, msg: &BorrowedMessage<'_>) {
    let inbound = inbound_message(msg);
    let key = (inbound.topic.clone(), inbound.partition);
    let sender = ctx.task_for(&key);
    if let Some(t) = lock(&ctx.tasks).get(&key) {
        let _ = t.queued.fetch_add(1, Ordering::AcqRel);
    }
    if sender.send(inbound).is_err() {
        tracing::warn!(group = %ctx.group, topic = %key.0, partition = key.1,
            "partition task gone; message left uncommitted for redelivery");
    }
}

/// Pauses partitions whose task has too much queued, resumes them once it drained to half.
pub(crate) fn apply_backpressure(consumer: &BaseConsumer<GroupContext>, max_queued: usize) {
    let ctx = consumer.context();
    let mut tasks = lock(&ctx.tasks);
    for ((topic, partition), t) in tasks.iter_mut() {
        let queued = t.queued.load(Ordering::Acquire);
        let change = if !t.paused && queued >= max_queued {
            Some(true)
        } else if t.paused && queued <= max_queued / 2 {
            Some(false)
        } else {
            None
        };
        if let Some(pause) = change {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(topic, *partition);
            let result = if pause {
                consumer.pause(&tpl)
            } else {
                consumer.resume(&tpl)
            };
            match result {
                Ok(()) => t.paused = pause,
                Err(e) => tracing::warn!(group = %ctx.group, error = %e, "pause/resume failed"),
            }
        }
    }
}

fn inbound_message(msg: &BorrowedMessage<'_>) -> InboundMessage {
    let headers = msg.headers();
    InboundMessage {
        topic: msg.topic().to_owned(),
        partition: msg.partition(),
        offset: msg.offset(),
        key: msg.key().map(<[u8]>::to_vec),
        payload: msg.payload().map(<[u8]>::to_vec),
        headers: RecordHeaders::from_pairs(
            headers
                .into_iter()
                .flat_map(|h| h.iter())
                .map(|h| (h.key, h.value)),
        ),
        envelope: Envelope::from_record(msg.key(), headers),
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
