//! Events of an aggregate are applied strictly in sequence: the next one is applied, one that is
//! ahead of its predecessor is parked and unparked, in order, when the gap closes, and one whose
//! sequence was already applied is flagged stale.

use chrono::{DateTime, Utc};
use pipeline_core::envelope::Envelope;
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::dead_letter::{self, DeadLetter};
use super::effects::{apply_one, TransactionState};
use super::error::ProcessError;
use super::message::{read_event, BatchReport, InboundMessage, Outcome, Pending, RecordHeaders};
use super::store::{set_outcomes, AppliedEffect, OutcomeChange};
use crate::handlers::{Event, HandlerTransaction};

/// What becomes of a record a group has not processed yet, given its aggregate's last applied
/// sequence: the decision the batch transaction takes for it (see [`decide`]).
#[derive(Debug, Clone)]
pub enum Decision {
    /// The aggregate's next event: applied now (unless the handler rejects it).
    Apply(Event),
    /// Ahead of its aggregate's next sequence: parked until the gap closes.
    Park(Event),
    /// A sequence the aggregate already applied: flagged stale, not applied.
    Stale(Event),
    /// Not a readable event: dead-lettered with this reason.
    DeadLetter(String),
}

/// The decision for `msg` when its aggregate's last applied sequence is `last` (0: none yet).
pub fn decide(msg: &InboundMessage, last: i64) -> Decision {
    match read_event(msg) {
        Err(reason) => Decision::DeadLetter(reason),
        Ok(event) => match step(event.envelope.sequence, last) {
            Step::Apply => Decision::Apply(event),
            Step::Park => Decision::Park(event),
            Step::Stale => Decision::Stale(event),
        },
    }
}

enum Step {
    Apply,
    Park,
    Stale,
}

fn step(sequence: i64, last: i64) -> Step {
    if sequence == last.saturating_add(1) {
        Step::Apply
    } else if sequence <= last {
        Step::Stale
    } else {
        Step::Park
    }
}

/// Applies, parks or skips one new event according to its aggregate's next expected sequence.
pub(crate) async fn handle_event(
    tx: &mut Transaction<'_, Postgres>,
    effects: &mut dyn HandlerTransaction,
    group: &str,
    state: &mut TransactionState,
    report: &mut BatchReport,
    p: &Pending<'_>,
) -> Result<Outcome, ProcessError> {
    let env = &p.event.envelope;
    let known = state.progress.get(&env.aggregate_id).copied();
    if let (None, Some(horizon)) = (known, state.horizon) {
        if env.occurred_at < horizon {
            return forgotten(tx, group, report, env, horizon).await;
        }
    }
    let last = known.unwrap_or(0);
    if let Step::Apply = step(env.sequence, last) {
        return match apply_one(tx, effects, &p.event).await? {
            Ok(()) => {
                state.effects.push(AppliedEffect::of(&p.event));
                let mut last = env.sequence;
                if state.parked_aggregates.contains(&env.aggregate_id) {
                    last =
                        unpark(tx, effects, group, &env.aggregate_id, last, state, report).await?;
                }
                let _ = state.progress.insert(env.aggregate_id.clone(), last);
                let _ = state.advanced.insert(env.aggregate_id.clone(), last);
                tracing::debug!("event applied");
                Ok(Outcome::Applied)
            }
            Err(reason) => {
                let letter = DeadLetter::now(p.msg, Some(&p.event), &reason);
                dead_letter::record(tx, group, &letter).await?;
                state.letters.push(letter);
                set_outcomes(
                    tx,
                    group,
                    &[OutcomeChange::untracked(env.event_id, "dead_lettered")],
                )
                .await?;
                Ok(Outcome::DeadLettered)
            }
        };
    }
    report.out_of_sequence += 1;
    if let Step::Stale = step(env.sequence, last) {
        // The dedupe rows did not know the event: a redelivery whose row retention removed, or
        // another event with a sequence the aggregate already passed. Neither is applied.
        tracing::warn!(
            last_applied = last,
            "event sequence already applied (a redelivery past the dedupe window, or another \
             event with that sequence); not applied"
        );
        let detail = format!(
            "aggregate already at sequence {last}: a redelivery past the dedupe window, or another \
             event with this sequence; not applied"
        );
        return stale(tx, group, env, detail).await;
    }
    tracing::warn!(
        expected = last + 1,
        "event ahead of its aggregate's next sequence; parked until the gap closes"
    );
    park(
        tx,
        group,
        p.msg,
        &p.event,
        &format!("waiting for sequence {}", last + 1),
    )
    .await?;
    let _ = state.parked_aggregates.insert(env.aggregate_id.clone());
    set_outcomes(
        tx,
        group,
        &[OutcomeChange::untracked(env.event_id, "parked")],
    )
    .await?;
    Ok(Outcome::Parked)
}

/// An event of an aggregate the group keeps no progress for, which occurred before the group's
/// progress horizon: its aggregate's progress may have been removed by retention, so it may have
/// been applied already. It is flagged stale, never applied again.
async fn forgotten(
    tx: &mut Transaction<'_, Postgres>,
    group: &str,
    report: &mut BatchReport,
    env: &Envelope,
    horizon: DateTime<Utc>,
) -> Result<Outcome, ProcessError> {
    report.out_of_sequence += 1;
    tracing::warn!(
        %horizon,
        occurred_at = %env.occurred_at,
        "event of an aggregate whose progress retention removed; flagged stale, not applied"
    );
    let detail = format!(
        "no progress kept for this aggregate, and the event occurred before the group's progress \
         horizon ({horizon}): a redelivery of an aggregate retention forgot; not applied"
    );
    stale(tx, group, env, detail).await
}

