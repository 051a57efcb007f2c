//! The consumer's Prometheus metrics, registered on a registry passed in.

use prometheus::{
    exponential_buckets, register_counter_vec_with_registry, register_gauge_vec_with_registry,
    register_histogram_vec_with_registry, register_int_counter_vec_with_registry,
    register_int_gauge_vec_with_registry, register_int_gauge_with_registry, CounterVec, GaugeVec,
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Values of the `outcome` label of `consumer_messages_total`.
pub const OUTCOMES: [&str; 7] = [
    "processed",
    "duplicate",
    "parked",
    "stale",
    "dead_lettered",
    "unparked",
    "retried",
];

/// Metrics of every consumer group in this process, labelled by group.
#[derive(Clone)]
pub struct ConsumerMetrics {
    /// `consumer_messages_total`: messages handled, by group and outcome (see [`OUTCOMES`]).
    pub messages: IntCounterVec,
    /// `consumer_out_of_sequence_events_total`: events whose sequence was not the next one of
    /// their order (parked or stale).
    pub out_of_sequence: IntCounterVec,
    /// `consumer_batch_duration_seconds`: time to process one committed partition batch, its
    /// database transaction included.
    pub processing_duration: HistogramVec,
    /// `consumer_db_transaction_duration_seconds`: BEGIN to the end of COMMIT of a committed
    /// batch transaction.
    pub transaction_duration: HistogramVec,
    /// `consumer_batch_size`: messages per committed partition batch.
    pub batch_size: HistogramVec,
    /// `consumer_transaction_partition_batches`: partition batches applied in one shared
    /// transaction.
    pub transaction_partitions: HistogramVec,
    /// `consumer_shared_transaction_failures_total`: shared transactions of several partition
    /// batches that failed (each batch is then retried alone).
    pub shared_transaction_failures: IntCounterVec,
    /// `pipeline_end_to_end_latency_seconds`: an event's creation in the outbox to the group's
    /// database commit.
    pub end_to_end: HistogramVec,
    /// `consumer_offset_commit_duration_seconds`: time to issue (async) or complete (sync) an
    /// offset commit.
    pub commit_duration: HistogramVec,
    /// `consumer_offset_commit_failures_total`: offset commits that failed.
    pub commit_failures: IntCounterVec,
    /// `consumer_rebalances_total`: rebalance callbacks, by group and kind (assign, revoke, lost,
    /// error).
    pub rebalances: IntCounterVec,
    /// `consumer_assigned_partitions`: partitions currently assigned to this member.
    pub assigned_partitions: IntGaugeVec,
    /// `consumer_batch_retries_total`: partition batches retried after a failure.
    pub batch_retries: IntCounterVec,
    /// `consumer_database_reachable`: 1 while this process's database probe is answered, 0
    /// while it is not.
    pub database_reachable: IntGauge,
    /// `consumer_database_departures_total`: times this member left its group because its
    /// database was out of reach for longer than the limit.
    pub database_departures: IntCounterVec,
    /// `consumer_rate_limit_events_per_second`: the group's rate limit in this process, in
    /// events per second (a series only for limited groups; see [`crate::rate_limit`]).
    pub rate_limit: GaugeVec,
    /// `consumer_rate_limit_delayed_events_total`: events whose batch waited for the group's
    /// rate limit before its transaction.
    pub rate_limit_delayed: IntCounterVec,
    /// `consumer_rate_limit_wait_seconds_total`: time partition batches waited for the group's
    /// rate limit.
    pub rate_limit_wait: CounterVec,
    /// `consumer_group_paused`: 1 while this process holds the group paused by an operator
    /// (`pipeline group pause`), 0 while it runs it (see [`crate::pause`]).
    pub group_paused: IntGaugeVec,
}

impl ConsumerMetrics {
    /// Creates every metric and registers it on `registry`; fails if one of the same name is
    /// already registered there.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = ConsumerMetrics {
            messages: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_messages_total",
                    "Messages handled, by group and outcome",
                ),
                &["group", "outcome"],
                registry
            )?,
            out_of_sequence: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_out_of_sequence_events_total",
                    "Events whose sequence was not the next one of their order",
                ),
                &["group"],
                registry
            )?,
            processing_duration: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "consumer_batch_duration_seconds",
                    "Time to process one partition batch, retries and database transaction included",
                )
                .buckets(exponential_buckets(0.0005, 2.0, 16)?),
                &["group"],
                registry
            )?,
            transaction_duration: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "consumer_db_transaction_duration_seconds",
                    "Time from BEGIN to the end of COMMIT of a committed batch transaction",
                )
                .buckets(exponential_buckets(0.0005, 2.0, 16)?),
                &["group"],
                registry
            )?,
            batch_size: register_histogram_vec_with_registry!(
                HistogramOpts::new("consumer_batch_size", "Messages per partition batch")
                    .buckets(exponential_buckets(1.0, 4.0, 7)?),
                &["group"],
                registry
            )?,
            transaction_partitions: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "consumer_transaction_partition_batches",
                    "Partition batches applied in one database transaction",
                )
                .buckets(vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0]),
                &["group"],
                registry
            )?,
            shared_transaction_failures: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_shared_transaction_failures_total",
                    "Shared transactions of several partition batches that failed (each batch is then retried alone)",
                ),
                &["group"],
                registry
            )?,
            end_to_end: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "pipeline_end_to_end_latency_seconds",
                    "Event creation in the outbox to the consumer group's database commit",
                )
                .buckets(exponential_buckets(0.001, 2.0, 18)?),
                &["group"],
                registry
            )?,
            commit_duration: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "consumer_offset_commit_duration_seconds",
                    "Time to issue (async) or complete (sync) an offset commit",
                )
                .buckets(exponential_buckets(0.0001, 4.0, 10)?),
                &["group"],
                registry
            )?,
            commit_failures: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_offset_commit_failures_total",
                    "Offset commits that failed",
                ),
                &["group"],
                registry
            )?,
            rebalances: register_int_counter_vec_with_registry!(
                Opts::new("consumer_rebalances_total", "Rebalance callbacks, by kind"),
                &["group", "kind"],
                registry
            )?,
            assigned_partitions: register_int_gauge_vec_with_registry!(
                Opts::new(
                    "consumer_assigned_partitions",
                    "Partitions currently assigned",
                ),
                &["group"],
                registry
            )?,
            batch_retries: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_batch_retries_total",
                    "Partition batches retried after a transient failure",
                ),
                &["group"],
                registry
            )?,
            database_reachable: register_int_gauge_with_registry!(
                "consumer_database_reachable",
                "1 while this process's database probe is answered, 0 while it is not",
                registry
            )?,
            database_departures: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_database_departures_total",
                    "Times this member left its group because its database was out of reach \
                     longer than the limit, so members that reach it take its partitions",
                ),
                &["group"],
                registry
            )?,
            rate_limit: register_gauge_vec_with_registry!(
                Opts::new(
                    "consumer_rate_limit_events_per_second",
                    "The group's rate limit in this process, in events per second",
                ),
                &["group"],
                registry
            )?,
            rate_limit_delayed: register_int_counter_vec_with_registry!(
                Opts::new(
                    "consumer_rate_limit_delayed_events_total",
                    "Events whose batch waited for the group's rate limit before its transaction",
                ),
                &["group"],
                registry
            )?,
            rate_limit_wait: register_counter_vec_with_registry!(
                Opts::new(
                    "consumer_rate_limit_wait_seconds_total",
                    "Time partition batches waited for the group's rate limit",
                ),
                &["group"],
                registry
            )?,
            group_paused: register_int_gauge_vec_with_registry!(
                Opts::new(
                    "consumer_group_paused",
                    "1 while the group is paused by an operator (its members take no new batch), 0 while it runs",
                ),
                &["group"],
                registry
            )?,
        };
        Ok(m)
    }

    /// Creates every series of `group` at zero, so the first occurrence of an outcome is an
    /// increase Prometheus can see rather than a new series.
    pub fn init_group(&self, group: &str) {
        for outcome in OUTCOMES {
            let _ = self.messages.with_label_values(&[group, outcome]);
        }
        for kind in ["assign", "revoke", "lost", "error"] {
            let _ = self.rebalances.with_label_values(&[group, kind]);
        }
        let _ = self.out_of_sequence.with_label_values(&[group]);
        let _ = self.commit_failures.with_label_values(&[group]);
        let _ = self.batch_retries.with_label_values(&[group]);
        let _ = self.shared_transaction_failures.with_label_values(&[group]);
        let _ = self.assigned_partitions.with_label_values(&[group]);
        let _ = self.database_departures.with_label_values(&[group]);
        let _ = self.rate_limit_delayed.with_label_values(&[group]);
        let _ = self.rate_limit_wait.with_label_values(&[group]);
        let _ = self.group_paused.with_label_values(&[group]);
    }
}
