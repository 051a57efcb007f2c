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
//! Delayed events: [`enqueue_at`] appends an event the relay publishes when it is
//! due, not before (a reminder half an hour after an order, a retry at a given time), with the
//! same guarantees. A delayed event takes its place in its aggregate's sequence when it becomes
//! due: it never holds the aggregate's other events, and it is published after every event the
//! aggregate committed before that moment. [`cancel_delayed`] withdraws one that is not due
//! yet, in the caller's transaction.
//!
//! What it refuses: before writing anything, every entry point checks each event and returns an
//! [`EnqueueError`] the caller can branch on, leaving the caller's transaction usable. It refuses
//! what PostgreSQL or Kafka would refuse later, when the relay could only retry and then give
//! up: an empty required field, a NUL character anywhere (PostgreSQL's text and jsonb cannot
//! store one), an aggregate id, event type or business key longer than consumer groups or
//! PostgreSQL's indexes take, a topic name Kafka does not accept, and an event larger than the record size
//! Kafka takes ([`OutboxSettings::max_message_bytes`], 1,000,000 bytes by default, as the relay
//! produces it: key, payload, headers and envelope). [`Outbox`] carries the settings; the free
//! functions use the defaults.
//!
//! Recurring schedules ([`schedule`]): a cron expression in a time zone, each occurrence of which
//! the active relay appends once, as a delayed event due at the occurrence's time.
//!
//! This crate brings no HTTP server or client: sqlx, serde, uuid, chrono (with chrono-tz), cron
//! and thiserror only.

#![deny(missing_docs)]

use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

mod append;
mod check;
mod delay;
pub mod schedule;

pub use check::{
    OutboxSettings, DEFAULT_MAX_MESSAGE_BYTES, MAX_AGGREGATE_ID_BYTES, MAX_BUSINESS_KEY_BYTES,
    MAX_EVENT_TYPE_BYTES,
};
pub use delay::{cancel_delayed, Delayed, PublishAt};

/// The migrations of the outbox's tables (the outbox, the relay's queue, delivery records and
/// lease) and of nothing else: run it on the database your service writes its changes to. It
/// shares sqlx's migration table with other sets of migrations (the consumer library's, your
/// own), so each set leaves the others' versions alone.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
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

impl NewEvent {
    /// The headers as the JSON object the outbox row stores.
    pub(crate) fn headers_json(&self) -> Value {
        Value::Object(
            self.headers
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect(),
        )
    }
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
    /// A field (named: `business_key`, `event_type`, `aggregate_id`, `topic`, `headers` or
    /// `payload`) holds a NUL character (U+0000), which PostgreSQL's text and jsonb cannot
    /// store; nothing was written.
    #[error("event field `{0}` contains a NUL character")]
    NulCharacter(&'static str),
    /// The event type holds a control character (U+0000–U+001F, U+007F–U+009F: an escape
    /// sequence, a line break), which would reach the operator's terminal and every log line
    /// that names it; nothing was written.
    #[error("event field `{0}` contains a control character")]
    ControlCharacter(&'static str),
    /// A field (named: `business_key`, `event_type` or `aggregate_id`) is longer than consumer
    /// groups or PostgreSQL's indexes take ([`MAX_AGGREGATE_ID_BYTES`],
    /// [`MAX_EVENT_TYPE_BYTES`], [`MAX_BUSINESS_KEY_BYTES`]); nothing was written.
    #[error("event field `{field}` is {len} bytes long, more than {limit}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The most it may hold.
        limit: usize,
    },
    /// The topic name is not one Kafka accepts (1 to 249 of `a-z A-Z 0-9 . _ -`, not `.` or
    /// `..`); nothing was written.
    #[error("`{0}` is not a valid Kafka topic name")]
    InvalidTopic(String),
    /// The event, as the relay would produce it ([`NewEvent::message_size`]), is larger than
    /// [`OutboxSettings::max_message_bytes`]: Kafka would refuse it, so nothing was written.
    #[error("event of {size} bytes exceeds the {limit}-byte message limit")]
    TooLarge {
        /// The event's size as produced (key, payload, headers, envelope and framing).
        size: usize,
        /// [`OutboxSettings::max_message_bytes`].
        limit: usize,
    },
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

/// The outbox with its [`OutboxSettings`]: every way of appending events, each checking the
/// events against the settings before it writes anything. The free functions ([`enqueue`],
/// [`enqueue_all`], …) are these with [`OutboxSettings::default`].
///
/// ```
/// use outbox::{Outbox, OutboxSettings};
///
/// // Topics of this service take records of up to 4 MB (the topic's max.message.bytes and the
/// // relay producer's message.max.bytes are raised to match).
/// let outbox = Outbox::new(OutboxSettings { max_message_bytes: 4_000_000 });
/// assert_eq!(outbox.settings().max_message_bytes, 4_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Outbox {
    settings: OutboxSettings,
}

impl Outbox {
    /// An outbox with `settings`.
    pub fn new(settings: OutboxSettings) -> Self {
        Outbox { settings }
    }

    /// Its settings.
    pub fn settings(&self) -> &OutboxSettings {
        &self.settings
    }

    /// Checks `event` as every entry point does before writing: the same error, without a
    /// transaction (e.g. to answer a request with its own error before starting one).
    pub fn check(&self, event: &NewEvent) -> Result<(), EnqueueError> {
        self.settings.check(event)
    }

