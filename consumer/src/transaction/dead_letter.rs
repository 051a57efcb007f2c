//! Dead letters: messages a group cannot apply because the message itself is bad.
//!
//! Each one is recorded in the `dead_letter` table in the transaction that records it processed,
//! and published to the dead-letter topic (`<topic>.dlq` by default) with headers saying why,
//! where it came from and when it failed. The publish is acknowledged before that transaction
//! commits, so a dead letter is never recorded without being published; a crash in between can
//! only publish it twice (same original topic, partition and offset).

use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use futures::future::try_join_all;
use pipeline_core::envelope::MAX_KEY_BYTES;
use pipeline_core::kafka::KafkaArgs;
use pipeline_core::producer::QuietProducer;
use pipeline_core::record::{escape, without_nul};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::PgConnection;

use super::message::InboundMessage;
use crate::handlers::Event;

/// Header names of dead-letter records.
pub mod headers {
    /// Why the message was dead-lettered.
    pub const REASON: &str = "dlq-reason";
    /// The consumer group that dead-lettered it.
    pub const GROUP: &str = "dlq-group";
    /// Topic the original record was read from.
    pub const ORIGINAL_TOPIC: &str = "dlq-original-topic";
    /// Partition the original record was read from.
    pub const ORIGINAL_PARTITION: &str = "dlq-original-partition";
    /// Offset of the original record in its partition.
    pub const ORIGINAL_OFFSET: &str = "dlq-original-offset";
    /// How many times the message was tried before it was dead-lettered.
    pub const ATTEMPTS: &str = "dlq-attempts";
    /// RFC 3339 time of the first failed attempt.
    pub const FIRST_FAILURE_AT: &str = "dlq-first-failure-at";
    /// RFC 3339 time of the last failed attempt.
    pub const LAST_FAILURE_AT: &str = "dlq-last-failure-at";
    /// Set when the original record's key, headers and payload were left out because Kafka
    /// refused them (too large with these headers, say): why. The `dead_letter` row keeps them.
    pub const CONTENT_OMITTED: &str = "dlq-content-omitted";
}

/// One dead letter of a batch.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The record as read from Kafka; its key, payload and headers are kept and republished.
    pub message: InboundMessage,
    /// The event, when the record could be read as one.
    pub event: Option<Event>,
    /// Why the message cannot be applied.
    pub reason: String,
    /// How many times the message was tried (1 when rejected on its first attempt).
    pub attempts: i32,
    /// When the first attempt failed.
    pub first_failure_at: DateTime<Utc>,
    /// When the last attempt failed.
    pub last_failure_at: DateTime<Utc>,
}

impl DeadLetter {
    /// A message rejected on its first attempt.
    pub fn now(message: &InboundMessage, event: Option<&Event>, reason: &str) -> Self {
        let now = Utc::now();
        DeadLetter {
            message: message.clone(),
            event: event.cloned(),
            reason: reason.to_owned(),
            attempts: 1,
            first_failure_at: now,
            last_failure_at: now,
        }
    }
}

