//! The transactional outbox: a service appends the events that describe its business changes
//! inside its own PostgreSQL transaction, next to those changes, and the relay (`relay run`)
//! publishes them to Kafka.
//!
//! ```no_run
//! use outbox::{enqueue, NewEvent};
//!
//! # async fn capture(pool: sqlx::PgPool, payment_id: &str) -> Result<(), Box<dyn std::error::Error>> {
//! // Once, at start-up: the outbox's own tables, and nothing else.
//! outbox::MIGRATOR.run(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE payment SET status = 'captured' WHERE payment_id = $1")
//!     .bind(payment_id)
//!     .execute(&mut *tx)
//!     .await?;
//! let event = NewEvent {
//!     business_key: payment_id.to_owned(),
//!     event_type: "payment.captured".to_owned(),
//!     aggregate_id: payment_id.to_owned(),
//!     topic: "payment-events".to_owned(),
//!     payload: serde_json::json!({ "payment_id": payment_id, "amount_cents": 1200 }),
//!     headers: vec![],
//! };
//! let enqueued = enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // the change and its event, together or not at all
//! println!("event {} is number {} of its payment", enqueued.event_id(), enqueued.sequence());
//! # Ok(())
//! # }
//! ```
//!
//! What it guarantees:
//! - **Atomic with the change.** The event is written by the caller's transaction: it exists if
//!   and only if that transaction commits.
//! - **Ordered per aggregate.** Each event gets the next sequence number of its aggregate (the
//!   Kafka key) under a row lock held until the transaction ends, so events of one aggregate
//!   commit, are published and are applied by consumer groups in sequence order.
//! - **Once per business fact.** A (business key, event type) pair is recorded once: enqueueing
//!   it again is a no-op that returns the event already recorded ([`Enqueued::Duplicate`]).
//! - **Published at least once, applied exactly once.** The relay publishes every committed event
//!   with `acks=all` and the idempotent producer and may publish one again after a crash; the
//!   consumer groups skip such duplicates by event id.
//!
//! Delayed and scheduled events: [`enqueue_at`] appends an event the relay publishes when it is
//! due, not before (a reminder half an hour after an order, a retry at a given time), with the
//! same guarantees. A delayed event takes its place in its aggregate's sequence when it becomes
//! due: it never holds the aggregate's other events, and it is published after every event the
//! aggregate committed before that moment. [`cancel_scheduled`] withdraws one that is not due
//! yet, in the caller's transaction.
//!
//! This crate brings no HTTP server or client: sqlx, serde_json, uuid, chrono and thiserror
//! only.

#![warn(missing_docs)]

use std::collections::HashMap;

use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

mod schedule;

pub use schedule::{cancel_scheduled, enqueue_all_at, enqueue_at, PublishAt, Scheduled};

/// The migrations of the outbox's tables (the outbox, the relay's queue, delivery records and
/// lease) and of nothing else: run it on the database your service writes its changes to. It
/// shares sqlx's migration table with other sets of migrations (the consumer library's, your
/// own), so each set leaves the others' versions alone.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/outbox")
};

