//! Producing a claimed batch to Kafka and collecting every delivery report.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pipeline_core::envelope::Envelope;
use pipeline_core::kafka::KafkaArgs;
use pipeline_core::producer::{BatchReports, QuietProducer};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureRecord;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;

use crate::claim::OutboxEvent;
use crate::mark::Published;
use crate::metrics::RelayMetrics;

/// The relay's producer client context: turns librdkafka statistics into metrics and its logs
/// into `tracing` events.
pub struct RelayClientContext {
    metrics: RelayMetrics,
}

impl ClientContext for RelayClientContext {
    fn stats(&self, statistics: Statistics) {
        self.metrics.record_statistics(&statistics);
    }

    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error => tracing::error!(fac, "librdkafka: {message}"),
            Warning => tracing::warn!(fac, "librdkafka: {message}"),
            _ => tracing::debug!(fac, "librdkafka: {message}"),
        }
    }
}

/// The relay's producer.
pub type RelayProducer = QuietProducer<RelayClientContext>;

/// Producer settings of the relay.
#[derive(Debug, Clone)]
pub struct ProducerSettings {
    /// How long librdkafka keeps trying to deliver one message (`message.timeout.ms`).
    pub delivery_timeout: Duration,
    /// `linger.ms`: how long to wait to fill a produce request.
    pub linger: Duration,
    /// `compression.type`.
    pub compression: String,
    /// `statistics.interval.ms` (0 disables client statistics).
    pub statistics_interval: Duration,
}

/// How long the relay waits for the answer to a produce request (librdkafka's
/// `socket.timeout.ms`, 60 s by default, capped by the delivery timeout) before it drops the
/// connection and sends the request's messages again. A leader that is frozen, or cut off
/// without the connection being closed, answers nothing, and the idempotent producer sends
/// nothing more to that leader's partitions until its requests in flight are answered or timed
/// out: this bounds how long such a leader holds the whole batch. Longer than a broker's session
/// timeout (Kafka's default 9 s), so that by the time the messages are sent again the controller
/// has given the partitions a new leader, which the producer then reads from the cluster.
pub const PRODUCE_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a leader may hold a produce request waiting for the in-sync replicas
/// (`request.timeout.ms`, enforced by the broker): shorter than [`PRODUCE_REQUEST_TIMEOUT`], so
/// that a live leader answers with a (retried) timeout before the relay gives up on the
/// connection.
pub const BROKER_ACK_TIMEOUT: Duration = Duration::from_secs(8);

/// Creates the idempotent, `acks=all` producer. A request timed out or answered with a timeout
/// is sent again with the same producer id and sequence numbers, so the broker writes each
/// message once and in order; a message not acknowledged within the delivery timeout fails and
/// its event is retried by the relay (its possible earlier copy is a Kafka-level duplicate the
/// consumers skip).
pub fn create_producer(
    kafka: &KafkaArgs,
    settings: &ProducerSettings,
    metrics: RelayMetrics,
) -> Result<RelayProducer, KafkaError> {
    let mut config = kafka.client_config();
    config
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("max.in.flight.requests.per.connection", "5")
        .set(
            "socket.timeout.ms",
            PRODUCE_REQUEST_TIMEOUT.as_millis().to_string(),
        )
        .set(
            "request.timeout.ms",
            BROKER_ACK_TIMEOUT.as_millis().to_string(),
        )
        .set(
            "message.timeout.ms",
            settings.delivery_timeout.as_millis().to_string(),
        )
        .set("linger.ms", settings.linger.as_millis().to_string())
        .set("compression.type", &settings.compression)
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "200000")
        .set(
            "statistics.interval.ms",
            settings.statistics_interval.as_millis().to_string(),
        );
    // Pass-through options win: an operator may tune anything but the guarantees above.
    for (k, v) in &kafka.kafka_options {
        if !matches!(k.as_str(), "acks" | "enable.idempotence") {
            config.set(k, v);
        }
    }
    QuietProducer::create(&config, RelayClientContext { metrics })
}

/// The relay's producer for the life of the process.
///
/// It is made once, before the relay takes the lock, and kept across activations: a new
/// idempotent producer waits for its producer id (librdkafka asks on a 500 ms timer after
/// creation), so a standby that takes over with a warm producer publishes at once. After a fatal
/// error (librdkafka gives up on idempotence: a sequence desynchronisation, a producer id it can
/// no longer use) the instance refuses every message for good; [`ProducerHandle::renew_if_fatal`]
/// replaces it, and the events of the failed attempts are retried by the new one.
pub struct ProducerHandle {
    kafka: KafkaArgs,
    settings: ProducerSettings,
    metrics: RelayMetrics,
    producer: RelayProducer,
}

