//! Resolving dead letters: replay one (apply it again, e.g. after fixing the handler or the data),
//! skip it (pass over it for good), or discard one that holds nothing back. After a replay or a
//! skip the order's events parked behind it are applied in sequence order, in the same
//! transaction, which also records who acted and why.

use chrono::{DateTime, Utc};
use pipeline_core::envelope::{Envelope, OCCURRED_AT};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::handlers::{Event, Handler, HandlerTransaction};
use crate::transaction::{
    apply_one, record_applied, set_outcomes, unpark, AppliedEffect, BatchReport, DeadLetterSink,
    OutcomeChange, ProcessError, TransactionState,
};

/// What to do with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Apply the event again (after fixing its cause), then its order's parked events.
    Replay,
    /// Pass over the event for good: its order moves past it and its parked events are applied
    /// in sequence. For a record without a readable event, the order (from the record's key, or
    /// named by the operator) moves past its gap, up to its first parked event; a record that
    /// names no order (no key, or one that cannot be an order id) holds nothing back and is just
    /// closed.
    Skip,
    /// Close a letter that holds nothing back (no event of its order parked behind it).
    Discard,
}

impl Resolution {
    /// The letter's status afterwards.
    pub fn status(self) -> &'static str {
        match self {
            Resolution::Replay => "replayed",
            Resolution::Skip => "skipped",
            Resolution::Discard => "discarded",
        }
    }

    /// The action's name in `operator_action`.
    pub fn action(self) -> &'static str {
        match self {
            Resolution::Replay => "dead_letter.replay",
            Resolution::Skip => "dead_letter.skip",
            Resolution::Discard => "dead_letter.discard",
        }
    }
}

/// One resolution an operator asks for: which letter, what to do, who and why.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The dead letter's id.
    pub id: i64,
    /// What to do.
    pub how: Resolution,
    /// Who acts (recorded).
    pub actor: &'a str,
    /// Why (recorded, and kept with the letter).
    pub note: &'a str,
    /// For a skip of a record with neither a readable event nor a key that is an aggregate id:
    /// the aggregate it held back.
    pub for_aggregate: Option<&'a str>,
}

/// Why a dead letter could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The group has no dead letter with this id.
    #[error("no dead letter {0} for this group")]
    NotFound(i64),
    /// The dead letter was already replayed, skipped or discarded.
    #[error("dead letter {id} is already {status}")]
    AlreadyResolved {
        /// The dead letter's id.
        id: i64,
        /// Its status: `replayed`, `skipped` or `discarded`.
        status: String,
    },
    /// A replay was asked of a record that is not a readable event.
    #[error("dead letter {0} has no readable event (no key or envelope headers): it can only be skipped or discarded")]
    Unreadable(i64),
    /// A discard of a letter whose order has events parked behind it.
    #[error("order {aggregate_id} has {parked} event(s) parked behind dead letter {id}: skip or replay it instead, so they are applied")]
    HoldsParked {
        /// The dead letter's id.
        id: i64,
        /// Its order.
        aggregate_id: String,
        /// Events parked.
        parked: i64,
    },
    /// An earlier sequence of the order is not applied yet, so this event cannot go next.
    #[error(
        "order {aggregate_id} has not applied sequence {expected} yet; resolve that event first"
    )]
    EarlierPending {
        /// The dead letter's order.
        aggregate_id: String,
        /// The order's next sequence to apply.
        expected: i64,
    },
    /// The replayed event was rejected again, for this reason; the dead letter stays open.
    #[error("the handler rejected the event again: {0}")]
    StillRejected(String),
    /// The database or the dead-letter publish failed; the transaction was rolled back.
    #[error(transparent)]
    Process(#[from] ProcessError),
}

impl From<sqlx::Error> for ResolveError {
    fn from(e: sqlx::Error) -> Self {
        ResolveError::Process(e.into())
    }
}

/// A dead letter as listed for operators.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct DeadLetterRow {
    /// The id `replay` and `discard` take.
    pub id: i64,
    /// The group that dead-lettered the message.
    pub group_name: String,
    /// The event's id, when the record was a readable event.
    pub event_id: Option<Uuid>,
    /// The event's order (aggregate id), when readable.
    pub aggregate_id: Option<String>,
    /// The event's sequence within its order, when readable.
    pub sequence: Option<i64>,
    /// The event's type, when readable.
    pub event_type: Option<String>,
    /// Topic of the original record.
    pub topic: String,
    /// Partition of the original record.
    pub partition: i32,
    /// Offset of the original record.
    pub kafka_offset: i64,
    /// Why the message was dead-lettered.
    pub reason: String,
    /// How many times the message was tried.
    pub attempts: i32,
    /// `open`, `replayed` or `discarded`.
    pub status: String,
    /// When the dead letter was recorded.
    pub created_at: DateTime<Utc>,
    /// Later events of the same order waiting behind this one.
    pub parked_behind: i64,
}

