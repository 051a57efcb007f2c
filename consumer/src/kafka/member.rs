//! This process's member of one consumer group: a thread that polls Kafka, hands each
//! partition's messages to that partition's task, and commits offsets the tasks report after
//! their database commits. All Kafka calls happen on this one thread, rebalance callbacks
//! included (see `rebalance`). Cut off from the database for too long (see `reachability`), it
//! leaves the group, and joins again once the database answers. While the group is paused by an
//! operator it stays in the group, keeps polling and committing, and keeps its partitions' fetch
//! paused (see `tasks`).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use pipeline_core::kafka::KafkaArgs;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::Offset;
use tokio_util::sync::CancellationToken;

use super::reachability::Reachability;
use super::rebalance::MemberContext;
use super::settings::{GroupProtocol, MemberSettings};
use crate::partition::{FinishedOffset, TaskContext};
use crate::pause::PauseSignal;

/// What a member follows besides Kafka.
#[derive(Debug, Clone)]
pub struct MemberSignals {
    /// How long the database has been out of reach: past the limit the member leaves its group.
    pub reachability: Reachability,
    /// Whether an operator paused the group: its tasks start no batch and its partitions' fetch
    /// is paused.
    pub pause: PauseSignal,
    /// The process's shutdown.
    pub shutdown: CancellationToken,
}

/// Runs a member's poll loop on the current (dedicated) thread until `signals.shutdown`.
pub fn run_member(
    kafka: &KafkaArgs,
    settings: &MemberSettings,
    context: TaskContext,
    finished_rx: mpsc::Receiver<FinishedOffset>,
    signals: MemberSignals,
    runtime: tokio::runtime::Handle,
) -> anyhow::Result<()> {
    let MemberSignals {
        reachability,
        pause,
        shutdown,
    } = signals;
    let group = context.handler.group().to_owned();
    let context = MemberContext::new(
        group.clone(),
        runtime,
        context,
        finished_rx,
        settings,
        pause,
        reachability.clone(),
    );
    let mut config = kafka.client_config();
    config
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("group.protocol", settings.group_protocol.as_str())
        .set(
            "max.poll.interval.ms",
            settings.max_poll_interval.as_millis().to_string(),
        )
        // Prefetch bounded per partition: memory stays flat however large the backlog.
        .set("queued.max.messages.kbytes", "4096")
        .set(
            "fetch.wait.max.ms",
            settings.fetch_wait_max.as_millis().to_string(),
        );
    // The consumer protocol refuses these: the broker owns the session and the assignment.
    if settings.group_protocol == GroupProtocol::Classic {
        config
            .set(
                "partition.assignment.strategy",
                &settings.assignment_strategy,
            )
            .set(
                "session.timeout.ms",
                settings.session_timeout.as_millis().to_string(),
            );
    }
    for (k, v) in &kafka.kafka_options {
        if !matches!(
            k.as_str(),
            "enable.auto.commit" | "enable.auto.offset.store" | "group.id"
        ) {
            config.set(k, v);
        }
    }
    let consumer: BaseConsumer<MemberContext> = config
        .create_with_context(context)
        .with_context(|| format!("creating Kafka consumer for group {group}"))?;
    let topics: Vec<&str> = settings.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .with_context(|| format!("subscribing group {group}"))?;
    tracing::info!(%group, topics = ?settings.topics, protocol = settings.group_protocol.as_str(),
        "consumer group started");

    let ctx = consumer.context();
    let mut missing_topic_since: Option<Instant> = None;
    let mut last_recommit = Instant::now();
    let mut last_commit = Instant::now();
    let mut fatal = None;
    let mut left_unreachable = false;
    let mut last_message = Instant::now();
    let mut busy = true;
    while !shutdown.is_cancelled() {
        // Cut off from the database, this member would keep its partitions and apply nothing:
        // it leaves, so members that reach the database take them over, and joins again later.
        let unreachable = reachability.unreachable_for();
        if !left_unreachable && unreachable > settings.leave_after_database_unreachable {
            tracing::warn!(%group, unreachable_ms = unreachable.as_millis() as u64,
                "database out of reach: leaving the group so other members take the partitions");
            ctx.tasks.abandon(&ctx.tasks.keys());
            consumer.unsubscribe();
            ctx.count_database_departure();
            left_unreachable = true;
        } else if left_unreachable && unreachable < Duration::from_secs(2) {
            tracing::info!(%group, "database answers again: joining the group");
            consumer
                .subscribe(&topics)
                .with_context(|| format!("subscribing group {group}"))?;
            left_unreachable = false;
        }
        // A member with nothing queued that had no message for a while waits longer in each
        // poll: an idle group wakes twice a second instead of twenty times. A message ends the
        // wait at once.
        let wait = if busy || last_message.elapsed() < QUIET_AFTER {
            POLL_BUSY
        } else {
            POLL_QUIET
        };
        match consumer.poll(wait) {
            None => {}
            Some(Ok(msg)) => {
                last_message = Instant::now();
                missing_topic_since = None;
                if let Some((key, from)) = ctx.tasks.dispatch(&msg) {
                    fetch_again(&consumer, ctx, &group, &key, from);
                }
            }
            Some(Err(e)) => match classify_poll_error(&e) {
                PollError::Fatal => {
                    fatal = Some(anyhow::anyhow!(
                        "group {group}: {e} (check credentials and ACLs)"
                    ));
                    break;
                }
                PollError::MissingTopic => {
                    let since = *missing_topic_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > MISSING_TOPIC_GRACE {
                        fatal = Some(anyhow::anyhow!(
                            "group {group}: subscribed topic missing for {MISSING_TOPIC_GRACE:?}: {e} \
                             (create it, or fix --topic)"
                        ));
                        break;
                    }
                    tracing::warn!(%group, error = %e, "subscribed topic not available");
                }
                PollError::Transient => tracing::warn!(%group, error = %e, "Kafka consumer error"),
            },
        }
        // Offsets finished since the last commit go out together: one request per interval
        // instead of one per batch.
        if last_commit.elapsed() >= settings.commit_interval {
            ctx.offsets.collect_finished();
            let finished = ctx.offsets.take_pending(None);
            ctx.offsets
                .commit(&consumer, &ctx.tasks, &finished, CommitMode::Async);
            last_commit = Instant::now();
        }
        if last_recommit.elapsed() >= RECOMMIT_EVERY {
            ctx.offsets.recommit_owned(&consumer, &ctx.tasks);
            last_recommit = Instant::now();
        }
        for (key, from) in ctx.tasks.take_ended() {
            fetch_again(&consumer, ctx, &group, &key, from);
        }
        busy = ctx.tasks.apply_fetch_pauses(&consumer);
    }

    // Shutdown: let in-flight batches finish, then commit what they own, synchronously.
    tracing::info!(%group, "consumer group stopping");
    let keys = ctx.tasks.keys();
    ctx.tasks.stop(&keys);
    ctx.offsets.collect_finished();
    let finished = ctx.offsets.take_pending(None);
    ctx.offsets
        .commit(&consumer, &ctx.tasks, &finished, CommitMode::Sync);
    tracing::info!(%group, committed_partitions = finished.len(), "consumer group stopped");
    consumer.unsubscribe();
    leave(consumer, &group);
    match fatal {
        Some(e) => {
            tracing::error!(error = %e, "stopping on a fatal Kafka error");
            Err(e)
        }
        None => Ok(()),
    }
}

