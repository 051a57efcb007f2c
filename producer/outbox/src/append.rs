//! Appending events to the outbox: each aggregate's next sequence numbers taken under its row
//! lock and the events inserted with them, in one statement.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::delay::{withdrawn_facts, DelayedColumns};
use crate::{EnqueueError, Enqueued, NewEvent, OutboxSettings, PublishAt};

/// [`crate::Outbox::enqueue`]: one event, one round trip (two when it is a duplicate).
pub(crate) async fn enqueue_one(
    tx: &mut Transaction<'_, Postgres>,
    event: &NewEvent,
    settings: &OutboxSettings,
) -> Result<Enqueued, EnqueueError> {
    settings.check(event)?;
    let headers = event.headers_json();
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

/// The statement of [`crate::Outbox::enqueue_all`]: its common table expressions up to the
/// sequence numbers…
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
/// `enqueue_all_at`'s statement), `$17`/`$18` the facts whose delayed events are withdrawn.
const ENQUEUE_ALL_AND_DELAY_SQL: &str = concat!(
    sequenced_ctes!(),
    ",
         later AS (",
    "
             INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
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
             DELETE FROM outbox_delayed s
             USING unnest($17::text[], $18::text[]) AS w(business_key, event_type)
             WHERE s.business_key = w.business_key AND s.event_type = w.event_type
             RETURNING 1)",
    sequenced_insert!()
);

/// Delayed events to append and (business key, event type) pairs to withdraw, with the events
/// of [`append`].
pub(crate) type DelayChanges<'a> = (&'a [(NewEvent, PublishAt)], &'a [(&'a str, &'a str)]);

/// [`crate::Outbox::enqueue_all`], and with `delay` [`crate::Outbox::enqueue_all_and_delay`]:
/// every event is checked before the one statement runs.
pub(crate) async fn append(
    tx: &mut Transaction<'_, Postgres>,
    events: &[NewEvent],
    delay: Option<DelayChanges<'_>>,
    settings: &OutboxSettings,
) -> Result<Vec<(Uuid, i64)>, EnqueueError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    for event in events {
        settings.check(event)?;
    }
    let ids: Vec<Uuid> = events.iter().map(|_| Uuid::now_v7()).collect();
    let field = |f: fn(&NewEvent) -> &str| events.iter().map(f).collect::<Vec<&str>>();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
    let headers: Vec<Value> = events.iter().map(NewEvent::headers_json).collect();
    // Aggregates' sequence rows are taken in key order, so concurrent callers cannot deadlock on
    // them; each aggregate advances by its number of events at once.
    let query = sqlx::query_as::<_, (Uuid, i64)>(match delay {
        None => ENQUEUE_ALL_SQL,
        Some(_) => ENQUEUE_ALL_AND_DELAY_SQL,
    })
    .bind(&ids)
    .bind(field(|e| &e.business_key))
    .bind(field(|e| &e.event_type))
    .bind(field(|e| &e.aggregate_id))
    .bind(field(|e| &e.topic))
    .bind(&payloads)
    .bind(&headers);
    let rows = match delay {
        None => query.fetch_all(&mut **tx).await,
        Some((delayed, withdraw)) => {
            let later = DelayedColumns::of(delayed, settings)?;
            let (keys, types) = withdrawn_facts(withdraw);
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