/// Dead letters of `group`, oldest first, optionally only those with `status`.
pub async fn list(
    pool: &PgPool,
    group: &str,
    status: Option<&str>,
) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT d.id, d.group_name, d.event_id, d.aggregate_id, d.sequence, d.event_type, d.topic,
                d.partition, d.kafka_offset, d.reason, d.attempts, d.status, d.created_at,
                (SELECT count(*) FROM parked_event p
                 WHERE p.group_name = d.group_name AND p.aggregate_id = d.aggregate_id) AS parked_behind
         FROM dead_letter d
         WHERE d.group_name = $1 AND ($2::text IS NULL OR d.status = $2)
         ORDER BY d.id",
    )
    .bind(group)
    .bind(status)
    .fetch_all(pool)
    .await
}

#[derive(sqlx::FromRow)]
struct Letter {
    status: String,
    event_id: Option<Uuid>,
    aggregate_id: Option<String>,
    sequence: Option<i64>,
    event_type: Option<String>,
    payload: Option<Vec<u8>>,
    headers: serde_json::Value,
    created_at: DateTime<Utc>,
}

/// What a resolution did.
#[derive(Debug, Serialize)]
pub struct Resolved {
    /// The dead letter resolved.
    pub id: i64,
    /// Its order, when known.
    pub aggregate_id: Option<String>,
    /// Whether its event was applied (a replay); false for a discard.
    pub applied: bool,
    /// Parked events applied after it, in sequence order.
    pub unparked: usize,
    /// The order's last applied sequence afterwards.
    pub last_sequence: Option<i64>,
}

