//! The member's partition tasks: one per assigned partition, started when the partition is
//! assigned (or its first message arrives), fed the polled messages in offset order, stopped on
//! revoke (an in-flight transaction finishes, nothing new starts; a revoke waits for it until the
//! revoke timeout, or until the database is out of reach) and abandoned when the database is out
//! of reach.
//!
//! A partition's fetch is paused in librdkafka (`Consumer::pause`) while too much is queued for
//! its task (backpressure, resumed once half of it is done) and while the group is paused by an
//! operator (see [`crate::pause`]), and resumed when neither holds. Pausing the fetch is what keeps
//! a paused group's process idle: librdkafka fetches nothing more and drops what it had
//! prefetched for the partition, and on resume fetches again from the first message it has not
//! handed over. The messages already handed to a task stay in its queue, which is why the task
//! itself also waits while the group is paused: the fetch pause alone would leave it applying
//! what it holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::TopicPartitionList;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_util::sync::CancellationToken;

use super::reachability::Reachability;
use super::settings::MemberSettings;
use crate::partition::{PartitionTask, TaskContext};
use crate::pause::PauseSignal;
use crate::transaction::{InboundMessage, RecordHeaders};

pub(crate) type PartitionKey = (String, i32);

/// A running partition task, as the member sees it.
pub(crate) struct TaskHandle {
    sender: UnboundedSender<InboundMessage>,
    queued: Arc<AtomicUsize>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    /// Too much is queued: the fetch stays paused until half of it is done.
    backpressured: bool,
    /// Whether the partition's fetch is paused in librdkafka, as last set; `None` until set
    /// once (a partition assigned again may still carry an earlier pause).
    fetch_paused: Option<bool>,
    /// The offset of the first message handed to the task: where its partition's fetch goes
    /// back to when the task ends by itself before finishing what it was handed.
    first_offset: Option<i64>,
}

