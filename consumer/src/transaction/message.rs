//! The messages a batch works on and what it reports: a record as read from Kafka, the fence it
//! is applied under, and each message's outcome. The lowest layer of the batch transaction:
//! every other part of it reads these types, and they read none of those parts.

use chrono::{DateTime, Utc};
use pipeline_core::envelope::{Envelope, EnvelopeError};
pub use pipeline_core::record::RecordHeaders;
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
    /// The record's headers, in order, with their exact bytes (kept in dead letters).
    pub headers: RecordHeaders,
    /// The envelope read from the key and headers, or why the record is not one of our events
    /// (it is then dead-lettered).
    pub envelope: Result<Envelope, EnvelopeError>,
}

impl InboundMessage {
    /// A record as the Kafka client hands it over, its envelope read from its key and headers.
    pub fn from_record(
        topic: &str,
        partition: i32,
        offset: i64,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: RecordHeaders,
    ) -> Self {
        InboundMessage {
            topic: topic.to_owned(),
            partition,
            offset,
            key: key.map(<[u8]>::to_vec),
            payload: payload.map(<[u8]>::to_vec),
            envelope: Envelope::from_key_and_headers(key, &headers),
            headers,
        }
    }
}

/// What happened to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Effects applied now.
    Applied,
    /// Already processed by this group (redelivery or Kafka duplicate): effects skipped.
    Duplicate,
    /// Ahead of its aggregate's next sequence: recorded, applied later in order.
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
    /// Creation times of every event applied, including parked ones unparked by this batch.
    pub applied_occurred_at: Vec<DateTime<Utc>>,
    /// Parked events applied by this batch once their gap closed (unparked).
    pub unparked: usize,
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

/// The event a message carries, or why it is not one (then it is dead-lettered). An event's
/// text is UTF-8 without NUL throughout (its envelope's and its payload's), so whatever a handler
/// writes of it, PostgreSQL's `text` and `jsonb` take.
pub(crate) fn read_event(msg: &InboundMessage) -> Result<Event, String> {
    let envelope = msg.envelope.clone().map_err(|e| e.to_string())?;
    let payload = msg.payload.as_deref().ok_or("record has no payload")?;
    let payload: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    if holds_nul_escape(msg.payload.as_deref().unwrap_or_default()) && holds_nul(&payload) {
        return Err(
            "payload holds a NUL character (\\u0000), which PostgreSQL's text and jsonb refuse"
                .into(),
        );
    }
    Ok(Event { envelope, payload })
}

/// Whether JSON text may hold a NUL character: the only way to write one is the escape `\u0000`.
fn holds_nul_escape(json: &[u8]) -> bool {
    json.windows(6).any(|w| w == b"\\u0000")
}

/// Whether a string or an object key anywhere in `value` holds a NUL character.
fn holds_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(holds_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
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