/// Resolves one dead letter of `handler`'s group as `request` says, in one transaction that also
/// records the operator's action (`operator_action`: who, why, what) and applies the order's
/// parked events that can now go, in sequence.
pub async fn resolve(
    pool: &PgPool,
    handler: &dyn Handler,
    dead_letters: Option<&DeadLetterSink>,
    request: Request<'_>,
) -> Result<Resolved, ResolveError> {
    let (id, how) = (request.id, request.how);
    let group = handler.group();
    let mut tx = pool.begin().await?;
    let letter: Letter = sqlx::query_as(
        "SELECT status, event_id, aggregate_id, sequence, event_type, payload, headers, created_at
         FROM dead_letter WHERE id = $1 AND group_name = $2 FOR UPDATE",
    )
    .bind(id)
    .bind(group)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(ResolveError::NotFound(id))?;
    if letter.status != "open" {
        return Err(ResolveError::AlreadyResolved {
            id,
            status: letter.status,
        });
    }
    let order = letter
        .aggregate_id
        .clone()
        .or_else(|| request.for_aggregate.map(str::to_owned));
    let mut resolved = Resolved {
        id,
        aggregate_id: order.clone(),
        applied: false,
        unparked: 0,
        last_sequence: None,
    };
    // Recorded first, so the steps it causes come after it in the order's history.
    sqlx::query(
        "INSERT INTO operator_action (actor, action, reason, group_name, event_id, aggregate_id, detail)
         VALUES ($1, $2, $3, $4, $5, $6, jsonb_build_object('dead_letter', $7::bigint, 'sequence', $8::bigint))",
    )
    .bind(request.actor)
    .bind(how.action())
    .bind(request.note)
    .bind(group)
    .bind(letter.event_id)
    .bind(&order)
    .bind(id)
    .bind(letter.sequence)
    .execute(&mut *tx)
    .await?;
    let parked: i64 = match &order {
        Some(order) => {
            sqlx::query_scalar(
                "SELECT count(*) FROM parked_event WHERE group_name = $1 AND aggregate_id = $2",
            )
            .bind(group)
            .bind(order)
            .fetch_one(&mut *tx)
            .await?
        }
        None => 0,
    };
    match (how, &order) {
        (Resolution::Discard, Some(order)) if parked > 0 => {
            return Err(ResolveError::HoldsParked {
                id,
                aggregate_id: order.clone(),
                parked,
            })
        }
        (Resolution::Discard, _) => {}
        (Resolution::Replay, _) => {
            let event = readable(&letter).ok_or(ResolveError::Unreadable(id))?;
            pass(
                &mut tx,
                handler,
                dead_letters,
                Some(&event),
                &event.envelope.aggregate_id,
                event.envelope.sequence,
                &mut resolved,
            )
            .await?;
        }
        // No order: no event of any order waits for it.
        (Resolution::Skip, None) => {}
        (Resolution::Skip, Some(order)) => match (letter.sequence, readable(&letter)) {
            (Some(seq), Some(_)) => {
                pass(
                    &mut tx,
                    handler,
                    dead_letters,
                    None,
                    order,
                    seq,
                    &mut resolved,
                )
                .await?;
            }
            // No readable event: move past the order's gap, up to its first parked event.
            _ if parked > 0 => {
                let first: i64 = sqlx::query_scalar(
                    "SELECT min(sequence) FROM parked_event WHERE group_name = $1 AND aggregate_id = $2",
                )
                .bind(group)
                .bind(order)
                .fetch_one(&mut *tx)
                .await?;
                let last = progress(&mut tx, group, order).await?;
                let through = (first - 1).max(last);
                pass_gap(
                    &mut tx,
                    handler,
                    dead_letters,
                    order,
                    through,
                    &mut resolved,
                )
                .await?;
            }
            _ => {}
        },
    }
    sqlx::query(
        "UPDATE dead_letter SET status = $2, resolved_at = clock_timestamp(), note = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(how.status())
    .bind(request.note)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(
        group,
        dead_letter = id,
        status = how.status(),
        actor = request.actor,
        unparked = resolved.unparked,
        "dead letter resolved"
    );
    Ok(resolved)
}

/// The letter's event, when its record was readable.
fn readable(letter: &Letter) -> Option<Event> {
    let (Some(event_id), Some(order), Some(sequence), Some(event_type)) = (
        letter.event_id,
        letter.aggregate_id.clone(),
        letter.sequence,
        letter.event_type.clone(),
    ) else {
        return None;
    };
    let occurred_at = letter
        .headers
        .get(OCCURRED_AT)
        .and_then(|v| v.as_str())
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or(letter.created_at);
    let payload = letter
        .payload
        .as_deref()
        .and_then(|p| serde_json::from_slice(p).ok())
        .unwrap_or(serde_json::Value::Null);
    Some(Event {
        envelope: Envelope {
            event_id,
            event_type,
            aggregate_id: order,
            sequence,
            occurred_at,
            traceparent: None,
        },
        payload,
    })
}

async fn progress(tx: &mut PgConnection, group: &str, order: &str) -> Result<i64, sqlx::Error> {
    Ok(sqlx::query_scalar(
        "SELECT last_sequence FROM aggregate_progress WHERE group_name = $1 AND aggregate_id = $2 FOR UPDATE",
    )
    .bind(group)
    .bind(order)
    .fetch_optional(&mut *tx)
    .await?
    .unwrap_or(0))
}

/// Moves `order` past sequence `seq` (the letter's): applies `event` first when replaying, then
/// the parked events that follow.
async fn pass(
    tx: &mut Transaction<'_, Postgres>,
    handler: &dyn Handler,
    dead_letters: Option<&DeadLetterSink>,
    event: Option<&Event>,
    order: &str,
    seq: i64,
    resolved: &mut Resolved,
) -> Result<(), ResolveError> {
    let last = progress(tx, handler.group(), order).await?;
    if seq != last + 1 {
        return Err(ResolveError::EarlierPending {
            aggregate_id: order.to_owned(),
            expected: last + 1,
        });
    }
    let mut state = TransactionState::default();
    let mut effects = handler.transaction();
    if let Some(event) = event {
        if event.payload.is_null() {
            return Err(ResolveError::StillRejected("payload is not JSON".into()));
        }
        effects
            .prepare(tx, std::slice::from_ref(event))
            .await
            .map_err(ProcessError::from)?;
        apply_one(tx, effects.as_mut(), event)
            .await?
            .map_err(ResolveError::StillRejected)?;
        state.effects.push(AppliedEffect::of(event));
        set_outcomes(
            tx,
            handler.group(),
            &[OutcomeChange::untracked(event.envelope.event_id, "applied")],
        )
        .await?;
        resolved.applied = true;
    }
    unpark_after(
        tx,
        effects.as_mut(),
        handler.group(),
        dead_letters,
        order,
        seq,
        state,
        resolved,
    )
    .await
}

/// Moves `order` past its gap, through sequence `through`, then applies the parked events that
/// follow.
async fn pass_gap(
    tx: &mut Transaction<'_, Postgres>,
    handler: &dyn Handler,
    dead_letters: Option<&DeadLetterSink>,
    order: &str,
    through: i64,
    resolved: &mut Resolved,
) -> Result<(), ResolveError> {
    let mut effects = handler.transaction();
    unpark_after(
        tx,
        effects.as_mut(),
        handler.group(),
        dead_letters,
        order,
        through,
        TransactionState::default(),
        resolved,
    )
    .await
}

/// Applies `order`'s parked events from `last + 1` on, records the effects and the progress, and
/// publishes dead letters raised on the way.
#[allow(clippy::too_many_arguments)]
async fn unpark_after(
    tx: &mut Transaction<'_, Postgres>,
    effects: &mut dyn HandlerTransaction,
    group: &str,
    dead_letters: Option<&DeadLetterSink>,
    order: &str,
    last: i64,
    mut state: TransactionState,
    resolved: &mut Resolved,
) -> Result<(), ResolveError> {
    let mut report = BatchReport::default();
    let last = unpark(tx, effects, group, order, last, &mut state, &mut report).await?;
    effects.flush(tx).await.map_err(ProcessError::from)?;
    let _ = state.advanced.insert(order.to_owned(), last);
    record_applied(tx, group, &state.effects, &state.advanced).await?;
    if let (Some(sink), false) = (dead_letters, state.letters.is_empty()) {
        sink.publish(group, &state.letters)
            .await
            .map_err(ProcessError::from)?;
    }
    resolved.unparked = report.unparked;
    resolved.last_sequence = Some(last);
    Ok(())
}