/// Records `letter` in the `dead_letter` table (once per group and record). Nothing the record
/// carries can make this fail: its key, payload and headers are stored as bytes, and every text
/// column takes only text PostgreSQL accepts (escaped where it comes from the record).
pub async fn record(
    conn: &mut PgConnection,
    group: &str,
    letter: &DeadLetter,
) -> Result<(), sqlx::Error> {
    let msg = &letter.message;
    let env = letter.event.as_ref().map(|e| &e.envelope);
    let aggregate_id = letter_order(letter);
    let reason = without_nul(&letter.reason);
    tracing::warn!(
        group, topic = %msg.topic, partition = msg.partition, offset = msg.offset,
        event_id = ?env.map(|e| e.event_id), aggregate_id = ?aggregate_id,
        key = ?msg.key.as_deref().map(escape),
        reason = %reason, "message dead-lettered"
    );
    let (header_names, header_values) = msg.headers.to_columns();
    // The letter and its place in the event's history, in one statement.
    sqlx::query(
        "WITH letter AS (
             INSERT INTO dead_letter (group_name, event_id, aggregate_id, sequence, event_type, topic,
                                      partition, kafka_offset, reason, key, payload, headers,
                                      header_names, header_values,
                                      attempts, first_failure_at, last_failure_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
             ON CONFLICT (group_name, topic, partition, kafka_offset) DO NOTHING
             RETURNING group_name, event_id, aggregate_id, sequence, event_type, topic, partition,
                       kafka_offset, reason)
         INSERT INTO group_transition (group_name, event_id, aggregate_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT group_name, event_id, aggregate_id, sequence, event_type,
                'dead_lettered', reason, topic, partition, kafka_offset
         FROM letter",
    )
    .bind(group)
    .bind(env.map(|e| e.event_id))
    .bind(aggregate_id)
    .bind(env.map(|e| e.sequence))
    .bind(env.map(|e| &e.event_type))
    .bind(&msg.topic)
    .bind(msg.partition)
    .bind(msg.offset)
    .bind(&*reason)
    .bind(&msg.key)
    .bind(&msg.payload)
    .bind(msg.headers.to_display_json())
    .bind(header_names)
    .bind(header_values)
    .bind(letter.attempts)
    .bind(letter.first_failure_at)
    .bind(letter.last_failure_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// The order a letter belongs to: its event's, else its record's key when that could be an
/// order id (UTF-8, no NUL, not too long); none otherwise.
fn letter_order(letter: &DeadLetter) -> Option<&str> {
    if let Some(event) = &letter.event {
        return Some(&event.envelope.aggregate_id);
    }
    let key = std::str::from_utf8(letter.message.key.as_deref()?).ok()?;
    (!key.is_empty() && !key.contains('\0') && key.len() <= MAX_KEY_BYTES).then_some(key)
}

/// Publishes dead letters to Kafka.
pub struct DeadLetterSink {
    producer: QuietProducer<DefaultClientContext>,
    /// Topic name template; `{topic}` is replaced by the original topic.
    topic_template: String,
}

impl DeadLetterSink {
    /// An idempotent producer (`acks=all`) publishing to `topic_template`, in which `{topic}`
    /// stands for the original topic.
    pub fn new(kafka: &KafkaArgs, topic_template: &str) -> anyhow::Result<Self> {
        let mut config = kafka.client_config();
        config
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "30000")
            .set("linger.ms", "1");
        Ok(DeadLetterSink {
            producer: QuietProducer::create(&config, DefaultClientContext)
                .context("creating dead-letter producer")?,
            topic_template: topic_template.to_owned(),
        })
    }

    /// The dead-letter topic of `topic`.
    pub fn topic_for(&self, topic: &str) -> String {
        self.topic_template.replace("{topic}", topic)
    }

    /// Publishes every letter and waits for all acknowledgements.
    pub async fn publish(&self, group: &str, letters: &[DeadLetter]) -> Result<(), KafkaError> {
        let sends = letters.iter().map(|l| self.publish_one(group, l));
        let _ = try_join_all(sends).await?;
        Ok(())
    }

    /// Publishes one letter: the record's key, headers and payload as they were, then ours. A
    /// record Kafka refuses for its content (too large with our headers, say) is published
    /// without its own headers and payload, which the `dead_letter` row keeps, so no content
    /// stops a dead letter.
    async fn publish_one(&self, group: &str, letter: &DeadLetter) -> Result<(), KafkaError> {
        match self.send(group, letter, None).await {
            Err(KafkaError::MessageProduction(code)) if refused_for_content(code) => {
                let why = format!(
                    "the record was refused by Kafka ({code}); its key, headers and payload are kept in the dead_letter table"
                );
                tracing::warn!(group, topic = %letter.message.topic, partition = letter.message.partition,
                    offset = letter.message.offset, error = %code, "dead letter published without its record's content");
                self.send(group, letter, Some(&why)).await
            }
            other => other,
        }
    }

    async fn send(
        &self,
        group: &str,
        letter: &DeadLetter,
        content_omitted: Option<&str>,
    ) -> Result<(), KafkaError> {
        let msg = &letter.message;
        let topic = self.topic_for(&msg.topic);
        let (partition, offset, attempts) = (
            msg.partition.to_string(),
            msg.offset.to_string(),
            letter.attempts.to_string(),
        );
        let first = letter
            .first_failure_at
            .to_rfc3339_opts(SecondsFormat::Micros, true);
        let last = letter
            .last_failure_at
            .to_rfc3339_opts(SecondsFormat::Micros, true);
        let mut hdrs = OwnedHeaders::new_with_capacity(msg.headers.len() + 9);
        // The original headers first, exactly, then ours.
        if content_omitted.is_none() {
            for (key, value) in msg.headers.iter() {
                hdrs = hdrs.insert(Header { key, value });
            }
        }
        for (key, value) in [
            (headers::REASON, letter.reason.as_str()),
            (headers::GROUP, group),
            (headers::ORIGINAL_TOPIC, msg.topic.as_str()),
            (headers::ORIGINAL_PARTITION, partition.as_str()),
            (headers::ORIGINAL_OFFSET, offset.as_str()),
            (headers::ATTEMPTS, attempts.as_str()),
            (headers::FIRST_FAILURE_AT, first.as_str()),
            (headers::LAST_FAILURE_AT, last.as_str()),
        ]
        .into_iter()
        .chain(content_omitted.map(|why| (headers::CONTENT_OMITTED, why)))
        {
            hdrs = hdrs.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(hdrs);
        if let (Some(k), None) = (&msg.key, content_omitted) {
            record = record.key(k.as_slice());
        }
        if let (Some(p), None) = (&msg.payload, content_omitted) {
            record = record.payload(p.as_slice());
        }
        self.producer
            .send(record, Duration::from_secs(5))
            .await
            .map(|_| ())
    }
}

/// Errors Kafka answers for a record's content, which no retry can change.
fn refused_for_content(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidArgument
            | RDKafkaErrorCode::BadMessage
    )
}
