//! The relay's Prometheus metrics, registered on a registry passed in.

use prometheus::{
    exponential_buckets, register_gauge_vec_with_registry, register_gauge_with_registry,
    register_histogram_vec_with_registry, register_histogram_with_registry,
    register_int_counter_vec_with_registry, register_int_counter_with_registry,
    register_int_gauge_with_registry, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec,
    IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};
use rdkafka::statistics::Statistics;

use crate::lease::{Acquired, LeaseEnd, TakeoverReason};

/// Metrics of the relay and of the outbox it drains.
#[derive(Clone)]
pub struct RelayMetrics {
    /// `outbox_published_total`: outbox events handled by the relay, by outcome.
    pub published: IntCounterVec,
    /// `relay_publish_errors_total`: failed publish attempts, by reason.
    pub publish_errors: IntCounterVec,
    /// `relay_batch_size`: events claimed per relay batch.
    pub batch_size: Histogram,
    /// `relay_batch_duration_seconds`: time to claim, publish and mark one batch.
    pub batch_duration: Histogram,
    /// `relay_batch_stage_seconds`: time of each stage of a relay batch: claim (read from the outbox), produce (handed to the producer until every delivery report), mark (outcome written).
    pub stage_duration: HistogramVec,
    /// `outbox_publish_delay_seconds`: delivery acknowledgement time minus event creation time.
    pub publish_delay: Histogram,
    /// `relay_last_success_timestamp_seconds`: unix time of the last relay loop that completed without error.
    pub last_success: Gauge,
    /// `relay_active`: 1 while this relay holds the lease and publishes.
    pub active: IntGauge,
    /// `outbox_unpublished_events`: outbox events not yet published.
    pub unpublished: IntGauge,
    /// `outbox_failed_events`: outbox events the relay gave up on (state failed: a permanent error such as message too large, after --max-attempts), waiting for an operator's requeue.
    pub failed: IntGauge,
    /// `outbox_held_events`: outbox events waiting behind a failed event of their aggregate: they go out, in order, once it is requeued and published.
    pub held: IntGauge,
    /// `outbox_oldest_unpublished_age_seconds`: age of the oldest unpublished outbox event by the database clock, 0 when none.
    pub oldest_unpublished_age: Gauge,
    /// `relay_kafka_producer_queue_messages`: messages in the Kafka producer's queue (librdkafka msg_cnt).
    pub producer_queue: IntGauge,
    /// `relay_kafka_producer_queue_max_messages`: capacity of the Kafka producer's queue (librdkafka msg_max).
    pub producer_queue_max: IntGauge,
    /// `relay_kafka_broker_rtt_seconds`: average broker round-trip time over librdkafka's last statistics window.
    pub broker_rtt: GaugeVec,
    /// `relay_producer_renewals_total`: kafka producers replaced after librdkafka reported a fatal error, by error code.
    pub producer_renewals: IntCounterVec,
    /// `relay_lease_takeovers_total`: times this relay took the relay lease, by how: vacant (nobody held it), holder_gone (the holder's session ended) or expired (the holder stopped renewing: frozen or cut off).
    pub takeovers: IntCounterVec,
    /// `relay_takeover_gap_seconds`: at each takeover by this relay, time since the previous holder last renewed the lease (database clock): at least as long as the time without an active relay.
    pub takeover_gap: Histogram,
    /// `relay_lease_epoch`: epoch of the lease this relay last took; every takeover raises it.
    pub lease_epoch: IntGauge,
    /// `relay_lease_lost_total`: times this relay lost the lease while active, by reason: expired (not renewed in time) or fenced (another relay had taken it over).
    pub lease_lost: IntCounterVec,
    /// `relay_lease_vacant_seconds`: how long the relay lease has had no live holder (expired or handed back, not yet taken), by the database clock; 0 while a relay holds it.
    pub lease_vacant: Gauge,
    /// `relay_fenced_total`: times this relay found itself fenced: a lease renewal or a batch's outcome refused because another relay had taken the lease over.
    pub fenced: IntCounter,
    /// `outbox_delayed_released_total`: delayed events this relay released into the outbox once due.
    pub delayed_released: IntCounter,
    /// `outbox_schedule_occurrences_total`: occurrences of recurring schedules this relay materialised, by outcome: fired (appended as a delayed event) or skipped (passed over by the schedule's missed-occurrence policy).
    pub schedule_occurrences: IntCounterVec,
    /// `outbox_delayed_due`: delayed events that are due and not yet released into the outbox (0 while a relay is active and keeping up).
    pub delayed_due: IntGauge,
    /// `outbox_wal_streaming`: 1 while the outbox's events are streamed from the write-ahead log (writers queue nothing), by the database.
    pub wal_streaming: IntGauge,
    /// `outbox_wal_slot_active`: 1 while a session streams from the relay's replication slot; 0 when none does (or no slot).
    pub wal_slot_active: IntGauge,
    /// `outbox_wal_slot_lag_bytes`: write-ahead log between the server's position and the slot's confirmed one: what the relay has not yet confirmed.
    pub wal_slot_lag: IntGauge,
    /// `outbox_wal_retained_bytes`: write-ahead log the slot keeps on the server's disk (from its restart position).
    pub wal_retained: IntGauge,
    /// `outbox_wal_slot_lost_total`: times this relay found its replication slot lost (invalidated by max_slot_wal_keep_size) and fell back to the queue from the horizon.
    pub wal_slot_lost: IntCounter,
    /// `outbox_delayed_overdue_seconds`: how long ago the oldest due delayed event still waiting fell due, by the database clock; 0 when none waits.
    pub delayed_overdue: Gauge,
}

