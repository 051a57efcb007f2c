//! Applying a batch of one partition's messages in one database transaction.
//!
//! For every message the transaction inserts the group's `processed_message` row (the dedupe
//! constraint) and, only when that row is new, applies the handler's effects. Events of an order
//! are applied strictly in sequence: one that arrives ahead of its predecessor is parked and
//! released, in order, when the gap closes. The caller commits the Kafka offset only after this
//! transaction has committed.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use pipeline_core::envelope::{Envelope, EnvelopeError};
use sqlx::{Acquire, PgConnection, PgPool, Postgres, Transaction};
use tracing::Instrument;
use uuid::Uuid;

use crate::dead_letter::{self, DeadLetter, DeadLetterSink};
use crate::handler::{Event, Handler, HandlerError};
use crate::process_error::is_rejection;
pub use crate::process_error::ProcessError;

/// A record as read from Kafka, owned so it can cross to the partition's task.
#[derive(Debug, Clone)]
pub struct InboundMessage {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// All headers as a JSON object (values decoded lossily), kept for dead letters.
    pub headers: serde_json::Value,
    pub envelope: Result<Envelope, EnvelopeError>,
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

struct Pending<'m> {
    msg: &'m InboundMessage,
    event: Event,
}

/// The partition a batch belongs to and the token this consumer owns it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub topic: String,
    pub partition: i32,
    pub owner: Uuid,
}

/// What a batch runs with.
pub struct BatchContext<'a> {
    pub pool: &'a PgPool,
    pub handler: &'a dyn Handler,
    /// When set, the batch applies nothing unless this consumer still owns the partition.
    pub fence: Option<&'a Fence>,
    /// When set, dead letters are also published to the dead-letter topic before commit.
    pub dead_letters: Option<&'a DeadLetterSink>,
}

/// Processes `messages` (one partition, in offset order) in one transaction and commits it,
/// without fencing or a dead-letter topic.
pub async fn process_batch(
    pool: &PgPool,
    handler: &dyn Handler,
    messages: &[InboundMessage],
) -> Result<BatchReport, ProcessError> {
    let ctx = BatchContext {
        pool,
        handler,
        fence: None,
        dead_letters: None,
    };
    process_batch_with(&ctx, messages).await
}