/// The partition tasks of one member, by partition.
pub(crate) struct PartitionTasks {
    group: String,
    runtime: tokio::runtime::Handle,
    context: TaskContext,
    tasks: Mutex<HashMap<PartitionKey, TaskHandle>>,
    revoke_timeout: Duration,
    /// Whether the database answers: a revoke does not wait for batches that cannot finish.
    reachability: Reachability,
    /// Messages queued for one task before its partition's fetch is paused.
    max_queued: usize,
    /// Whether the group is paused by an operator.
    group_pause: PauseSignal,
    /// The group's pause as the fetch pauses last followed it, for the log.
    group_paused: Mutex<bool>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks already stops the process; keep going with the data.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PartitionTasks {
    /// No tasks yet; each one started gets `context`, follows `group_pause` and runs on
    /// `runtime`; a revoke follows `reachability`.
    pub(crate) fn new(
        group: String,
        runtime: tokio::runtime::Handle,
        context: TaskContext,
        settings: &MemberSettings,
        group_pause: PauseSignal,
        reachability: Reachability,
    ) -> Self {
        PartitionTasks {
            group,
            runtime,
            context,
            tasks: Mutex::new(HashMap::new()),
            revoke_timeout: settings.revoke_timeout,
            reachability,
            max_queued: settings.max_queued,
            group_pause,
            group_paused: Mutex::new(false),
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
        self.start(&mut tasks, key).sender.clone()
    }

    /// Starts the task of `key` in `tasks` (the member's, locked by the caller).
    fn start<'t>(
        &self,
        tasks: &'t mut HashMap<PartitionKey, TaskHandle>,
        key: &PartitionKey,
    ) -> &'t mut TaskHandle {
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
        )
        .with_pause(self.group_pause.clone());
        let done = self.runtime.spawn(task.run());
        tasks.insert(
            key.clone(),
            TaskHandle {
                sender,
                queued,
                stop,
                done,
                backpressured: false,
                fetch_paused: None,
                first_offset: None,
            },
        );
        tasks.get_mut(key).expect("the task just inserted")
    }

    /// Replaces the task that ended by itself, `ended`, with a new one that inherits its fetch
    /// state: a fetch the ended task had paused (too much queued, or the group paused) is then
    /// resumed by [`PartitionTasks::apply_fetch_pauses`] when it should be. Without a task there,
    /// no message would come to start one, and the partition would wait for the next rebalance.
    fn succeed(
        &self,
        tasks: &mut HashMap<PartitionKey, TaskHandle>,
        key: &PartitionKey,
        ended: &TaskHandle,
    ) {
        self.start(tasks, key).fetch_paused = ended.fetch_paused;
    }

    /// Stops the tasks of `keys` and waits for them, up to the revoke timeout, or until the
    /// database is out of reach: a batch cut off from it cannot finish, and waiting would hold
    /// the poll thread, and with it the whole group's rebalance, for the full timeout. A batch
    /// given up on is refused later by the ownership check, as an abandoned one is.
    pub(crate) fn stop(&self, keys: &[PartitionKey]) {
        let stopping = self.cancel(keys);
        if stopping.is_empty() {
            return;
        }
        let deadline = self.revoke_timeout;
        let reachability = self.reachability.clone();
        let gave_up = self.runtime.block_on(async move {
            let out_of_reach = async {
                while !reachability.out_of_reach() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            };
            tokio::select! {
                finished = tokio::time::timeout(
                    deadline,
                    futures::future::join_all(stopping.into_iter().map(|t| t.done)),
                ) => finished.err().map(|_| "the revoke timeout passed"),
                () = out_of_reach => Some("the database is out of reach"),
            }
        });
        if let Some(reason) = gave_up {
            tracing::warn!(group = %self.group, reason,
                "stopped waiting for in-flight batches; the partitions' next owner applies them");
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

    /// Forgets the tasks that ended by themselves (a task whose partition another member's task
    /// fenced, during a rebalance, stops) while their partitions are still assigned here, and
    /// returns, for those that had been handed messages, the partition and the offset of the
    /// first message handed over: the caller moves the partition's fetch back there, and the
    /// next message starts a new task. Without that the partition would stay assigned with nothing
    /// applying it until the next rebalance. (A stopped or abandoned task is no longer here.)
    pub(crate) fn take_ended(&self) -> Vec<(PartitionKey, i64)> {
        let mut tasks = lock(&self.tasks);
        let ended: Vec<PartitionKey> = tasks
            .iter()
            .filter(|(_, t)| t.done.is_finished())
            .map(|(k, _)| k.clone())
            .collect();
        ended
            .into_iter()
            .filter_map(|key| {
                let task = tasks.remove(&key)?;
                tracing::warn!(group = %self.group, topic = %key.0, partition = key.1,
                    from = ?task.first_offset,
                    "partition task ended while the partition is still assigned: fetching again from its first unfinished message");
                self.succeed(&mut tasks, &key, &task);
                task.first_offset.map(|from| (key, from))
            })
            .collect()
    }

    /// The partitions that have a task.
    pub(crate) fn keys(&self) -> Vec<PartitionKey> {
        lock(&self.tasks).keys().cloned().collect()
    }

    /// Hands a polled message to its partition's task. When that task has just ended by itself,
    /// it is forgotten and this returns what [`PartitionTasks::take_ended`] would.
    pub(crate) fn dispatch(&self, msg: &BorrowedMessage<'_>) -> Option<(PartitionKey, i64)> {
        let inbound = inbound_message(msg);
        let offset = inbound.offset;
        let key = (inbound.topic.clone(), inbound.partition);
        let sender = self.task_for(&key);
        if let Some(t) = lock(&self.tasks).get_mut(&key) {
            let _ = t.queued.fetch_add(1, Ordering::AcqRel);
            let _ = t.first_offset.get_or_insert(offset);
        }
        if sender.send(inbound).is_ok() {
            return None;
        }
        let ended = {
            let mut tasks = lock(&self.tasks);
            match tasks.get(&key) {
                Some(t) if t.sender.same_channel(&sender) => {
                    let ended = tasks.remove(&key);
                    if let Some(t) = &ended {
                        self.succeed(&mut tasks, &key, t);
                    }
                    ended
                }
                _ => None,
            }
        };
        let from = ended.and_then(|t| t.first_offset).unwrap_or(offset);
        tracing::warn!(group = %self.group, topic = %key.0, partition = key.1, from,
            "partition task ended while the partition is still assigned: fetching again from its first unfinished message");
        Some((key, from))
    }

    /// Pauses the fetch of every partition while the group is paused or while its task has too
    /// much queued, and resumes it when neither holds (backpressure lets go once the task has
    /// done half of what was queued). Called by the poll loop after every poll, and right after
    /// an assignment, so a partition assigned while the group is paused starts paused.
    pub(crate) fn apply_fetch_pauses<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
    ) -> bool {
        let group_paused = self.group_pause.is_paused();
        let mut busy = false;
        let mut tasks = lock(&self.tasks);
        {
            let mut seen = lock(&self.group_paused);
            if *seen != group_paused {
                *seen = group_paused;
                tracing::info!(group = %self.group, partitions = tasks.len(), group_paused,
                    "fetch of the group's partitions {}", if group_paused { "paused" } else { "resumed" });
            }
        }
        for ((topic, partition), t) in tasks.iter_mut() {
            let queued = t.queued.load(Ordering::Acquire);
            busy |= queued > 0;
            if !t.backpressured && queued >= self.max_queued {
                t.backpressured = true;
            } else if t.backpressured && queued <= self.max_queued / 2 {
                t.backpressured = false;
            }
            let pause = group_paused || t.backpressured;
            if t.fetch_paused == Some(pause) {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(topic, *partition);
            let result = if pause {
                consumer.pause(&tpl)
            } else {
                consumer.resume(&tpl)
            };
            match result {
                Ok(()) => t.fetch_paused = Some(pause),
                Err(e) => {
                    tracing::warn!(group = %self.group, topic = %topic, partition, error = %e,
                        "pausing or resuming the partition's fetch failed; retrying");
                }
            }
        }
        busy
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