    /// Appends `event` to the outbox inside `tx`.
    ///
    /// The next sequence number of the aggregate is taken under a row lock held until `tx`
    /// ends, so events of one aggregate commit in sequence order and a later one can never
    /// become visible before an earlier one. The caller commits.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        event: &NewEvent,
    ) -> Result<Enqueued, EnqueueError> {
        append::enqueue_one(tx, event, &self.settings).await
    }

    /// Appends all `events` inside `tx` in one round trip: each aggregate's events take its
    /// next sequence numbers in the order given, under the same row lock as
    /// [`Outbox::enqueue`]. Returns each event's id and sequence number, in the order given.
    ///
    /// Unlike [`Outbox::enqueue`], an event whose (business key, event type) is already recorded
    /// is an error, [`EnqueueError::AlreadyRecorded`], and the statement fails inside
    /// PostgreSQL: the transaction is aborted and can only be rolled back, so no sequence number
    /// is ever skipped. An event refused by the checks refuses them all, before any statement.
    pub async fn enqueue_all(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[NewEvent],
    ) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
        append::append(tx, events, None, &self.settings).await
    }

    /// [`Outbox::enqueue_all`], and in the same statement (one round trip for all three)
    /// appends the `delayed` events as [`Outbox::enqueue_all_at`] would (a duplicate fact is
    /// skipped) and withdraws the delayed events of the `withdraw` (business key, event type)
    /// pairs as [`cancel_delayed`] would: e.g. an order service that records an order's
    /// change, delays its reminder and withdraws another's in one go. Returns the immediate
    /// events' ids and sequence numbers, in the order given. The immediate and the delayed
    /// events are all checked before any statement runs.
    pub async fn enqueue_all_and_delay(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[NewEvent],
        delayed: &[(NewEvent, PublishAt)],
        withdraw: &[(&str, &str)],
    ) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
        if events.is_empty() {
            // Nothing to sequence: the plain statements do the rest.
            let _ = self.enqueue_all_at(tx, delayed).await?;
            let _ = cancel_delayed(tx, withdraw).await?;
            return Ok(Vec::new());
        }
        if delayed.is_empty() && withdraw.is_empty() {
            // Nothing delayed or withdrawn: enqueue_all's own statement, without the two steps.
            return self.enqueue_all(tx, events).await;
        }
        append::append(tx, events, Some((delayed, withdraw)), &self.settings).await
    }

    /// Appends `event` inside `tx` to be published when `when` comes, not before.
    ///
    /// Guarantees as for [`Outbox::enqueue`]: the event exists if and only if `tx` commits, a
    /// (business key, event type) pair is recorded once (already waiting or already in the
    /// outbox: [`Delayed::Duplicate`]), and once due it is published at least once and applied
    /// once per consumer group. Its place in its aggregate's sequence is taken when it becomes
    /// due, so it never holds the aggregate's other events: those committed before it is due are
    /// published before it, those committed after, after it.
    pub async fn enqueue_at(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        event: &NewEvent,
        when: PublishAt,
    ) -> Result<Delayed, EnqueueError> {
        let outcomes = self.enqueue_all_at(tx, &[(event.clone(), when)]).await?;
        outcomes
            .into_iter()
            .next()
            .ok_or(EnqueueError::Database(sqlx::Error::RowNotFound))
    }

    /// [`Outbox::enqueue_at`] for several events in one round trip (one more when some are
    /// duplicates). Returns each event's outcome, in the order given.
    pub async fn enqueue_all_at(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[(NewEvent, PublishAt)],
    ) -> Result<Vec<Delayed>, EnqueueError> {
        delay::delay_all(tx, events, &self.settings).await
    }
}

/// [`Outbox::enqueue`] with the default settings.
pub async fn enqueue(
    tx: &mut Transaction<'_, Postgres>,
    event: &NewEvent,
) -> Result<Enqueued, EnqueueError> {
    Outbox::default().enqueue(tx, event).await
}

/// [`Outbox::enqueue_all`] with the default settings.
pub async fn enqueue_all(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    Outbox::default().enqueue_all(tx, events).await
}

/// [`Outbox::enqueue_all_and_delay`] with the default settings.
pub async fn enqueue_all_and_delay(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
    delayed: &[(NewEvent, PublishAt)],
    withdraw: &[(&str, &str)],
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    Outbox::default()
        .enqueue_all_and_delay(tx, events, delayed, withdraw)
        .await
}

/// [`Outbox::enqueue_at`] with the default settings.
pub async fn enqueue_at(
    tx: &mut Transaction<'_, Postgres>,
    event: &NewEvent,
    when: PublishAt,
) -> Result<Delayed, EnqueueError> {
    Outbox::default().enqueue_at(tx, event, when).await
}

/// [`Outbox::enqueue_all_at`] with the default settings.
pub async fn enqueue_all_at(
    tx: &mut Transaction<'_, Postgres>,
    events: &[(NewEvent, PublishAt)],
) -> Result<Vec<Delayed>, EnqueueError> {
    Outbox::default().enqueue_all_at(tx, events).await
}

/// Asks a listening relay to look for new events as soon as `tx` commits, whether or not it
/// says it waits.
///
/// Not needed for events: the outbox's insert trigger notifies by itself while the relay waits,
/// and not while it is busy. For changes no insert announces (a requeued event, a delayed
/// event's time moved closer). PostgreSQL folds identical notifications of one transaction into
/// one, but every notifying transaction takes a database-wide lock at commit.
pub async fn notify_relay(tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(OUTBOX_CHANNEL)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