/// Processes `messages` (one partition, in offset order) in one transaction and commits it.
pub async fn process_batch_with(
    ctx: &BatchContext<'_>,
    messages: &[InboundMessage],
) -> Result<BatchReport, ProcessError> {
    let handler = ctx.handler;
    let group = handler.group();
    let began = std::time::Instant::now();
    let mut tx = ctx.pool.begin().await?;
    if let Some(fence) = ctx.fence {
        check_owner(&mut tx, group, fence).await?;
    }
    let mut letters: Vec<DeadLetter> = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; messages.len()];
    let mut report = BatchReport::default();

    // Sort out records that are not readable events; keep the first copy of each event id.
    let mut valid: Vec<(usize, Pending<'_>)> = Vec::new();
    let mut seen: HashSet<Uuid> = HashSet::new();
    for (i, msg) in messages.iter().enumerate() {
        match read_event(msg) {
            Ok(event) => {
                if seen.insert(event.envelope.event_id) {
                    valid.push((i, Pending { msg, event }));
                } else {
                    outcomes[i] = Some(Outcome::Duplicate);
                }
            }
            Err(reason) => {
                let letter = DeadLetter::now(msg, None, &reason);
                dead_letter::record(&mut tx, group, &letter).await?;
                letters.push(letter);
                outcomes[i] = Some(Outcome::DeadLettered);
            }
        }
    }

    // The dedupe constraint: only rows inserted now are new to this group.
    let new_ids = insert_processed(&mut tx, group, &valid).await?;
    let mut fresh: Vec<(usize, Pending<'_>)> = Vec::with_capacity(new_ids.len());
    for (i, p) in valid {
        if new_ids.contains(&p.event.envelope.event_id) {
            fresh.push((i, p));
        } else {
            outcomes[i] = Some(Outcome::Duplicate);
        }
    }

    let events: Vec<Event> = fresh.iter().map(|(_, p)| p.event.clone()).collect();
    handler.prepare(&mut tx, &events).await?;
    let orders: Vec<String> = {
        let mut o: Vec<String> = events
            .iter()
            .map(|e| e.envelope.aggregate_id.clone())
            .collect();
        o.sort();
        o.dedup();
        o
    };
    let mut state = BatchState {
        progress: load_progress(&mut tx, group, &orders).await?,
        advanced: HashMap::new(),
        parked_orders: orders_with_parked(&mut tx, group, &orders).await?,
        effects: Vec::new(),
        letters,
    };
    for (i, p) in &fresh {
        let env = &p.event.envelope;
        // Every log line of this event's handling carries its ids and the caller's trace context.
        let span = tracing::info_span!(
            "event",
            group,
            event_id = %env.event_id,
            order_id = %env.aggregate_id,
            sequence = env.sequence,
            event_type = %env.event_type,
            traceparent = env.traceparent.as_deref().unwrap_or(""),
        );
        let outcome = handle_event(&mut tx, handler, &mut state, &mut report, p)
            .instrument(span)
            .await?;
        outcomes[*i] = Some(outcome);
    }
    let BatchState {
        advanced,
        effects,
        letters,
        ..
    } = state;

    record_effects(&mut tx, group, &effects).await?;
    save_progress(&mut tx, group, &advanced).await?;
    if let (Some(sink), false) = (ctx.dead_letters, letters.is_empty()) {
        sink.publish(group, &letters).await?;
    }
    tx.commit().await?;
    report.transaction_duration = began.elapsed();

    report.applied_occurred_at = effects.iter().map(|e| e.occurred_at).collect();
    report.outcomes = outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::Duplicate))
        .collect();
    Ok(report)
}

/// What a batch has learned so far about the orders it touches.
#[derive(Default)]
pub(crate) struct BatchState {
    /// Last applied sequence per order, as read at the start and advanced since.
    pub(crate) progress: HashMap<String, i64>,
    /// Orders whose last applied sequence this batch moved, with the new value.
    pub(crate) advanced: HashMap<String, i64>,
    /// Orders with parked events.
    pub(crate) parked_orders: HashSet<String>,
    pub(crate) effects: Vec<AppliedEffect>,
    /// Dead letters recorded so far, to publish before commit.
    pub(crate) letters: Vec<DeadLetter>,
}

