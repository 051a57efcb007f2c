//! The relay's Prometheus metrics, registered on a registry passed in.

use prometheus::{
    exponential_buckets, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, Opts, Registry,
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
    /// `outbox_delayed_overdue_seconds`: how long ago the oldest due delayed event still waiting fell due, by the database clock; 0 when none waits.
    pub delayed_overdue: Gauge,
}

impl RelayMetrics {
    /// Registers the relay's metrics on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = RelayMetrics {
            published: IntCounterVec::new(
                Opts::new(
                    "outbox_published_total",
                    "Outbox events handled by the relay, by outcome",
                ),
                &["outcome"],
            )?,
            publish_errors: IntCounterVec::new(
                Opts::new(
                    "relay_publish_errors_total",
                    "Failed publish attempts, by reason",
                ),
                &["reason"],
            )?,
            batch_size: Histogram::with_opts(
                HistogramOpts::new("relay_batch_size", "Events claimed per relay batch")
                    .buckets(exponential_buckets(1.0, 4.0, 8)?),
            )?,
            batch_duration: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_batch_duration_seconds",
                    "Time to claim, publish and mark one batch",
                )
                .buckets(exponential_buckets(0.001, 2.0, 16)?),
            )?,
            stage_duration: HistogramVec::new(
                HistogramOpts::new(
                    "relay_batch_stage_seconds",
                    "Time of each stage of a relay batch: claim (read from the outbox), produce \
                     (handed to the producer until every delivery report), mark (outcome written)",
                )
                .buckets(exponential_buckets(0.0005, 2.0, 16)?),
                &["stage"],
            )?,
            publish_delay: Histogram::with_opts(
                HistogramOpts::new(
                    "outbox_publish_delay_seconds",
                    "Delivery acknowledgement time minus event creation time",
                )
                .buckets(exponential_buckets(0.001, 2.0, 20)?),
            )?,
            last_success: Gauge::new(
                "relay_last_success_timestamp_seconds",
                "Unix time of the last relay loop that completed without error",
            )?,
            active: IntGauge::new(
                "relay_active",
                "1 while this relay holds the lease and publishes",
            )?,
            unpublished: IntGauge::new(
                "outbox_unpublished_events",
                "Outbox events not yet published",
            )?,
            failed: IntGauge::new(
                "outbox_failed_events",
                "Outbox events the relay gave up on (state failed: a permanent error such as \
                 message too large, after --max-attempts), waiting for an operator's requeue",
            )?,
            held: IntGauge::new(
                "outbox_held_events",
                "Outbox events waiting behind a failed event of their aggregate: they go out, in \
                 order, once it is requeued and published",
            )?,
            oldest_unpublished_age: Gauge::new(
                "outbox_oldest_unpublished_age_seconds",
                "Age of the oldest unpublished outbox event by the database clock, 0 when none",
            )?,
            producer_queue: IntGauge::new(
                "relay_kafka_producer_queue_messages",
                "Messages in the Kafka producer's queue (librdkafka msg_cnt)",
            )?,
            producer_queue_max: IntGauge::new(
                "relay_kafka_producer_queue_max_messages",
                "Capacity of the Kafka producer's queue (librdkafka msg_max)",
            )?,
            broker_rtt: GaugeVec::new(
                Opts::new(
                    "relay_kafka_broker_rtt_seconds",
                    "Average broker round-trip time over librdkafka's last statistics window",
                ),
                &["broker"],
            )?,
            producer_renewals: IntCounterVec::new(
                Opts::new(
                    "relay_producer_renewals_total",
                    "Kafka producers replaced after librdkafka reported a fatal error, by error code",
                ),
                &["code"],
            )?,
            takeovers: IntCounterVec::new(
                Opts::new(
                    "relay_lease_takeovers_total",
                    "Times this relay took the relay lease, by how: vacant (nobody held it), \
                     holder_gone (the holder's session ended) or expired (the holder stopped \
                     renewing: frozen or cut off)",
                ),
                &["reason"],
            )?,
            takeover_gap: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_takeover_gap_seconds",
                    "At each takeover by this relay, time since the previous holder last renewed \
                     the lease (database clock): at least as long as the time without an active relay",
                )
                .buckets(exponential_buckets(0.1, 2.0, 12)?),
            )?,
            lease_epoch: IntGauge::new(
                "relay_lease_epoch",
                "Epoch of the lease this relay last took; every takeover raises it",
            )?,
            lease_lost: IntCounterVec::new(
                Opts::new(
                    "relay_lease_lost_total",
                    "Times this relay lost the lease while active, by reason: expired (not \
                     renewed in time) or fenced (another relay had taken it over)",
                ),
                &["reason"],
            )?,
            lease_vacant: Gauge::new(
                "relay_lease_vacant_seconds",
                "How long the relay lease has had no live holder (expired or handed back, not \
                 yet taken), by the database clock; 0 while a relay holds it",
            )?,
            fenced: IntCounter::new(
                "relay_fenced_total",
                "Times this relay found itself fenced: a lease renewal or a batch's outcome \
                 refused because another relay had taken the lease over",
            )?,
            delayed_released: IntCounter::new(
                "outbox_delayed_released_total",
                "Delayed events this relay released into the outbox once due",
            )?,
            schedule_occurrences: IntCounterVec::new(
                Opts::new(
                    "outbox_schedule_occurrences_total",
                    "Occurrences of recurring schedules this relay materialised, by outcome: \
                     fired (appended as a delayed event) or skipped (passed over by the \
                     schedule's missed-occurrence policy)",
                ),
                &["outcome"],
            )?,
            delayed_due: IntGauge::new(
                "outbox_delayed_due",
                "Delayed events that are due and not yet released into the outbox (0 while a \
                 relay is active and keeping up)",
            )?,
            delayed_overdue: Gauge::new(
                "outbox_delayed_overdue_seconds",
                "How long ago the oldest due delayed event still waiting fell due, by the \
                 database clock; 0 when none waits",
            )?,
        };
        registry.register(Box::new(m.published.clone()))?;
        registry.register(Box::new(m.takeovers.clone()))?;
        registry.register(Box::new(m.takeover_gap.clone()))?;
        registry.register(Box::new(m.lease_epoch.clone()))?;
        registry.register(Box::new(m.lease_lost.clone()))?;
        registry.register(Box::new(m.lease_vacant.clone()))?;
        registry.register(Box::new(m.fenced.clone()))?;
        registry.register(Box::new(m.delayed_released.clone()))?;
        registry.register(Box::new(m.schedule_occurrences.clone()))?;
        for outcome in ["fired", "skipped"] {
            let _ = m.schedule_occurrences.with_label_values(&[outcome]);
        }
        registry.register(Box::new(m.delayed_due.clone()))?;
        registry.register(Box::new(m.delayed_overdue.clone()))?;
        for reason in TakeoverReason::ALL {
            let _ = m.takeovers.with_label_values(&[reason.label()]);
        }
        for reason in LeaseEnd::LOST_LABELS {
            let _ = m.lease_lost.with_label_values(&[reason]);
        }
        registry.register(Box::new(m.publish_errors.clone()))?;
        registry.register(Box::new(m.batch_size.clone()))?;
        registry.register(Box::new(m.batch_duration.clone()))?;
        registry.register(Box::new(m.stage_duration.clone()))?;
        registry.register(Box::new(m.publish_delay.clone()))?;
        registry.register(Box::new(m.last_success.clone()))?;
        registry.register(Box::new(m.active.clone()))?;
        registry.register(Box::new(m.unpublished.clone()))?;
        registry.register(Box::new(m.failed.clone()))?;
        registry.register(Box::new(m.held.clone()))?;
        registry.register(Box::new(m.oldest_unpublished_age.clone()))?;
        registry.register(Box::new(m.producer_queue.clone()))?;
        registry.register(Box::new(m.producer_queue_max.clone()))?;
        registry.register(Box::new(m.broker_rtt.clone()))?;
        registry.register(Box::new(m.producer_renewals.clone()))?;
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