/// Leaves the group: dropping the consumer runs librdkafka's close, which revokes (the callback
/// commits what the tasks finished) and polls until the broker answers. A close that does not
/// finish within [`LEAVE_WITHIN`] is left to run on its own thread and the shutdown goes on: its
/// offsets were committed above, and the broker ends the membership at its session timeout.
fn leave(consumer: BaseConsumer<MemberContext>, group: &str) {
    let (left_tx, left_rx) = mpsc::channel();
    let closing = std::thread::Builder::new()
        .name(format!("leave-{group}"))
        .spawn(move || {
            drop(consumer);
            let _ = left_tx.send(());
        });
    if let Err(e) = closing {
        tracing::warn!(%group, error = %e, "cannot start the thread that leaves the group");
        return;
    }
    match left_rx.recv_timeout(LEAVE_WITHIN) {
        Ok(()) => tracing::info!(%group, "consumer group left"),
        Err(_) => tracing::warn!(%group, within_ms = LEAVE_WITHIN.as_millis() as u64,
            "the group's close did not finish; the broker ends the membership at its session timeout"),
    }
}

/// Longest a stopping member waits for librdkafka's close of its consumer.
const LEAVE_WITHIN: Duration = Duration::from_secs(10);

/// Moves the fetch of a partition whose task ended by itself back to the first message that task
/// was handed, or past what the member's tasks finished if that is further: what the ended task
/// left undone is fetched again and applied by a new task, and nothing finished is fetched again.
fn fetch_again<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    ctx: &MemberContext,
    group: &str,
    key: &super::tasks::PartitionKey,
    from: i64,
) {
    let to = ctx
        .offsets
        .latest_finished(key)
        .map_or(from, |finished| finished.max(from));
    if let Err(e) = consumer.seek(&key.0, key.1, Offset::Offset(to), SEEK_TIMEOUT) {
        tracing::warn!(%group, topic = %key.0, partition = key.1, offset = to,
            error = %e, "cannot move the fetch back; the next rebalance redelivers");
    }
}

/// How long a subscribed topic may be missing before the process stops as misconfigured.
const MISSING_TOPIC_GRACE: Duration = Duration::from_secs(30);
/// How often the latest offsets of owned partitions are committed again (see
/// `Offsets::recommit_owned`).
const RECOMMIT_EVERY: Duration = Duration::from_secs(5);

/// Longest a poll waits for a message while messages arrive: the loop's other work (commits of
/// finished offsets, fetches moved back, fetch pauses) runs at least this often then.
const POLL_BUSY: Duration = Duration::from_millis(50);

/// Longest a poll waits once no message came for [`QUIET_AFTER`] and nothing is queued for the
/// member's tasks: an operator's pause, a database outage's departure or a shutdown waits for at
/// most this long.
const POLL_QUIET: Duration = Duration::from_millis(500);

/// How long without a message makes a member quiet.
const QUIET_AFTER: Duration = Duration::from_secs(2);

/// Longest the poll loop waits for librdkafka to move a partition's fetch back.
const SEEK_TIMEOUT: Duration = Duration::from_secs(1);

enum PollError {
    /// Misconfiguration no retry fixes: stop with a clear error rather than spin.
    Fatal,
    MissingTopic,
    Transient,
}

fn classify_poll_error(e: &rdkafka::error::KafkaError) -> PollError {
    use rdkafka::types::RDKafkaErrorCode::*;
    match e.rdkafka_error_code() {
        Some(
            TopicAuthorizationFailed
            | GroupAuthorizationFailed
            | ClusterAuthorizationFailed
            | SaslAuthenticationFailed
            | Authentication
            | InvalidConfig,
        ) => PollError::Fatal,
        Some(UnknownTopicOrPartition | UnknownTopic) => PollError::MissingTopic,
        _ => PollError::Transient,
    }
}