/// Applies, parks or skips one new event according to its order's next expected sequence.
async fn handle_event(
    tx: &mut Transaction<'_, Postgres>,
    handler: &dyn Handler,
    state: &mut BatchState,
    report: &mut BatchReport,
    p: &Pending<'_>,
) -> Result<Outcome, ProcessError> {
    let group = handler.group();
    let env = &p.event.envelope;
    let last = state.progress.get(&env.aggregate_id).copied().unwrap_or(0);
    if env.sequence == last + 1 {
        return match apply_one(tx, handler, &p.event).await? {
            Ok(()) => {
                state.effects.push(AppliedEffect::of(&p.event));
                let mut last = env.sequence;
                if state.parked_orders.contains(&env.aggregate_id) {
                    last =
                        release_parked(tx, handler, &env.aggregate_id, last, state, report).await?;
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
                set_outcomes(tx, group, &[(env.event_id, "dead_lettered")]).await?;
                Ok(Outcome::DeadLettered)
            }
        };
    }
    report.out_of_sequence += 1;
    if env.sequence <= last {
        tracing::warn!(
            last_applied = last,
            "event sequence already applied under another event id; not applied"
        );
        set_outcomes(tx, group, &[(env.event_id, "stale")]).await?;
        return Ok(Outcome::Stale);
    }
    tracing::warn!(
        expected = last + 1,
        "event ahead of its order's next sequence; parked until the gap closes"
    );
    park(
        tx,
        group,
        p.msg,
        &p.event,
        &format!("waiting for sequence {}", last + 1),
    )
    .await?;
    let _ = state.parked_orders.insert(env.aggregate_id.clone());
    set_outcomes(tx, group, &[(env.event_id, "parked")]).await?;
    Ok(Outcome::Parked)
}

/// Dead-letters one message on its own, when it kept failing past the retry budget: records it
/// processed (outcome `dead_lettered`) and in `dead_letter`, publishes it, and commits. A message
/// this group already processed is left alone.
pub async fn dead_letter_alone(
    ctx: &BatchContext<'_>,
    msg: &InboundMessage,
    reason: &str,
    attempts: i32,
    first_failure_at: DateTime<Utc>,
) -> Result<Outcome, ProcessError> {
    let group = ctx.handler.group();
    let mut tx = ctx.pool.begin().await?;
    if let Some(fence) = ctx.fence {
        check_owner(&mut tx, group, fence).await?;
    }
    let event = read_event(msg).ok();
    if let Some(event) = &event {
        let inserted = sqlx::query(
            "INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset, outcome)
             VALUES ($1, $2, $3, $4, $5, 'dead_lettered') ON CONFLICT (group_name, event_id) DO NOTHING",
        )
        .bind(group)
        .bind(event.envelope.event_id)
        .bind(&msg.topic)
        .bind(msg.partition)
        .bind(msg.offset)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            tx.commit().await?;
            return Ok(Outcome::Duplicate);
        }
    }
    let letter = DeadLetter {
        message: msg.clone(),
        event,
        reason: reason.to_owned(),
        attempts,
        first_failure_at,
        last_failure_at: Utc::now(),
    };
    dead_letter::record(&mut tx, group, &letter).await?;
    if let Some(sink) = ctx.dead_letters {
        sink.publish(group, std::slice::from_ref(&letter)).await?;
    }
    tx.commit().await?;
    Ok(Outcome::DeadLettered)
}

fn read_event(msg: &InboundMessage) -> Result<Event, String> {
    let envelope = msg.envelope.clone().map_err(|e| e.to_string())?;
    let payload = msg.payload.as_deref().ok_or("record has no payload")?;
    let payload: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    Ok(Event { envelope, payload })
}

/// Applies one event inside a savepoint, so a rejected event leaves no partial effect.
pub(crate) async fn apply_one(
    tx: &mut Transaction<'_, Postgres>,
    handler: &dyn Handler,
    event: &Event,
) -> Result<Result<(), String>, ProcessError> {
    let mut savepoint = tx.begin().await?;
    match handler.apply(&mut savepoint, event).await {
        Ok(()) => {
            savepoint.commit().await?;
            Ok(Ok(()))
        }
        Err(HandlerError::Rejected(reason)) => {
            savepoint.rollback().await?;
            Ok(Err(reason))
        }
        Err(HandlerError::Database(e)) if is_rejection(&e) => {
            savepoint.rollback().await?;
            Ok(Err(format!("rejected by the database: {e}")))
        }
        Err(HandlerError::Database(e)) => Err(e.into()),
    }
}

async fn check_owner(
    tx: &mut PgConnection,
    group: &str,
    fence: &Fence,
) -> Result<(), ProcessError> {
    let owned: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM partition_owner
         WHERE group_name = $1 AND topic = $2 AND partition = $3 AND owner = $4 FOR SHARE",
    )
    .bind(group)
    .bind(&fence.topic)
    .bind(fence.partition)
    .bind(fence.owner)
    .fetch_optional(tx)
    .await?;
    owned.map(|_| ()).ok_or(ProcessError::Fenced)
}

