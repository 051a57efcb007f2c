//! The messages a batch works on and what it reports: a record as read from Kafka, the fence it
//! is applied under, and each message's outcome. The lowest layer of the batch transaction:
//! every other part of it reads these types, and they read none of those parts.

use chrono::{DateTime, Utc};
use pipeline_core::envelope::{Envelope, EnvelopeError};
use uuid::Uuid;

use crate::handlers::Event;

/// A record as read from Kafka, owned so it can cross to the partition's task.
#[derive(Debug, Clone)]
pub struct InboundMessage {
    /// Topic the record was read from.
    pub topic: String,
    /// Partition the record was read from.
    pub partition: i32,
    /// The record's offset in its partition.
    pub offset: i64,
    /// The record's key (the aggregate id for our events), if it has one.
    pub key: Option<Vec<u8>>,
    /// The record's payload (JSON for our events), if it has one.
    pub payload: Option<Vec<u8>>,
    /// All headers as a JSON object (values decoded lossily), kept for dead letters.
    pub headers: RecordHeaders,
    /// The envelope read from the key and headers, or why the record is not one of our events
    /// (it is then dead-lettered).
    pub envelope: Result<Envelope, EnvelopeError>,
}

/// A record's headers as compact JSON text: one allocation per queued message instead of a map
/// of strings, parsed only when a dead letter needs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeaders(Box<str>);

impl RecordHeaders {
    /// Headers as a record carries them: each value decoded lossily as UTF-8, `null` without
    /// one. Written straight to JSON text, with no map built on the way.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Self {
        struct Pairs<'a>(Vec<(&'a str, Option<&'a [u8]>)>);
        impl serde::Serialize for Pairs<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_map(
                    self.0
                        .iter()
                        .map(|(k, v)| (k, v.map(String::from_utf8_lossy))),
                )
            }
        }
        let text = serde_json::to_string(&Pairs(pairs.into_iter().collect()))
            .unwrap_or_else(|_| "{}".to_owned());
        RecordHeaders(text.into_boxed_str())
    }

    /// The headers as a JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::from_str(&self.0)
            .unwrap_or_else(|_| serde_json::Value::Object(serde_json::Map::new()))
    }
}

impl Default for RecordHeaders {
    fn default() -> Self {
        RecordHeaders("{}".into())
    }
}

impl From<serde_json::Value> for RecordHeaders {
    fn from(value: serde_json::Value) -> Self {
        RecordHeaders(value.to_string().into_boxed_str())
    }
}

/// What happened to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Effects applied now.
    Applied,
    /// Already processed by this group (redelivery or Kafka duplicate): effects skipped.
    Duplicate,
    /// Ahead of its order's next sequence: recorded, applied later in order.
    Parked,
    /// A sequence this group already applied, under another event id: flagged, not applied.
    Stale,
    /// The message itself is bad: recorded with its cause in `dead_letter`.
    DeadLettered,
}

impl Outcome {
    /// Fixed metric label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Applied => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Parked => "parked",
            Outcome::Stale => "stale",
            Outcome::DeadLettered => "dead_lettered",
        }
    }
}

/// The result of a committed batch.
#[derive(Debug, Default)]
pub struct BatchReport {
    /// One outcome per input message, in input order.
    pub outcomes: Vec<Outcome>,
    /// Creation times of every event applied, including parked ones released by this batch.
    pub applied_occurred_at: Vec<DateTime<Utc>>,
    /// Parked events released and applied by this batch.
    pub released: usize,
    /// Events whose sequence was not the next one of their order (parked or stale).
    pub out_of_sequence: usize,
    /// Time from BEGIN to the end of COMMIT.
    pub transaction_duration: std::time::Duration,
}

/// A readable message of a batch and the event read from it.
pub(crate) struct Pending<'m> {
    pub(crate) msg: &'m InboundMessage,
    pub(crate) event: Event,
}

/// The event a message carries, or why it is not one (then it is dead-lettered).
pub(crate) fn read_event(msg: &InboundMessage) -> Result<Event, String> {
    let envelope = msg.envelope.clone().map_err(|e| e.to_string())?;
    let payload = msg.payload.as_deref().ok_or("record has no payload")?;
    let payload: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    Ok(Event { envelope, payload })
}

/// The partition a batch belongs to and the token this consumer owns it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Topic of the fenced partition.
    pub topic: String,
    /// The fenced partition.
    pub partition: i32,
    /// This consumer's ownership token, as claimed in `partition_owner`; batches are refused
    /// once another member's token replaces it.
    pub owner: Uuid,
}

#[cfg(test)]
mod tests {
    use super::RecordHeaders;

    #[test]
    fn record_headers_keep_every_header_as_json() {
        let headers = RecordHeaders::from_pairs([
            ("event-id", Some(b"e-1".as_slice())),
            ("quote\"d", Some(b"caf\xc3\xa9 \xff".as_slice())),
            ("empty", None),
        ]);
        assert_eq!(
            headers.to_json(),
            serde_json::json!({"event-id": "e-1", "quote\"d": "café \u{fffd}", "empty": null})
        );
        assert_eq!(
            RecordHeaders::from_pairs([]).to_json(),
            serde_json::json!({})
        );
    }
}
