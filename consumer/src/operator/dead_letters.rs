//! `consumer dead-letters`: list a group's dead letters, or resolve one: replay it (apply it
//! again, e.g. after fixing the handler or the data) or discard it deliberately. Either way the
//! order's events parked behind it are then applied in sequence order, in the same transaction.

use chrono::{DateTime, Utc};
use pipeline_core::envelope::{Envelope, OCCURRED_AT};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::config::{DeadLetterAction, DeadLetterArgs};
use crate::handlers::{Event, Groups, Handler, SCHEMA};
use crate::transaction::{
    apply_one, record_applied, release_parked, set_outcomes, AppliedEffect, BatchReport,
    DeadLetterSink, ProcessError, TransactionState,
};

/// What to do with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Apply the event again.
    Replay,
    /// Skip it: it will never be applied; later events of its order go on.
    Discard,
}

/// Why a dead letter could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The group has no dead letter with this id.
    #[error("no dead letter {0} for this group")]
    NotFound(i64),
    /// The dead letter was already replayed or discarded.
    #[error("dead letter {id} is already {status}")]
    AlreadyResolved {
        /// The dead letter's id.
        id: i64,
        /// Its status: `replayed` or `discarded`.
        status: String,
    },
    /// A replay was asked of a record that is not a readable event.
    #[error("dead letter {0} has no readable event (no key or envelope headers): it can only be discarded")]
    Unreadable(i64),
    /// An earlier sequence of the order is not applied yet, so this event cannot go next.
    #[error("order {order_id} has not applied sequence {expected} yet; resolve that event first")]
    EarlierPending {
        /// The dead letter's order.
        order_id: String,
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
    pub order_id: Option<String>,
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
        "SELECT d.id, d.group_name, d.event_id, d.order_id, d.sequence, d.event_type, d.topic,
                d.partition, d.kafka_offset, d.reason, d.attempts, d.status, d.created_at,
                (SELECT count(*) FROM parked_event p
                 WHERE p.group_name = d.group_name AND p.order_id = d.order_id) AS parked_behind
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
    order_id: Option<String>,
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
    /// Whether its event was applied (a replay); false for a discard.
    pub applied: bool,
    /// Parked events applied after it, in sequence order.
    pub released: usize,
    /// The order's last applied sequence afterwards.
    pub last_sequence: Option<i64>,
}

/// Replays or discards dead letter `id` of `handler`'s group.
pub async fn resolve(
    pool: &PgPool,
    handler: &dyn Handler,
    dead_letters: Option<&DeadLetterSink>,
    id: i64,
    how: Resolution,
    note: &str,
) -> Result<Resolved, ResolveError> {
    let group = handler.group();
    let mut tx = pool.begin().await?;
    let letter: Letter = sqlx::query_as(
        "SELECT status, event_id, order_id, sequence, event_type, payload, headers, created_at
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
    let mut resolved = Resolved {
        id,
        applied: false,
        released: 0,
        last_sequence: None,
    };
    if let (Some(event_id), Some(order), Some(seq), Some(event_type)) = (
        letter.event_id,
        letter.order_id.clone(),
        letter.sequence,
        letter.event_type.clone(),
    ) {
        let last: i64 = sqlx::query_scalar(
            "SELECT last_sequence FROM order_progress WHERE group_name = $1 AND order_id = $2 FOR UPDATE",
        )
        .bind(group)
        .bind(&order)
        .fetch_optional(&mut *tx)
        .await?
        .unwrap_or(0);
        if seq != last + 1 {
            return Err(ResolveError::EarlierPending {
                order_id: order,
                expected: last + 1,
            });
        }
        let mut state = TransactionState::default();
        let mut effects = handler.transaction();
        if how == Resolution::Replay {
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
                .ok_or(ResolveError::StillRejected("payload is not JSON".into()))?;
            let event = Event {
                envelope: Envelope {
                    event_id,
                    event_type,
                    aggregate_id: order.clone(),
                    sequence: seq,
                    occurred_at,
                    traceparent: None,
                },
                payload,
            };
            effects
                .prepare(&mut tx, std::slice::from_ref(&event))
                .await
                .map_err(ProcessError::from)?;
            apply_one(&mut tx, effects.as_mut(), &event)
                .await?
                .map_err(ResolveError::StillRejected)?;
            state.effects.push(AppliedEffect::of(&event));
            set_outcomes(&mut tx, group, &[(event_id, "applied")]).await?;
            resolved.applied = true;
        }
        let mut report = BatchReport::default();
        let last = release_parked(
            &mut tx,
            effects.as_mut(),
            group,
            &order,
            seq,
            &mut state,
            &mut report,
        )
        .await?;
        effects.flush(&mut tx).await.map_err(ProcessError::from)?;
        let _ = state.advanced.insert(order, last);
        record_applied(&mut tx, group, &state.effects, &state.advanced).await?;
        if let (Some(sink), false) = (dead_letters, state.letters.is_empty()) {
            sink.publish(group, &state.letters)
                .await
                .map_err(ProcessError::from)?;
        }
        resolved.released = report.released;
        resolved.last_sequence = Some(last);
    } else if how == Resolution::Replay {
        return Err(ResolveError::Unreadable(id));
    }
    let status = match how {
        Resolution::Replay => "replayed",
        Resolution::Discard => "discarded",
    };
    sqlx::query(
        "UPDATE dead_letter SET status = $2, resolved_at = clock_timestamp(), resolution = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(status)
    .bind(note)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(
        group,
        dead_letter = id,
        status,
        released = resolved.released,
        "dead letter resolved"
    );
    Ok(resolved)
}

/// Runs a `dead-letters` subcommand; replaying or discarding needs the group's handler from
/// `groups`, listing works for any group name.
pub async fn run(args: DeadLetterArgs, groups: &Groups) -> anyhow::Result<()> {
    let pool = args.db.connect(&SCHEMA).await?;
    let group = format!("{}{}", args.group_prefix, args.group);
    let (id, how, note) = match &args.action {
        DeadLetterAction::List { status } => {
            for row in list(&pool, &group, status.as_deref()).await? {
                println!("{}", serde_json::to_string(&row)?);
            }
            return Ok(());
        }
        DeadLetterAction::Replay { id, note } => (*id, Resolution::Replay, note),
        DeadLetterAction::Discard { id, note } => (*id, Resolution::Discard, note),
    };
    let handler = groups.handler(&args.group, group.clone())?;
    let sink = if args.dead_letter_topic.is_empty() {
        None
    } else {
        Some(DeadLetterSink::new(&args.kafka, &args.dead_letter_topic)?)
    };
    let resolved = resolve(&pool, handler.as_ref(), sink.as_ref(), id, how, note).await?;
    println!("{}", serde_json::to_string(&resolved)?);
    Ok(())
}