/// Makes `owner` the owner of a partition for `group`; waits for the previous owner's in-flight
/// batch, which holds a share lock on the row.
pub async fn claim_partition(pool: &PgPool, group: &str, fence: &Fence) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO partition_owner (group_name, topic, partition, owner) VALUES ($1, $2, $3, $4)
         ON CONFLICT (group_name, topic, partition)
         DO UPDATE SET owner = EXCLUDED.owner, assigned_at = clock_timestamp()",
    )
    .bind(group)
    .bind(&fence.topic)
    .bind(fence.partition)
    .bind(fence.owner)
    .execute(pool)
    .await?;
    Ok(())
}

async fn insert_processed(
    tx: &mut PgConnection,
    group: &str,
    valid: &[(usize, Pending<'_>)],
) -> Result<HashSet<Uuid>, sqlx::Error> {
    if valid.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<Uuid> = valid
        .iter()
        .map(|(_, p)| p.event.envelope.event_id)
        .collect();
    let topics: Vec<&str> = valid.iter().map(|(_, p)| p.msg.topic.as_str()).collect();
    let partitions: Vec<i32> = valid.iter().map(|(_, p)| p.msg.partition).collect();
    let offsets: Vec<i64> = valid.iter().map(|(_, p)| p.msg.offset).collect();
    let inserted: Vec<Uuid> = sqlx::query_scalar(
        "INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset, outcome)
         SELECT $1, e, t, p, o, 'applied' FROM unnest($2::uuid[], $3::text[], $4::int[], $5::bigint[]) AS u(e, t, p, o)
         ON CONFLICT (group_name, event_id) DO NOTHING
         RETURNING event_id",
    )
    .bind(group)
    .bind(&ids)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .fetch_all(&mut *tx)
    .await?;
    Ok(inserted.into_iter().collect())
}

async fn load_progress(
    tx: &mut PgConnection,
    group: &str,
    orders: &[String],
) -> Result<HashMap<String, i64>, sqlx::Error> {
    if orders.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT order_id, last_sequence FROM order_progress
         WHERE group_name = $1 AND order_id = ANY($2) ORDER BY order_id FOR UPDATE",
    )
    .bind(group)
    .bind(orders)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().collect())
}

async fn orders_with_parked(
    tx: &mut PgConnection,
    group: &str,
    orders: &[String],
) -> Result<HashSet<String>, sqlx::Error> {
    if orders.is_empty() {
        return Ok(HashSet::new());
    }
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT order_id FROM parked_event WHERE group_name = $1 AND order_id = ANY($2)",
    )
    .bind(group)
    .bind(orders)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Applies parked events of `order` that now follow `last` without a gap. Returns the new last.