/// Records a `stale` step of the event's history, saying why: it is not applied.
async fn stale(
    tx: &mut Transaction<'_, Postgres>,
    group: &str,
    env: &Envelope,
    detail: String,
) -> Result<Outcome, ProcessError> {
    set_outcomes(tx, group, &[OutcomeChange::tracked(env, "stale", detail)]).await?;
    Ok(Outcome::Stale)
}

/// Applies parked events of `aggregate` that now follow `last` without a gap. Returns the new last.
pub(crate) async fn unpark(
    tx: &mut Transaction<'_, Postgres>,
    effects: &mut dyn HandlerTransaction,
    group: &str,
    order: &str,
    mut last: i64,
    state: &mut TransactionState,
    report: &mut BatchReport,
) -> Result<i64, ProcessError> {
    loop {
        let row: Option<ParkedRow> = sqlx::query_as(
            "WITH parked AS (
                 DELETE FROM parked_event WHERE group_name = $1 AND aggregate_id = $2 AND sequence = $3
                 RETURNING event_id, event_type, payload, occurred_at, topic, partition, kafka_offset),
             record AS (
                 DELETE FROM parked_record WHERE group_name = $1 AND aggregate_id = $2 AND sequence = $3
                 RETURNING payload AS record_payload, header_names, header_values)
             SELECT parked.*, record.* FROM parked LEFT JOIN record ON true",
        )
        .bind(group)
        .bind(order)
        .bind(last + 1)
        .fetch_optional(&mut **tx)
        .await?;
        let Some(row) = row else { return Ok(last) };
        let event = Event {
            envelope: Envelope {
                event_id: row.event_id,
                event_type: row.event_type.clone(),
                aggregate_id: order.to_owned(),
                sequence: last + 1,
                occurred_at: row.occurred_at.unwrap_or_else(Utc::now),
                traceparent: None,
            },
            payload: row.payload.clone(),
        };
        match apply_one(tx, effects, &event).await? {
            Ok(()) => {
                state.effects.push(AppliedEffect::of(&event));
                set_outcomes(tx, group, &[OutcomeChange::unparked(&event.envelope)]).await?;
                report.unparked += 1;
                last += 1;
                tracing::info!(group, event_id = %row.event_id, aggregate_id = order, sequence = last, "parked event unparked and applied");
            }
            Err(reason) => {
                // The record as it arrived (rebuilt from the columns for a row without its bytes).
                let headers = match (&row.header_names, &row.header_values) {
                    (Some(names), Some(values)) => RecordHeaders::from_columns(names, values),
                    _ => RecordHeaders::default(),
                };
                let msg = InboundMessage {
                    topic: row.topic,
                    partition: row.partition,
                    offset: row.kafka_offset,
                    key: Some(order.as_bytes().to_vec()),
                    payload: row
                        .record_payload
                        .or_else(|| serde_json::to_vec(&row.payload).ok()),
                    headers,
                    envelope: Ok(event.envelope.clone()),
                };
                let letter = DeadLetter::now(&msg, Some(&event), &reason);
                dead_letter::record(tx, group, &letter).await?;
                state.letters.push(letter);
                set_outcomes(
                    tx,
                    group,
                    &[OutcomeChange::untracked(row.event_id, "dead_lettered")],
                )
                .await?;
                return Ok(last);
            }
        }
    }
}

#[derive(sqlx::FromRow)]
struct ParkedRow {
    event_id: Uuid,
    event_type: String,
    payload: serde_json::Value,
    occurred_at: Option<DateTime<Utc>>,
    topic: String,
    partition: i32,
    kafka_offset: i64,
    record_payload: Option<Vec<u8>>,
    header_names: Option<Vec<Vec<u8>>>,
    header_values: Option<Vec<Option<Vec<u8>>>>,
}

pub(crate) async fn park(
    tx: &mut PgConnection,
    group: &str,
    msg: &InboundMessage,
    event: &Event,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let env = &event.envelope;
    let (header_names, header_values) = msg.headers.to_columns();
    // The parked event and its place in the event's history, in one statement.
    sqlx::query(
        "WITH parked AS (
             INSERT INTO parked_event (group_name, aggregate_id, sequence, event_id, event_type,
                                       payload, occurred_at, topic, partition, kafka_offset, reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
             ON CONFLICT (group_name, aggregate_id, sequence) DO NOTHING
             RETURNING group_name, event_id, aggregate_id, sequence, event_type, topic, partition,
                       kafka_offset, reason),
         record AS (
             INSERT INTO parked_record (group_name, aggregate_id, sequence, payload, header_names,
                                        header_values)
             SELECT group_name, aggregate_id, sequence, $12, $13, $14 FROM parked)
         INSERT INTO group_transition (group_name, event_id, aggregate_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT group_name, event_id, aggregate_id, sequence, event_type, 'parked', reason, topic,
                partition, kafka_offset
         FROM parked",
    )
    .bind(group)
    .bind(&env.aggregate_id)
    .bind(env.sequence)
    .bind(env.event_id)
    .bind(&env.event_type)
    .bind(&event.payload)
    .bind(env.occurred_at)
    .bind(&msg.topic)
    .bind(msg.partition)
    .bind(msg.offset)
    .bind(reason)
    .bind(&msg.payload)
    .bind(header_names)
    .bind(header_values)
    .execute(tx)
    .await?;
    Ok(())
}