/// The LISTEN/NOTIFY channel the relay wakes on (see [`notify_relay`]).
pub const OUTBOX_CHANNEL: &str = "outbox_pending";

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
    New {
        /// The new event's id (the `event-id` header consumers deduplicate on).
        event_id: Uuid,
        /// Its place in its aggregate's sequence, from 1.
        sequence: i64,
    },
    /// The same (business key, event type) was already in the outbox; nothing was written.
    Duplicate {
        /// The id of the event recorded before.
        event_id: Uuid,
        /// Its place in its aggregate's sequence.
        sequence: i64,
    },
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
    /// A required field (named) is empty; nothing was written.
    #[error("event field `{0}` must not be empty")]
    Empty(&'static str),
    /// A field (named) holds a NUL character, which PostgreSQL text cannot store; nothing was
    /// written.
    #[error("event field `{0}` contains a NUL character")]
    NulCharacter(&'static str),
    /// [`enqueue_all`]: an event's (business key, event type) is already in the outbox, or twice
    /// in the events given. The transaction is aborted.
    #[error("an event's business key and type are already recorded")]
    AlreadyRecorded,
    /// [`enqueue_at`]: the delay does not fit in a PostgreSQL interval; nothing was written.
    #[error("publish delay {0:?} is too long")]
    DelayTooLong(std::time::Duration),
    /// The database failed; the caller's transaction should be rolled back.
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
    let headers = headers_json(event);
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

/// Appends all `events` inside `tx` in one round trip: each aggregate's events take its next
/// sequence numbers in the order given, under the same row lock as [`enqueue`]. Returns each
/// event's id and sequence number, in the order given.
///
/// Unlike [`enqueue`], an event whose (business key, event type) is already recorded is an error,
/// [`EnqueueError::AlreadyRecorded`], and the statement fails inside PostgreSQL: the transaction
/// is aborted and can only be rolled back, so no sequence number is ever skipped.
pub async fn enqueue_all(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    append(tx, events, None).await
}

/// [`enqueue_all`], and in the same statement (one round trip for all three) schedules the
/// `delayed` events as [`enqueue_all_at`] would (a duplicate fact is skipped) and withdraws the
/// scheduled events of the `withdraw` (business key, event type) pairs as [`cancel_scheduled`]
/// would: e.g. an order service that records an order's change, schedules its reminder and
/// withdraws another's in one go. Returns the immediate events' ids and sequence numbers, in
/// the order given.
pub async fn enqueue_all_and_schedule(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
    delayed: &[(NewEvent, PublishAt)],
    withdraw: &[(&str, &str)],
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    if events.is_empty() {
        // Nothing to sequence: the plain statements do the rest.
        let _ = enqueue_all_at(tx, delayed).await?;
        let _ = cancel_scheduled(tx, withdraw).await?;
        return Ok(Vec::new());
    }
    if delayed.is_empty() && withdraw.is_empty() {
        // Nothing scheduled or withdrawn: enqueue_all's own statement, without the two steps.
        return append(tx, events, None).await;
    }
    append(tx, events, Some((delayed, withdraw))).await
}

/// The statement of [`enqueue_all`]: its common table expressions up to the sequence numbers…
macro_rules! sequenced_ctes {
    () => {
        "WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                                  $6::jsonb[], $7::jsonb[])
                 WITH ORDINALITY AS i(event_id, business_key, event_type, aggregate_id, topic,
                                      payload, headers, n)),
         counts AS (
             SELECT aggregate_id, count(*) AS events FROM input
             GROUP BY aggregate_id ORDER BY aggregate_id),
         next AS (
             INSERT INTO outbox_sequence AS s (aggregate_id, last_sequence)
             SELECT aggregate_id, events FROM counts
             ON CONFLICT (aggregate_id)
             DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
             RETURNING aggregate_id, last_sequence)"
    };
}

/// …and the insert of the events with them.
macro_rules! sequenced_insert {
    () => {
        "
         INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload, headers)
         SELECT i.event_id, i.business_key, i.event_type, i.aggregate_id,
                next.last_sequence - c.events
                    + row_number() OVER (PARTITION BY i.aggregate_id ORDER BY i.n),
                i.topic, i.payload, i.headers
         FROM input i JOIN counts c USING (aggregate_id) JOIN next USING (aggregate_id)
         ORDER BY i.n
         RETURNING event_id, sequence"
    };
}

const ENQUEUE_ALL_SQL: &str = concat!(sequenced_ctes!(), sequenced_insert!());