impl ProducerHandle {
    /// Creates the relay's producer on `kafka` with `settings`, its statistics on `metrics`.
    pub fn create(
        kafka: &KafkaArgs,
        settings: &ProducerSettings,
        metrics: RelayMetrics,
    ) -> Result<Self, KafkaError> {
        let producer = create_producer(kafka, settings, metrics.clone())?;
        Ok(ProducerHandle {
            kafka: kafka.clone(),
            settings: settings.clone(),
            metrics,
            producer,
        })
    }

    /// The current producer.
    pub fn producer(&self) -> &RelayProducer {
        &self.producer
    }

    /// The fatal error librdkafka raised on the current producer, if any.
    pub fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        self.producer.client().fatal_error()
    }

    /// Replaces the producer when it has a fatal error; returns that error. Call it with no
    /// batch in flight, so that no aggregate has events with both instances at once.
    pub fn renew_if_fatal(&mut self) -> Result<Option<(RDKafkaErrorCode, String)>, KafkaError> {
        let Some((code, reason)) = self.fatal_error() else {
            return Ok(None);
        };
        tracing::error!(?code, %reason, "Kafka producer hit a fatal error; replacing it");
        self.producer = create_producer(&self.kafka, &self.settings, self.metrics.clone())?;
        self.metrics
            .producer_renewals
            .with_label_values(&[&format!("{code:?}")])
            .inc();
        Ok(Some((code, reason)))
    }
}

/// One event that could not be delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryFailure {
    /// The outbox row's id.
    pub id: i64,
    /// Attempts that failed before this one.
    pub attempts_before: i32,
    /// What Kafka or the producer said.
    pub error: String,
    /// The error will not heal by retrying (message too large, invalid record, not authorised…).
    pub permanent: bool,
    /// Fixed label for metrics.
    pub reason: &'static str,
}

/// What happened to a batch.
#[derive(Debug, Default)]
pub struct BatchDelivery {
    /// Events Kafka acknowledged.
    pub published: Vec<Published>,
    /// Events that could not be delivered.
    pub failed: Vec<DeliveryFailure>,
    /// Events not sent because an earlier event of their aggregate failed in this batch (ids).
    pub held: Vec<i64>,
}

/// Produces `events` in order (key = aggregate id) and waits for every delivery report.
///
/// The idempotent producer keeps the order of one partition across its internal retries. When an
/// event cannot even be queued (the producer refuses it: too large for `message.max.bytes`…), the
/// later events of its aggregate in this batch are not sent. One the broker refuses after it was
/// queued cannot hold the later events of its aggregate already sent with it: those may be
/// published ahead of it (see [`published_ahead_of_failures`]); consumer groups park them until
/// the gap closes.
pub async fn publish_batch(producer: &RelayProducer, events: &[OutboxEvent]) -> BatchDelivery {
    send_batch(producer, events)
        .await
        .delivered(producer, events)
        .await
}

/// A batch handed to the producer, its delivery reports to come.
pub struct SentBatch {
    outcome: BatchDelivery,
    /// The index of each event the producer took, in the batch's order.
    sent: Vec<usize>,
    reports: Arc<BatchReports>,
}

/// The first half of [`publish_batch`]: hands `events` to the producer in order, waiting only
/// while its local queue is full. Batches sent one after another reach each partition in that
/// order.
pub async fn send_batch(producer: &RelayProducer, events: &[OutboxEvent]) -> SentBatch {
    let mut outcome = BatchDelivery::default();
    let mut blocked: HashSet<&str> = HashSet::new();
    let mut sent = Vec::with_capacity(events.len());
    let reports = BatchReports::new(events.len());
    for (index, event) in events.iter().enumerate() {
        if blocked.contains(event.aggregate_id.as_str()) {
            outcome.held.push(event.id);
            continue;
        }
        let extra = event.extra_headers();
        let traceparent = extra
            .iter()
            .find(|(k, _)| k == pipeline_core::envelope::TRACEPARENT)
            .map(|(_, v)| v.clone());
        let envelope = Envelope {
            event_id: event.event_id,
            event_type: event.event_type.clone(),
            aggregate_id: event.aggregate_id.clone(),
            sequence: event.sequence,
            occurred_at: event.created_at,
            traceparent,
        };
        let headers = envelope.to_headers(&extra);
        let mut record = FutureRecord::to(&event.topic)
            .key(event.aggregate_id.as_str())
            .payload(event.payload.as_str())
            .headers(headers);
        loop {
            match producer.send_in_batch(record, &reports, index) {
                Ok(()) => {
                    sent.push(index);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // The local queue drains as deliveries complete; wait a moment.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((error, _)) => {
                    outcome.failed.push(failure(event, &error));
                    let _ = blocked.insert(event.aggregate_id.as_str());
                    break;
                }
            }
        }
    }
    reports.sent_all();
    SentBatch {
        outcome,
        sent,
        reports,
    }
}

