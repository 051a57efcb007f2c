//! Appending events to the transactional outbox.
//!
//! Any Rust service calls [`enqueue`] inside its own sqlx transaction, next to its business
//! writes: the event is committed, or rolled back, together with them. The relay publishes it.

pub use pipeline_core::db::OUTBOX_CHANNEL;
use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

/// An event to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// Business key of the fact this event records; with `event_type`, enqueueing the same fact
    /// twice is a no-op.
    pub business_key: String,
    /// Event type, e.g. `order.placed`.
    pub event_type: String,
    /// The aggregate (e.g. order) id: the Kafka key and the scope of the sequence numbers.
    pub aggregate_id: String,
    /// Kafka topic to publish to.
    pub topic: String,
    /// JSON payload.
    pub payload: Value,
    /// Extra Kafka headers (the envelope headers are added by the relay).
    pub headers: Vec<(String, String)>,
}

/// What [`enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new event was appended with this id and per-aggregate sequence number.
    New { event_id: Uuid, sequence: i64 },
    /// The same (business key, event type) was already in the outbox; nothing was written.
    Duplicate { event_id: Uuid, sequence: i64 },
}

impl Enqueued {
    /// Id of the event, whether appended now or found already recorded.
    pub fn event_id(self) -> Uuid {
        match self {
            Enqueued::New { event_id, .. } | Enqueued::Duplicate { event_id, .. } => event_id,
        }
    }

    /// Per-aggregate sequence number of the event.
    pub fn sequence(self) -> i64 {
        match self {
            Enqueued::New { sequence, .. } | Enqueued::Duplicate { sequence, .. } => sequence,
        }
    }
}

/// Why an event could not be appended.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("event field `{0}` must not be empty")]
    Empty(&'static str),
    #[error("event field `{0}` contains a NUL character")]
    NulCharacter(&'static str),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Appends `event` to the outbox inside `tx`.
///
/// The next sequence number of the aggregate is taken under a row lock held until `tx` ends, so
/// events of one aggregate commit in sequence order and a later one can never become visible
/// before an earlier one. The caller commits.
pub async fn enqueue(
    tx: &mut Transaction<'_, Postgres>,
    event: &NewEvent,
) -> Result<Enqueued, EnqueueError> {
    validate(event)?;
    let headers = Value::Object(
        event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    );
    // One round trip: lock the aggregate's sequence row (creating it at 1 on first use), take the
    // next number and insert the event with it.
    let event_id = Uuid::now_v7();
    let inserted: Option<i64> = sqlx::query_scalar(
        "WITH next AS (
             INSERT INTO outbox_sequence (aggregate_id, last_sequence) VALUES ($4, 1)
             ON CONFLICT (aggregate_id)
             DO UPDATE SET last_sequence = outbox_sequence.last_sequence + 1
             RETURNING last_sequence)
         INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload, headers)
         SELECT $1, $2, $3, $4, next.last_sequence, $5, $6, $7 FROM next
         ON CONFLICT (business_key, event_type) DO NOTHING
         RETURNING sequence",
    )
    .bind(event_id)
    .bind(&event.business_key)
    .bind(&event.event_type)
    .bind(&event.aggregate_id)
    .bind(&event.topic)
    .bind(&event.payload)
    .bind(&headers)
    .fetch_optional(&mut **tx)
    .await?;

    if let Some(sequence) = inserted {
        return Ok(Enqueued::New { event_id, sequence });
    }
    // Already recorded: give the sequence number back (we still hold the row lock, so nobody
    // else took a later one) and report the existing event.
    sqlx::query(
        "UPDATE outbox_sequence SET last_sequence = last_sequence - 1 WHERE aggregate_id = $1",
    )
    .bind(&event.aggregate_id)
    .execute(&mut **tx)
    .await?;
    let (event_id, sequence): (Uuid, i64) = sqlx::query_as(
        "SELECT event_id, sequence FROM outbox WHERE business_key = $1 AND event_type = $2",
    )
    .bind(&event.business_key)
    .bind(&event.event_type)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Enqueued::Duplicate { event_id, sequence })
}

/// Asks a listening relay to look for new events as soon as `tx` commits.
///
/// PostgreSQL folds identical notifications of one transaction into one, but every notifying
/// transaction takes a global lock at commit: under heavy write load prefer the relay's short
/// poll and leave this off.
pub async fn notify_relay(tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(OUTBOX_CHANNEL)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn validate(event: &NewEvent) -> Result<(), EnqueueError> {
    let fields = [
        ("business_key", &event.business_key),
        ("event_type", &event.event_type),
        ("aggregate_id", &event.aggregate_id),
        ("topic", &event.topic),
    ];
    for (name, value) in fields {
        if value.is_empty() {
            return Err(EnqueueError::Empty(name));
        }
        if value.contains('\0') {
            return Err(EnqueueError::NulCharacter(name));
        }
    }
    if event
        .headers
        .iter()
        .any(|(k, v)| k.contains('\0') || v.contains('\0'))
    {
        return Err(EnqueueError::NulCharacter("headers"));
    }
    // PostgreSQL's jsonb cannot store U+0000: without this check the insert fails as a database
    // error, which callers would take for a transient fault and retry forever.
    if json_contains_nul(&event.payload) {
        return Err(EnqueueError::NulCharacter("payload"));
    }
    Ok(())
}

fn json_contains_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(json_contains_nul),
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| k.contains('\0') || json_contains_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}