/// [`ENQUEUE_ALL_SQL`] with two more steps: `$8`…`$16` the delayed events (as
/// `enqueue_all_at`'s statement), `$17`/`$18` the facts whose scheduled events are withdrawn.
const ENQUEUE_ALL_AND_SCHEDULE_SQL: &str = concat!(
    sequenced_ctes!(),
    ",
         later AS (",
    "
             INSERT INTO outbox_scheduled (event_id, business_key, event_type, aggregate_id, topic,
                                           payload, headers, publish_at)
             SELECT l.event_id, l.business_key, l.event_type, l.aggregate_id, l.topic, l.payload,
                    l.headers, COALESCE(l.at, now() + l.delay_us * interval '1 microsecond')
             FROM unnest($8::uuid[], $9::text[], $10::text[], $11::text[], $12::text[],
                         $13::jsonb[], $14::jsonb[], $15::timestamptz[], $16::bigint[])
                  AS l(event_id, business_key, event_type, aggregate_id, topic, payload, headers,
                       at, delay_us)
             WHERE NOT EXISTS (SELECT 1 FROM outbox o
                               WHERE o.business_key = l.business_key
                                 AND o.event_type = l.event_type)
             ON CONFLICT (business_key, event_type) DO NOTHING
             RETURNING 1",
    "),
         withdrawn AS (
             DELETE FROM outbox_scheduled s
             USING unnest($17::text[], $18::text[]) AS w(business_key, event_type)
             WHERE s.business_key = w.business_key AND s.event_type = w.event_type
             RETURNING 1)",
    sequenced_insert!()
);

/// Delayed events to schedule and (business key, event type) pairs to withdraw, with the events
/// of [`append`].
type ScheduleChanges<'a> = (&'a [(NewEvent, PublishAt)], &'a [(&'a str, &'a str)]);

async fn append(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
    schedule: Option<ScheduleChanges<'_>>,
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    for event in events {
        validate(event)?;
    }
    let ids: Vec<Uuid> = events.iter().map(|_| Uuid::now_v7()).collect();
    let field = |f: fn(&NewEvent) -> &str| events.iter().map(f).collect::<Vec<&str>>();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
    let headers: Vec<Value> = events.iter().map(headers_json).collect();
    // Aggregates' sequence rows are taken in key order, so concurrent callers cannot deadlock on
    // them; each aggregate advances by its number of events at once.
    let query = sqlx::query_as::<_, (Uuid, i64)>(match schedule {
        None => ENQUEUE_ALL_SQL,
        Some(_) => ENQUEUE_ALL_AND_SCHEDULE_SQL,
    })
    .bind(&ids)
    .bind(field(|e| &e.business_key))
    .bind(field(|e| &e.event_type))
    .bind(field(|e| &e.aggregate_id))
    .bind(field(|e| &e.topic))
    .bind(&payloads)
    .bind(&headers);
    let rows = match schedule {
        None => query.fetch_all(&mut **tx).await,
        Some((delayed, withdraw)) => {
            let later = schedule::ScheduledColumns::of(delayed)?;
            let keys: Vec<&str> = withdraw.iter().map(|(k, _)| *k).collect();
            let types: Vec<&str> = withdraw.iter().map(|(_, t)| *t).collect();
            later
                .bind_to(query)
                .bind(keys)
                .bind(types)
                .fetch_all(&mut **tx)
                .await
        }
    }
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.constraint() == Some("outbox_business_fact_key") => {
            EnqueueError::AlreadyRecorded
        }
        _ => EnqueueError::Database(e),
    })?;
    let sequences: HashMap<Uuid, i64> = rows.into_iter().collect();
    ids.into_iter()
        .map(|id| match sequences.get(&id) {
            Some(&sequence) => Ok((id, sequence)),
            None => Err(EnqueueError::Database(sqlx::Error::RowNotFound)),
        })
        .collect()
}

pub(crate) fn headers_json(event: &NewEvent) -> Value {
    Value::Object(
        event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
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

pub(crate) fn validate(event: &NewEvent) -> Result<(), EnqueueError> {
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