impl SentBatch {
    /// The second half of [`publish_batch`]: waits for every delivery report of the batch
    /// `events` that was sent.
    pub async fn delivered(self, producer: &RelayProducer, events: &[OutboxEvent]) -> BatchDelivery {
        let SentBatch {
            mut outcome,
            sent,
            reports,
        } = self;
        reports.all_reported().await;
        // A fatal error fails every message of the instance, whatever code each report carries.
        let fatal = producer.client().fatal_error().is_some();
        for index in sent {
            let event = &events[index];
            match reports.report(index) {
                Some(Ok(delivery)) => outcome.published.push(Published::reported(
                    event.id,
                    delivery.partition,
                    delivery.offset,
                )),
                Some(Err((KafkaError::Canceled, _))) | None => {
                    outcome.failed.push(DeliveryFailure {
                        id: event.id,
                        attempts_before: event.attempts,
                        error: "delivery report lost (producer closed)".into(),
                        permanent: false,
                        reason: "canceled",
                    })
                }
                Some(Err((error, _))) => {
                    let mut f = failure(event, &error);
                    if fatal {
                        f.reason = "producer_fatal";
                    }
                    outcome.failed.push(f);
                }
            }
        }
        outcome
    }
}

/// Counts what became of a batch's `events` on `metrics`: published, to be retried, given up
/// (`given_up` of the failures), and each published event's delay from its creation to
/// `acked_at`.
pub fn count_delivery(
    metrics: &RelayMetrics,
    events: &[OutboxEvent],
    delivery: &BatchDelivery,
    given_up: usize,
    acked_at: chrono::DateTime<chrono::Utc>,
) {
    metrics
        .published
        .with_label_values(&["published"])
        .inc_by(delivery.published.len() as u64);
    metrics
        .published
        .with_label_values(&["retry"])
        .inc_by(delivery.failed.len().saturating_sub(given_up) as u64);
    metrics
        .published
        .with_label_values(&["failed"])
        .inc_by(given_up as u64);
    let created: HashMap<i64, chrono::DateTime<chrono::Utc>> =
        events.iter().map(|e| (e.id, e.created_at)).collect();
    for p in &delivery.published {
        if let Some(created) = created.get(&p.id) {
            let delay = (acked_at - *created).num_microseconds().unwrap_or(0).max(0);
            metrics.publish_delay.observe(delay as f64 / 1e6);
        }
    }
}

/// The published events of `delivery` that overtook a failed event of their aggregate in the
/// same batch: (published id, failed id). Empty unless the broker refused an event after later
/// events of its aggregate were sent.
pub fn published_ahead_of_failures(
    events: &[OutboxEvent],
    delivery: &BatchDelivery,
) -> Vec<(i64, i64)> {
    if delivery.failed.is_empty() || delivery.published.is_empty() {
        return Vec::new();
    }
    let by_id: HashMap<i64, &OutboxEvent> = events.iter().map(|e| (e.id, e)).collect();
    // Each aggregate's earliest failed event.
    let mut first_failed: HashMap<&str, &OutboxEvent> = HashMap::new();
    for f in &delivery.failed {
        if let Some(event) = by_id.get(&f.id) {
            let earliest = first_failed
                .entry(event.aggregate_id.as_str())
                .or_insert(event);
            if event.sequence < earliest.sequence {
                *earliest = event;
            }
        }
    }
    delivery
        .published
        .iter()
        .filter_map(|p| {
            let event = by_id.get(&p.id)?;
            let failed = first_failed.get(event.aggregate_id.as_str())?;
            (failed.sequence < event.sequence).then_some((event.id, failed.id))
        })
        .collect()
}

fn failure(event: &OutboxEvent, error: &KafkaError) -> DeliveryFailure {
    let (permanent, reason) = classify(error);
    let error = if reason == "message_too_large" {
        // Kafka's message says "too large" but not how large: the operator needs the sizes.
        let headers: usize = event
            .extra_headers()
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum();
        format!(
            "{error}: record of {} bytes (payload {} bytes, key {} bytes, extra headers {} bytes, \
             before the envelope headers)",
            event.payload.len() + event.aggregate_id.len() + headers,
            event.payload.len(),
            event.aggregate_id.len(),
            headers,
        )
    } else {
        error.to_string()
    };
    DeliveryFailure {
        id: event.id,
        attempts_before: event.attempts,
        error,
        permanent,
        reason,
    }
}

