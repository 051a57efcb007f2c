//! The member's client context: librdkafka's log, the rebalance callbacks that start and stop
//! partition tasks, and the commit callback.
//!
//! On revoke it stops the revoked partitions' tasks (an in-flight transaction finishes; nothing
//! new starts), then commits synchronously what they finished, while the partitions are still
//! owned. Lost partitions are not committed at all. On assign it starts the new partitions'
//! tasks and sets their fetch paused at once if the group is paused.

use std::sync::mpsc;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::offsets::Offsets;
use super::reachability::Reachability;
use super::settings::MemberSettings;
use super::tasks::{PartitionKey, PartitionTasks};
use crate::metrics::ConsumerMetrics;
use crate::partition::{FinishedOffset, TaskContext};
use crate::pause::PauseSignal;

/// Rebalance callbacks and the state they share with the poll loop.
pub(crate) struct MemberContext {
    group: String,
    metrics: ConsumerMetrics,
    /// The member's partition tasks.
    pub(crate) tasks: PartitionTasks,
    /// The offsets its tasks finished, and its commits.
    pub(crate) offsets: Offsets,
}

impl ClientContext for MemberContext {
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

impl ConsumerContext for MemberContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let lost = consumer.assignment_lost();
                let kind = if lost { "lost" } else { "revoke" };
                self.metrics
                    .rebalances
                    .with_label_values(&[&self.group, kind])
                    .inc();
                let keys = partition_keys(tpl);
                tracing::info!(group = %self.group, partitions = keys.len(), lost, "partitions revoked");
                self.tasks.stop(&keys);
                self.offsets.collect_finished();
                let finished = self.offsets.take_pending(Some(&keys));
                if lost {
                    if !finished.is_empty() {
                        tracing::warn!(group = %self.group, partitions = finished.len(),
                            "assignment lost: not committing; the next owner skips these as duplicates");
                    }
                } else {
                    self.offsets
                        .commit(consumer, &self.tasks, &finished, CommitMode::Sync);
                }
                // After the commit above, which records what it asked for: a partition that
                // comes back later must not have this member's old offset committed again.
                self.offsets.forget_requested(&keys);
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => {
                tracing::error!(group = %self.group, error = %e, "rebalance error");
                self.metrics
                    .rebalances
                    .with_label_values(&[&self.group, "error"])
                    .inc();
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.metrics
                .rebalances
                .with_label_values(&[&self.group, "assign"])
                .inc();
            let keys = partition_keys(tpl);
            self.offsets.forget_requested(&keys);
            for key in &keys {
                let _ = self.tasks.task_for(key);
            }
            // Before the next poll: a partition assigned while the group is paused fetches
            // nothing.
            self.tasks.apply_fetch_pauses(consumer);
            tracing::info!(group = %self.group, partitions = tpl.count(), "partitions assigned");
        }
        let assigned = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        self.metrics
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
            self.offsets.commit_failed(error);
            let retry: Vec<(PartitionKey, i64)> =
                failed.into_iter().map(|(k, o, _)| (k, o)).collect();
            self.offsets.retry_commit(&self.tasks, &retry);
        }
    }
}

impl MemberContext {
    pub(crate) fn new(
        group: String,
        runtime: tokio::runtime::Handle,
        context: TaskContext,
        finished: mpsc::Receiver<FinishedOffset>,
        settings: &MemberSettings,
        group_pause: PauseSignal,
        reachability: Reachability,
    ) -> Self {
        let metrics = context.metrics.clone();
        MemberContext {
            offsets: Offsets::new(group.clone(), metrics.clone(), finished),
            tasks: PartitionTasks::new(
                group.clone(),
                runtime,
                context,
                settings,
                group_pause,
                reachability,
            ),
            group,
            metrics,
        }
    }

    pub(crate) fn count_database_departure(&self) {
        self.metrics
            .database_departures
            .with_label_values(&[&self.group])
            .inc();
    }
}

fn partition_keys(tpl: &TopicPartitionList) -> Vec<PartitionKey> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}
