//! The member's partition tasks: one per assigned partition, started when the partition is
//! assigned (or its first message arrives), fed the polled messages in offset order, paused
//! while too much is queued for them, stopped on revoke (an in-flight transaction finishes,
//! nothing new starts) and abandoned when the database is out of reach.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::TopicPartitionList;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_util::sync::CancellationToken;

use crate::partition::{PartitionTask, TaskContext};
use crate::transaction::{InboundMessage, RecordHeaders};

pub(crate) type PartitionKey = (String, i32);

/// A running partition task, as the member sees it.
pub(crate) struct TaskHandle {
    sender: UnboundedSender<InboundMessage>,
    queued: Arc<AtomicUsize>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    paused: bool,
}

/// The partition tasks of one member, by partition.
pub(crate) struct PartitionTasks {
    group: String,
    runtime: tokio::runtime::Handle,
    context: TaskContext,
    tasks: Mutex<HashMap<PartitionKey, TaskHandle>>,
    revoke_timeout: Duration,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks already stops the process; keep going with the data.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PartitionTasks {
    /// No tasks yet; each one started gets `context` and runs on `runtime`.
    pub(crate) fn new(
        group: String,
        runtime: tokio::runtime::Handle,
        context: TaskContext,
        revoke_timeout: Duration,
    ) -> Self {
        PartitionTasks {
            group,
            runtime,
            context,
            tasks: Mutex::new(HashMap::new()),
            revoke_timeout,
        }
    }

    /// The running tasks, locked. Whoever also locks the member's offsets takes this lock first.
    pub(crate) fn running(&self) -> MutexGuard<'_, HashMap<PartitionKey, TaskHandle>> {
        lock(&self.tasks)
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
        let task = PartitionTask::new(
            self.context.clone(),
            key.0.clone(),
            key.1,
            rx,
            queued.clone(),
            stop.clone(),
        );
        let done = self.runtime.spawn(task.run());
        let _ = tasks.insert(
            key.clone(),
            TaskHandle {
                sender: sender.clone(),
                queued,
                stop,
                done,
                paused: false,
            },
        );
        sender
    }

    /// Stops the tasks of `keys` and waits for them, up to the revoke timeout.
    pub(crate) fn stop(&self, keys: &[PartitionKey]) {
        let stopping = self.cancel(keys);
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
    pub(crate) fn abandon(&self, keys: &[PartitionKey]) {
        let abandoned = self.cancel(keys);
        if !abandoned.is_empty() {
            tracing::warn!(group = %self.group, partitions = abandoned.len(), "partition tasks abandoned");
        }
    }

    /// Takes the tasks of `keys` out of the member and tells each to stop.
    fn cancel(&self, keys: &[PartitionKey]) -> Vec<TaskHandle> {
        let cancelled: Vec<TaskHandle> = {
            let mut tasks = lock(&self.tasks);
            keys.iter().filter_map(|k| tasks.remove(k)).collect()
        };
        for t in &cancelled {
            t.stop.cancel();
        }
        cancelled
    }

    /// The partitions that have a task.
    pub(crate) fn keys(&self) -> Vec<PartitionKey> {
        lock(&self.tasks).keys().cloned().collect()
    }

    /// Hands a polled message to its partition's task.
    pub(crate) fn dispatch(&self, msg: &BorrowedMessage<'_>) {
        let inbound = inbound_message(msg);
        let key = (inbound.topic.clone(), inbound.partition);
        let sender = self.task_for(&key);
        if let Some(t) = lock(&self.tasks).get(&key) {
            let _ = t.queued.fetch_add(1, Ordering::AcqRel);
        }
        if sender.send(inbound).is_err() {
            tracing::warn!(group = %self.group, topic = %key.0, partition = key.1,
                "partition task gone; message left uncommitted for redelivery");
        }
    }

    /// Pauses partitions whose task has too much queued, resumes them once it drained to half.
    pub(crate) fn apply_backpressure<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        max_queued: usize,
    ) {
        let mut tasks = lock(&self.tasks);
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
                    Err(e) => {
                        tracing::warn!(group = %self.group, error = %e, "pause/resume failed")
                    }
                }
            }
        }
    }
}

fn inbound_message(msg: &BorrowedMessage<'_>) -> InboundMessage {
    InboundMessage::from_record(
        msg.topic(),
        msg.partition(),
        msg.offset(),
        msg.key(),
        msg.payload(),
        RecordHeaders::read(msg.headers()),
    )
}