/// Sorts a produce error into permanent (the message or its topic is the problem) or transient,
/// with a bounded label for metrics.
pub fn classify(error: &KafkaError) -> (bool, &'static str) {
    use RDKafkaErrorCode::*;
    let code = match error {
        KafkaError::MessageProduction(code) => *code,
        other => match other.rdkafka_error_code() {
            Some(code) => code,
            None => return (false, "other"),
        },
    };
    match code {
        // MessageBatchTooLarge is Kafka's RECORD_LIST_TOO_LARGE (18).
        MessageSizeTooLarge | InvalidMessageSize | MessageBatchTooLarge => {
            (true, "message_too_large")
        }
        UnknownTopic | UnknownTopicOrPartition | UnknownPartition => (true, "unknown_topic"),
        // Kafka's INVALID_TOPIC_EXCEPTION (17): a name it never accepts.
        InvalidTopic => (true, "invalid_topic"),
        InvalidMessage
        | InvalidRecord
        | BadMessage
        | InvalidArgument
        | UnsupportedForMessageFormat => (true, "invalid_message"),
        TopicAuthorizationFailed | ClusterAuthorizationFailed => (true, "not_authorized"),
        MessageTimedOut | RequestTimedOut => (false, "timeout"),
        QueueFull => (false, "queue_full"),
        // The producer instance is unusable; the relay replaces it and the event is retried.
        Fatal => (false, "producer_fatal"),
        _ => (false, "broker"),
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use uuid::Uuid;

    use super::*;

    fn event(id: i64, aggregate_id: &str, sequence: i64) -> OutboxEvent {
        OutboxEvent {
            id,
            event_id: Uuid::now_v7(),
            event_type: "order.placed".into(),
            aggregate_id: aggregate_id.into(),
            sequence,
            topic: "orders".into(),
            payload: "{}".into(),
            headers: serde_json::json!({}),
            attempts: 0,
            created_at: Utc::now(),
        }
    }

    fn published(id: i64) -> Published {
        Published {
            id,
            partition: 0,
            offset: Some(id),
        }
    }

    fn failed(id: i64) -> DeliveryFailure {
        DeliveryFailure {
            id,
            attempts_before: 0,
            error: "Broker: Message size too large".into(),
            permanent: true,
            reason: "message_too_large",
        }
    }

    #[test]
    fn events_published_ahead_of_a_refused_one_of_their_aggregate_are_found() {
        let events = [
            event(1, "a", 1),
            event(2, "b", 1),
            event(3, "a", 2),
            event(4, "b", 2),
            event(5, "a", 3),
        ];
        // a/1 refused by the broker, a/2 and b/1 published, a/3 failed too, b/2 published.
        let delivery = BatchDelivery {
            published: vec![published(2), published(3), published(4)],
            failed: vec![failed(1), failed(5)],
            held: Vec::new(),
        };
        assert_eq!(published_ahead_of_failures(&events, &delivery), [(3, 1)]);
        let in_order = BatchDelivery {
            published: vec![published(1), published(2), published(4)],
            failed: vec![failed(3)],
            held: Vec::new(),
        };
        assert!(published_ahead_of_failures(&events, &in_order).is_empty());
    }

    #[test]
    fn errors_no_retry_can_heal_are_permanent() {
        use RDKafkaErrorCode::*;
        for (code, reason) in [
            (MessageSizeTooLarge, "message_too_large"),
            (InvalidMessageSize, "message_too_large"),
            (MessageBatchTooLarge, "message_too_large"),
            (InvalidTopic, "invalid_topic"),
            (UnknownTopicOrPartition, "unknown_topic"),
            (InvalidRecord, "invalid_message"),
            (UnsupportedForMessageFormat, "invalid_message"),
            (TopicAuthorizationFailed, "not_authorized"),
        ] {
            let error = KafkaError::MessageProduction(code);
            assert_eq!(classify(&error), (true, reason), "{code:?}");
        }
        for (code, reason) in [
            (MessageTimedOut, "timeout"),
            (QueueFull, "queue_full"),
            (NotLeaderForPartition, "broker"),
            (Fatal, "producer_fatal"),
        ] {
            let error = KafkaError::MessageProduction(code);
            assert_eq!(classify(&error), (false, reason), "{code:?}");
        }
    }
}
