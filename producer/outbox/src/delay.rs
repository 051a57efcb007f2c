//! Delayed events: appended in the caller's transaction with an earliest publish
//! time, kept in `outbox_delayed` until they are due, then moved into the outbox by the active
//! relay (`relay run`), where they take their aggregate's next sequence number and are published
//! like any other event.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::{EnqueueError, NewEvent, OutboxSettings};

/// When the relay may publish a delayed event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishAt {
    /// Not before this time. A time already past makes the event due at once: it is published
    /// as soon as a relay is active (a relay that was down publishes what fell due meanwhile).
    At(DateTime<Utc>),
    /// Not before this long after the start of the caller's transaction, by the database's
    /// clock (the clock the relay compares with).
    After(Duration),
}

impl PublishAt {
    /// `(absolute time, delay in microseconds)`: one of them is used, the other is `None`.
    pub(crate) fn split(self) -> Result<(Option<DateTime<Utc>>, Option<i64>), EnqueueError> {
        match self {
            PublishAt::At(at) => Ok((Some(at), None)),
            PublishAt::After(delay) => {
                let micros = i64::try_from(delay.as_micros())
                    .ok()
                    // PostgreSQL intervals hold about 178 million years; stay far below.
                    .filter(|m| *m <= 100 * 365 * 24 * 3_600 * 1_000_000)
                    .ok_or(EnqueueError::DelayTooLong(delay))?;
                Ok((None, Some(micros)))
            }
        }
    }
}

/// What [`crate::enqueue_at`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delayed {
    /// The event waits for `publish_at`; it has no sequence number until it is due.
    New {
        /// The event's id (the `event-id` header it will be published with).
        event_id: Uuid,
        /// Its earliest publish time, by the database's clock.
        publish_at: DateTime<Utc>,
    },
    /// The same (business key, event type) is already waiting or already in the outbox:
    /// nothing was written.
    Duplicate {
        /// The id of the event recorded before.
        event_id: Uuid,
    },
}

impl Delayed {
    /// Id of the event, whether delayed now or found already recorded.
    pub fn event_id(self) -> Uuid {
        match self {
            Delayed::New { event_id, .. } | Delayed::Duplicate { event_id } => event_id,
        }
    }
}

/// [`crate::Outbox::enqueue_all_at`]: every event is checked before the one statement runs.
pub(crate) async fn delay_all(
    tx: &mut Transaction<'_, Postgres>,
    events: &[(NewEvent, PublishAt)],
    settings: &OutboxSettings,
) -> Result<Vec<Delayed>, EnqueueError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let columns = DelayedColumns::of(events, settings)?;
    let ids = columns.ids.clone();
    // A fact already in the outbox (published at once) is not delayed again; one already
    // waiting is left to the unique constraint.
    let inserted: Vec<(Uuid, DateTime<Utc>)> = columns
        .bind_to(sqlx::query_as(
            "INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
                                           payload, headers, publish_at)
             SELECT i.event_id, i.business_key, i.event_type, i.aggregate_id, i.topic, i.payload,
                    i.headers, COALESCE(i.at, now() + i.delay_us * interval '1 microsecond')
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                         $6::jsonb[], $7::jsonb[], $8::timestamptz[], $9::bigint[])
                  AS i(event_id, business_key, event_type, aggregate_id, topic, payload, headers,
                       at, delay_us)
             WHERE NOT EXISTS (SELECT 1 FROM outbox o
                               WHERE o.business_key = i.business_key
                                 AND o.event_type = i.event_type)
             ON CONFLICT (business_key, event_type) DO NOTHING
             RETURNING event_id, publish_at",
        ))
        .fetch_all(&mut **tx)
        .await?;
    let mut outcomes = Vec::with_capacity(events.len());
    for (id, (event, _)) in ids.iter().zip(events) {
        match inserted.iter().find(|(e, _)| e == id) {
            Some(&(event_id, publish_at)) => outcomes.push(Delayed::New {
                event_id,
                publish_at,
            }),
            None => outcomes.push(Delayed::Duplicate {
                event_id: recorded_event_id(tx, event).await?,
            }),
        }
    }
    Ok(outcomes)
}