pub(crate) async fn release_parked(
    tx: &mut Transaction<'_, Postgres>,
    handler: &dyn Handler,
    order: &str,
    mut last: i64,
    state: &mut BatchState,
    report: &mut BatchReport,
) -> Result<i64, ProcessError> {
    let group = handler.group();
    loop {
        let row: Option<ParkedRow> = sqlx::query_as(
            "DELETE FROM parked_event WHERE group_name = $1 AND order_id = $2 AND sequence = $3
             RETURNING event_id, event_type, payload, occurred_at, topic, partition, kafka_offset",
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
        match apply_one(tx, handler, &event).await? {
            Ok(()) => {
                state.effects.push(AppliedEffect::of(&event));
                set_outcomes(tx, group, &[(row.event_id, "applied")]).await?;
                report.released += 1;
                last += 1;
                tracing::info!(group, event_id = %row.event_id, order_id = order, sequence = last, "parked event released and applied");
            }
            Err(reason) => {
                let msg = InboundMessage {
                    topic: row.topic,
                    partition: row.partition,
                    offset: row.kafka_offset,
                    key: Some(order.as_bytes().to_vec()),
                    payload: serde_json::to_vec(&row.payload).ok(),
                    headers: serde_json::Value::Object(Default::default()),
                    envelope: Ok(event.envelope.clone()),
                };
                let letter = DeadLetter::now(&msg, Some(&event), &reason);
                dead_letter::record(tx, group, &letter).await?;
                state.letters.push(letter);
                set_outcomes(tx, group, &[(row.event_id, "dead_lettered")]).await?;
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
}

async fn park(
    tx: &mut PgConnection,
    group: &str,
    msg: &InboundMessage,
    event: &Event,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let env = &event.envelope;
    sqlx::query(
        "INSERT INTO parked_event (group_name, order_id, sequence, event_id, event_type, payload,
                                   occurred_at, topic, partition, kafka_offset, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         ON CONFLICT (group_name, order_id, sequence) DO NOTHING",
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
    .execute(tx)
    .await?;
    Ok(())
}

pub(crate) struct AppliedEffect {
    event_id: Uuid,
    order_id: String,
    sequence: i64,
    event_type: String,
    occurred_at: DateTime<Utc>,
}

impl AppliedEffect {
    pub(crate) fn of(event: &Event) -> Self {
        AppliedEffect {
            event_id: event.envelope.event_id,
            order_id: event.envelope.aggregate_id.clone(),
            sequence: event.envelope.sequence,
            event_type: event.envelope.event_type.clone(),
            occurred_at: event.envelope.occurred_at,
        }
    }
}

pub(crate) async fn record_effects(
    tx: &mut PgConnection,
    group: &str,
    effects: &[AppliedEffect],
) -> Result<(), sqlx::Error> {
    if effects.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = effects.iter().map(|e| e.event_id).collect();
    let orders: Vec<&str> = effects.iter().map(|e| e.order_id.as_str()).collect();
    let seqs: Vec<i64> = effects.iter().map(|e| e.sequence).collect();
    let types: Vec<&str> = effects.iter().map(|e| e.event_type.as_str()).collect();
    let at: Vec<DateTime<Utc>> = effects.iter().map(|e| e.occurred_at).collect();
    sqlx::query(
        "INSERT INTO applied_effect (group_name, event_id, order_id, sequence, event_type, occurred_at)
         SELECT $1, e, o, s, t, a
         FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::timestamptz[])
              WITH ORDINALITY AS u(e, o, s, t, a, n)
         ORDER BY n",
    )
    .bind(group)
    .bind(&ids)
    .bind(&orders)
    .bind(&seqs)
    .bind(&types)
    .bind(&at)
    .execute(tx)
    .await?;
    Ok(())
}

pub(crate) async fn save_progress(
    tx: &mut PgConnection,
    group: &str,
    progress: &HashMap<String, i64>,
) -> Result<(), sqlx::Error> {
    if progress.is_empty() {
        return Ok(());
    }
    let (orders, seqs): (Vec<&str>, Vec<i64>) =
        progress.iter().map(|(o, s)| (o.as_str(), *s)).unzip();
    sqlx::query(
        "INSERT INTO order_progress (group_name, order_id, last_sequence)
         SELECT $1, * FROM unnest($2::text[], $3::bigint[])
         ON CONFLICT (group_name, order_id) DO UPDATE
         SET last_sequence = GREATEST(order_progress.last_sequence, EXCLUDED.last_sequence),
             updated_at = clock_timestamp()",
    )
    .bind(group)
    .bind(&orders)
    .bind(&seqs)
    .execute(tx)
    .await?;
    Ok(())
}

pub(crate) async fn set_outcomes(
    tx: &mut PgConnection,
    group: &str,
    outcomes: &[(Uuid, &str)],
) -> Result<(), sqlx::Error> {
    if outcomes.is_empty() {
        return Ok(());
    }
    let (ids, labels): (Vec<Uuid>, Vec<&str>) = outcomes.iter().copied().unzip();
    sqlx::query(
        "UPDATE processed_message m SET outcome = u.outcome
         FROM unnest($2::uuid[], $3::text[]) AS u(event_id, outcome)
         WHERE m.group_name = $1 AND m.event_id = u.event_id",
    )
    .bind(group)
    .bind(&ids)
    .bind(&labels)
    .execute(tx)
    .await?;
    Ok(())
}