impl RelayMetrics {
    /// Registers the relay's metrics on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = RelayMetrics {
            published: register_int_counter_vec_with_registry!(
                Opts::new(
                    "outbox_published_total",
                    "Outbox events handled by the relay, by outcome",
                ),
                &["outcome"],
                registry
            )?,
            publish_errors: register_int_counter_vec_with_registry!(
                Opts::new(
                    "relay_publish_errors_total",
                    "Failed publish attempts, by reason",
                ),
                &["reason"],
                registry
            )?,
            batch_size: register_histogram_with_registry!(
                HistogramOpts::new("relay_batch_size", "Events claimed per relay batch")
                    .buckets(exponential_buckets(1.0, 4.0, 8)?),
                registry
            )?,
            batch_duration: register_histogram_with_registry!(
                HistogramOpts::new(
                    "relay_batch_duration_seconds",
                    "Time to claim, publish and mark one batch",
                )
                .buckets(exponential_buckets(0.001, 2.0, 16)?),
                registry
            )?,
            stage_duration: register_histogram_vec_with_registry!(
                HistogramOpts::new(
                    "relay_batch_stage_seconds",
                    "Time of each stage of a relay batch: claim (read from the outbox), produce \
                     (handed to the producer until every delivery report), mark (outcome written)",
                )
                .buckets(exponential_buckets(0.0005, 2.0, 16)?),
                &["stage"],
                registry
            )?,
            publish_delay: register_histogram_with_registry!(
                HistogramOpts::new(
                    "outbox_publish_delay_seconds",
                    "Delivery acknowledgement time minus event creation time",
                )
                .buckets(exponential_buckets(0.001, 2.0, 20)?),
                registry
            )?,
            last_success: register_gauge_with_registry!(
                "relay_last_success_timestamp_seconds",
                "Unix time of the last relay loop that completed without error",
                registry
            )?,
            active: register_int_gauge_with_registry!(
                "relay_active",
                "1 while this relay holds the lease and publishes",
                registry
            )?,
            unpublished: register_int_gauge_with_registry!(
                "outbox_unpublished_events",
                "Outbox events not yet published",
                registry
            )?,
            failed: register_int_gauge_with_registry!(
                "outbox_failed_events",
                "Outbox events the relay gave up on (state failed: a permanent error such as \
                 message too large, after --max-attempts), waiting for an operator's requeue",
                registry
            )?,
            held: register_int_gauge_with_registry!(
                "outbox_held_events",
                "Outbox events waiting behind a failed event of their aggregate: they go out, in \
                 order, once it is requeued and published",
                registry
            )?,
            oldest_unpublished_age: register_gauge_with_registry!(
                "outbox_oldest_unpublished_age_seconds",
                "Age of the oldest unpublished outbox event by the database clock, 0 when none",
                registry
            )?,
            wal_streaming: register_int_gauge_with_registry!(
                "outbox_wal_streaming",
                "1 while the outbox's events are streamed from the write-ahead log (writers \
                 queue nothing), by the database",
                registry
            )?,
            wal_slot_active: register_int_gauge_with_registry!(
                "outbox_wal_slot_active",
                "1 while a session streams from the relay's replication slot; 0 when none does \
                 (or no slot)",
                registry
            )?,
            wal_slot_lag: register_int_gauge_with_registry!(
                "outbox_wal_slot_lag_bytes",
                "Write-ahead log between the server's position and the slot's confirmed one: \
                 what the relay has not yet confirmed",
                registry
            )?,
            wal_retained: register_int_gauge_with_registry!(
                "outbox_wal_retained_bytes",
                "Write-ahead log the slot keeps on the server's disk (from its restart position)",
                registry
            )?,
            wal_slot_lost: register_int_counter_with_registry!(
                "outbox_wal_slot_lost_total",
                "Times this relay found its replication slot lost (invalidated by \
                 max_slot_wal_keep_size) and fell back to the queue from the horizon",
                registry
            )?,
            producer_queue: register_int_gauge_with_registry!(
                "relay_kafka_producer_queue_messages",
                "Messages in the Kafka producer's queue (librdkafka msg_cnt)",
                registry
            )?,
            producer_queue_max: register_int_gauge_with_registry!(
                "relay_kafka_producer_queue_max_messages",
                "Capacity of the Kafka producer's queue (librdkafka msg_max)",
                registry
            )?,
            broker_rtt: register_gauge_vec_with_registry!(
                Opts::new(
                    "relay_kafka_broker_rtt_seconds",
                    "Average broker round-trip time over librdkafka's last statistics window",
                ),
                &["broker"],
                registry
            )?,
            producer_renewals: register_int_counter_vec_with_registry!(
                Opts::new(
                    "relay_producer_renewals_total",
                    "Kafka producers replaced after librdkafka reported a fatal error, by error code",
                ),
                &["code"],
                registry
            )?,
            takeovers: register_int_counter_vec_with_registry!(
                Opts::new(
                    "relay_lease_takeovers_total",
                    "Times this relay took the relay lease, by how: vacant (nobody held it), \
                     holder_gone (the holder's session ended) or expired (the holder stopped \
                     renewing: frozen or cut off)",
                ),
                &["reason"],
                registry
            )?,
            takeover_gap: register_histogram_with_registry!(
                HistogramOpts::new(
                    "relay_takeover_gap_seconds",
                    "At each takeover by this relay, time since the previous holder last renewed \
                     the lease (database clock): at least as long as the time without an active relay",
                )
                .buckets(exponential_buckets(0.1, 2.0, 12)?),
                registry
            )?,
            lease_epoch: register_int_gauge_with_registry!(
                "relay_lease_epoch",
                "Epoch of the lease this relay last took; every takeover raises it",
                registry
            )?,
            lease_lost: register_int_counter_vec_with_registry!(
                Opts::new(
                    "relay_lease_lost_total",
                    "Times this relay lost the lease while active, by reason: expired (not \
                     renewed in time) or fenced (another relay had taken it over)",
                ),
                &["reason"],
                registry
            )?,
            lease_vacant: register_gauge_with_registry!(
                "relay_lease_vacant_seconds",
                "How long the relay lease has had no live holder (expired or handed back, not \
                 yet taken), by the database clock; 0 while a relay holds it",
                registry
            )?,
            fenced: register_int_counter_with_registry!(
                "relay_fenced_total",
                "Times this relay found itself fenced: a lease renewal or a batch's outcome \
                 refused because another relay had taken the lease over",
                registry
            )?,
            delayed_released: register_int_counter_with_registry!(
                "outbox_delayed_released_total",
                "Delayed events this relay released into the outbox once due",
                registry
            )?,
            schedule_occurrences: register_int_counter_vec_with_registry!(
                Opts::new(
                    "outbox_schedule_occurrences_total",
                    "Occurrences of recurring schedules this relay materialised, by outcome: \
                     fired (appended as a delayed event) or skipped (passed over by the \
                     schedule's missed-occurrence policy)",
                ),
                &["outcome"],
                registry
            )?,
            delayed_due: register_int_gauge_with_registry!(
                "outbox_delayed_due",
                "Delayed events that are due and not yet released into the outbox (0 while a \
                 relay is active and keeping up)",
                registry
            )?,
            delayed_overdue: register_gauge_with_registry!(
                "outbox_delayed_overdue_seconds",
                "How long ago the oldest due delayed event still waiting fell due, by the \
                 database clock; 0 when none waits",
                registry
            )?,
        };
        for outcome in ["fired", "skipped"] {
            let _ = m.schedule_occurrences.with_label_values(&[outcome]);
        }
        for reason in TakeoverReason::ALL {
            let _ = m.takeovers.with_label_values(&[reason.label()]);
        }
        for reason in LeaseEnd::LOST_LABELS {
            let _ = m.lease_lost.with_label_values(&[reason]);
        }
        // Every bounded label value exists from the start, at zero.
        for stage in ["claim", "produce", "mark"] {
            let _ = m.stage_duration.with_label_values(&[stage]);
        }
        for outcome in ["published", "retry", "failed"] {
            let _ = m.published.with_label_values(&[outcome]);
        }
        for reason in [
            "message_too_large",
            "unknown_topic",
            "invalid_topic",
            "invalid_message",
            "not_authorized",
            "timeout",
            "queue_full",
            "broker",
            "canceled",
            "producer_fatal",
            "other",
            "database",
            "wal",
        ] {
            let _ = m.publish_errors.with_label_values(&[reason]);
        }
        Ok(m)
    }

    /// Records a lease this relay took.
    pub fn record_takeover(&self, epoch: i64, acquired: &Acquired) {
        self.lease_epoch.set(epoch);
        self.takeovers
            .with_label_values(&[acquired.reason.label()])
            .inc();
        if let Some(gap) = acquired.since_previous_renewal {
            self.takeover_gap.observe(gap.max(0.0));
        }
    }

    /// Records how holding a lease ended: lost (expired, or fenced by another relay's takeover)
    /// or not.
    pub fn record_lease_end(&self, end: LeaseEnd) {
        if end == LeaseEnd::Fenced {
            self.fenced.inc();
        }
        if let Some(reason) = end.lost_label() {
            self.lease_lost.with_label_values(&[reason]).inc();
        }
    }

    /// Copies librdkafka's periodic statistics into the client gauges. Broker series are rebuilt
    /// each time, so a broker that left the cluster leaves no stale series.
    pub fn record_statistics(&self, stats: &Statistics) {
        self.producer_queue.set(stats.msg_cnt as i64);
        self.producer_queue_max.set(stats.msg_max as i64);
        self.broker_rtt.reset();
        for broker in stats.brokers.values() {
            if broker.nodeid < 0 {
                continue; // bootstrap placeholder, not a broker
            }
            if let Some(rtt) = &broker.rtt {
                self.broker_rtt
                    .with_label_values(&[&broker.nodename])
                    .set(rtt.avg as f64 / 1e6);
            }
        }
    }
}