/// The columns of delayed events, as the statements that append them bind them.
pub(crate) struct DelayedColumns<'a> {
    ids: Vec<Uuid>,
    business_keys: Vec<&'a str>,
    event_types: Vec<&'a str>,
    aggregate_ids: Vec<&'a str>,
    topics: Vec<&'a str>,
    payloads: Vec<&'a serde_json::Value>,
    headers: Vec<serde_json::Value>,
    ats: Vec<Option<DateTime<Utc>>>,
    delays: Vec<Option<i64>>,
}

impl<'a> DelayedColumns<'a> {
    /// Checks `events` and lays them out as columns, each with a new event id.
    pub(crate) fn of(
        events: &'a [(NewEvent, PublishAt)],
        settings: &OutboxSettings,
    ) -> Result<Self, EnqueueError> {
        let mut columns = DelayedColumns {
            ids: Vec::with_capacity(events.len()),
            business_keys: Vec::with_capacity(events.len()),
            event_types: Vec::with_capacity(events.len()),
            aggregate_ids: Vec::with_capacity(events.len()),
            topics: Vec::with_capacity(events.len()),
            payloads: Vec::with_capacity(events.len()),
            headers: Vec::with_capacity(events.len()),
            ats: Vec::with_capacity(events.len()),
            delays: Vec::with_capacity(events.len()),
        };
        for (event, when) in events {
            settings.check(event)?;
            let (at, delay) = when.split()?;
            columns.ids.push(Uuid::now_v7());
            columns.business_keys.push(&event.business_key);
            columns.event_types.push(&event.event_type);
            columns.aggregate_ids.push(&event.aggregate_id);
            columns.topics.push(&event.topic);
            columns.payloads.push(&event.payload);
            columns.headers.push(event.headers_json());
            columns.ats.push(at);
            columns.delays.push(delay);
        }
        Ok(columns)
    }

    /// Binds the nine columns, in order, as the next parameters of `query`.
    pub(crate) fn bind_to<'q, O>(
        self,
        query: sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        query
            .bind(self.ids)
            .bind(self.business_keys)
            .bind(self.event_types)
            .bind(self.aggregate_ids)
            .bind(self.topics)
            .bind(self.payloads)
            .bind(self.headers)
            .bind(self.ats)
            .bind(self.delays)
    }
}

/// The id of the event already recorded for `event`'s (business key, event type), waiting or
/// in the outbox.
async fn recorded_event_id(
    tx: &mut Transaction<'_, Postgres>,
    event: &NewEvent,
) -> Result<Uuid, EnqueueError> {
    let id: Option<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM outbox_delayed WHERE business_key = $1 AND event_type = $2
         UNION ALL
         SELECT event_id FROM outbox WHERE business_key = $1 AND event_type = $2
         LIMIT 1",
    )
    .bind(&event.business_key)
    .bind(&event.event_type)
    .fetch_optional(&mut **tx)
    .await?;
    id.ok_or(EnqueueError::Database(sqlx::Error::RowNotFound))
}

/// Withdraws the delayed events with these (business key, event type) pairs that are not due
/// yet, or due but not yet moved into the outbox, inside `tx`: e.g. a payment reminder once the
/// order is paid. Returns how many were withdrawn; an event already moved into the outbox is
/// published whatever happens here. Taking the delayed row's lock, this waits for a relay
/// moving it at the same moment, so either the event is withdrawn or it was already released.
pub async fn cancel_delayed(
    tx: &mut Transaction<'_, Postgres>,
    facts: &[(&str, &str)],
) -> Result<u64, sqlx::Error> {
    let (keys, types) = withdrawn_facts(facts);
    if keys.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(
        "DELETE FROM outbox_delayed s
         USING unnest($1::text[], $2::text[]) AS f(business_key, event_type)
         WHERE s.business_key = f.business_key AND s.event_type = f.event_type",
    )
    .bind(&keys)
    .bind(&types)
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected())
}

/// The business keys and event types of `facts`, as two columns. A pair with a NUL character is
/// left out: no recorded event can have one, and PostgreSQL would refuse the statement.
pub(crate) fn withdrawn_facts<'a>(facts: &[(&'a str, &'a str)]) -> (Vec<&'a str>, Vec<&'a str>) {
    facts
        .iter()
        .copied()
        .filter(|(key, event_type)| !key.contains('\0') && !event_type.contains('\0'))
        .unzip()
}
