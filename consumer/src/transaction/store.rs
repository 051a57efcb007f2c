//! The batch transaction's statements: ownership fence, dedupe rows, per-order progress,
//! effect history and outcomes.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use pipeline_core::envelope::Envelope;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::error::ProcessError;
use super::message::{Fence, Pending};
use crate::handlers::Event;

pub(crate) async fn check_owner(
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

/// What a transaction learns from its first statement.
#[derive(Debug, Default)]
pub(crate) struct TransactionStart {
    /// Event ids whose `processed_message` row this transaction inserted: the events new to the
    /// group.
    pub(crate) new_ids: HashSet<Uuid>,
    /// Last applied sequence of the transaction's orders that have one, locked for it.
    pub(crate) progress: HashMap<String, i64>,
    /// The transaction's orders with parked events.
    pub(crate) parked_orders: HashSet<String>,
    /// Orders whose last event was applied before this time may have had their progress
    /// removed by retention (`progress_horizon`); None while the group's never was.
    pub(crate) horizon: Option<DateTime<Utc>>,
}

type TransactionStartRow = (
    bool,
    Vec<Uuid>,
    Vec<String>,
    Vec<i64>,
    Vec<String>,
    Option<DateTime<Utc>>,
);

/// Transactions of at most this many messages plan their statements with their parameter values,
/// by default (`--custom-plans-up-to`): none.
///
/// PostgreSQL settles on a generic plan for a prepared statement after five executions, and a
/// plan made while the tables were small (or not yet analysed) can scan them whole as they grow.
/// The consumer's sessions plan as [`pipeline_core::db::Planner::KeyLookups`], whose generic
/// plans are index lookups on both key columns whatever the tables' size, so every transaction
/// keeps its cached plans and saves the planning of each statement. The setting is for a
/// database where that is not enough: small transactions then plan each statement with its
/// values, at the cost of planning it every time.
pub const CUSTOM_PLANS_UP_TO: usize = 0;

/// Makes the rest of the transaction plan each statement with its parameter values.
pub(crate) async fn plan_with_values(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Opens a transaction's batches in one round trip: checks, with share locks held until the
/// transaction ends, that this consumer still owns every partition in `fences`, inserts the
/// `processed_message` rows of `valid` (the dedupe constraint decides which are new), and locks
/// and reads the progress and parked events of `orders` (sorted). If any partition is no longer
/// owned, nothing is inserted and the batch is reported as [`ProcessError::Fenced`].
pub(crate) async fn start_transaction(
    tx: &mut PgConnection,
    group: &str,
    fences: &[&Fence],
    valid: &[&Pending<'_>],
    orders: &[String],
) -> Result<TransactionStart, ProcessError> {
    if valid.is_empty() && fences.is_empty() {
        return Ok(TransactionStart::default());
    }
    let ids: Vec<Uuid> = valid.iter().map(|p| p.event.envelope.event_id).collect();
    let topics: Vec<&str> = valid.iter().map(|p| p.msg.topic.as_str()).collect();
    let partitions: Vec<i32> = valid.iter().map(|p| p.msg.partition).collect();
    let offsets: Vec<i64> = valid.iter().map(|p| p.msg.offset).collect();
    let fence_topics: Vec<&str> = fences.iter().map(|f| f.topic.as_str()).collect();
    let fence_partitions: Vec<i32> = fences.iter().map(|f| f.partition).collect();
    let fence_owners: Vec<Uuid> = fences.iter().map(|f| f.owner).collect();
    let (owned, new_ids, progress_orders, progress_seqs, parked, horizon): TransactionStartRow = sqlx::query_as(
        "WITH want AS (
                 SELECT * FROM unnest($6::text[], $7::int[], $8::uuid[]) AS w(topic, partition, owner)),
             owner AS (
                 SELECT 1 FROM partition_owner o JOIN want w
                     ON o.topic = w.topic AND o.partition = w.partition AND o.owner = w.owner
                 WHERE o.group_name = $1
                 FOR SHARE OF o),
             fence AS (
                 SELECT (SELECT count(*) FROM owner) = (SELECT count(*) FROM want) AS owned),
             new AS (
                 INSERT INTO processed_message (group_name, event_id, topic, partition,
                                                kafka_offset, outcome)
                 SELECT $1, e, t, p, o, 'applied'
                 FROM unnest($2::uuid[], $3::text[], $4::int[], $5::bigint[]) AS u(e, t, p, o)
                 WHERE (SELECT owned FROM fence)
                 ON CONFLICT (group_name, event_id) DO NOTHING
                 RETURNING event_id),
             progress AS (
                 SELECT order_id, last_sequence FROM order_progress
                 WHERE group_name = $1 AND order_id = ANY($9) AND (SELECT owned FROM fence)
                 ORDER BY order_id FOR UPDATE)
             SELECT f.owned,
                    ARRAY(SELECT event_id FROM new),
                    COALESCE(p.orders, '{}'), COALESCE(p.seqs, '{}'),
                    ARRAY(SELECT DISTINCT order_id FROM parked_event
                          WHERE group_name = $1 AND order_id = ANY($9)),
                    (SELECT forgotten_before FROM progress_horizon
                     WHERE group_name = $1 AND isfinite(forgotten_before))
             FROM fence f,
                  LATERAL (SELECT array_agg(order_id ORDER BY order_id) AS orders,
                                  array_agg(last_sequence ORDER BY order_id) AS seqs
                           FROM progress) p",
    )
    .bind(group)
    .bind(&ids)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .bind(&fence_topics)
    .bind(&fence_partitions)
    .bind(&fence_owners)
    .bind(orders)
    .fetch_one(&mut *tx)
    .await?;
    if !owned {
        return Err(ProcessError::Fenced);
    }
    Ok(TransactionStart {
        new_ids: new_ids.into_iter().collect(),
        progress: progress_orders.into_iter().zip(progress_seqs).collect(),
        parked_orders: parked.into_iter().collect(),
        horizon,
    })
}

pub(crate) struct AppliedEffect {
    event_id: Uuid,
    order_id: String,
    sequence: i64,
    event_type: String,
    pub(crate) occurred_at: DateTime<Utc>,
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

/// Records the transaction's applied effects and the orders' advanced progress, in one
/// statement.
pub(crate) async fn record_applied(
    tx: &mut PgConnection,
    group: &str,
    effects: &[AppliedEffect],
    progress: &HashMap<String, i64>,
) -> Result<(), sqlx::Error> {
    if effects.is_empty() && progress.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = effects.iter().map(|e| e.event_id).collect();
    let orders: Vec<&str> = effects.iter().map(|e| e.order_id.as_str()).collect();
    let seqs: Vec<i64> = effects.iter().map(|e| e.sequence).collect();
    let types: Vec<&str> = effects.iter().map(|e| e.event_type.as_str()).collect();
    let at: Vec<DateTime<Utc>> = effects.iter().map(|e| e.occurred_at).collect();
    let (progress_orders, progress_seqs): (Vec<&str>, Vec<i64>) =
        progress.iter().map(|(o, s)| (o.as_str(), *s)).unzip();
    sqlx::query(
        "WITH effects AS (
             INSERT INTO applied_effect (group_name, event_id, order_id, sequence, event_type,
                                         occurred_at)
             SELECT $1, e, o, s, t, a
             FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::timestamptz[])
                  WITH ORDINALITY AS u(e, o, s, t, a, n)
             ORDER BY n)
         INSERT INTO order_progress (group_name, order_id, last_sequence)
         SELECT $1, * FROM unnest($7::text[], $8::bigint[])
         ON CONFLICT (group_name, order_id) DO UPDATE
         SET last_sequence = GREATEST(order_progress.last_sequence, EXCLUDED.last_sequence),
             updated_at = clock_timestamp()",
    )
    .bind(group)
    .bind(&ids)
    .bind(&orders)
    .bind(&seqs)
    .bind(&types)
    .bind(&at)
    .bind(&progress_orders)
    .bind(&progress_seqs)
    .execute(tx)
    .await?;
    Ok(())
}

/// Records redelivered events the dedupe rows recognised as `duplicate` steps of their history,
/// in one statement. Runs only in a transaction that met such events.
pub(crate) async fn record_duplicates(
    tx: &mut PgConnection,
    group: &str,
    duplicates: &[&Pending<'_>],
) -> Result<(), sqlx::Error> {
    if duplicates.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = duplicates
        .iter()
        .map(|p| p.event.envelope.event_id)
        .collect();
    let orders: Vec<&str> = duplicates
        .iter()
        .map(|p| p.event.envelope.aggregate_id.as_str())
        .collect();
    let seqs: Vec<i64> = duplicates
        .iter()
        .map(|p| p.event.envelope.sequence)
        .collect();
    let types: Vec<&str> = duplicates
        .iter()
        .map(|p| p.event.envelope.event_type.as_str())
        .collect();
    let topics: Vec<&str> = duplicates.iter().map(|p| p.msg.topic.as_str()).collect();
    let partitions: Vec<i32> = duplicates.iter().map(|p| p.msg.partition).collect();
    let offsets: Vec<i64> = duplicates.iter().map(|p| p.msg.offset).collect();
    sqlx::query(
        "INSERT INTO group_transition (group_name, event_id, order_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT $1, e, o, s, y, 'duplicate', 'already processed', t, p, k
         FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::int[],
                     $8::bigint[]) AS u(e, o, s, y, t, p, k)",
    )
    .bind(group)
    .bind(&ids)
    .bind(&orders)
    .bind(&seqs)
    .bind(&types)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .execute(tx)
    .await?;
    Ok(())
}

/// A processed event's new outcome, and the step it adds to the event's history, if any (an
/// outcome whose step is recorded elsewhere, with the parked row or the dead letter, adds none).
pub(crate) struct OutcomeChange<'a> {
    event_id: Uuid,
    outcome: &'static str,
    step: Option<Step<'a>>,
}

struct Step<'a> {
    envelope: &'a Envelope,
    transition: &'static str,
    detail: Option<String>,
}

impl<'a> OutcomeChange<'a> {
    /// The outcome alone.
    pub(crate) fn untracked(event_id: Uuid, outcome: &'static str) -> Self {
        OutcomeChange {
            event_id,
            outcome,
            step: None,
        }
    }

    /// The outcome, recorded as a step of the same name with `detail`.
    pub(crate) fn tracked(envelope: &'a Envelope, outcome: &'static str, detail: String) -> Self {
        OutcomeChange {
            event_id: envelope.event_id,
            outcome,
            step: Some(Step {
                envelope,
                transition: outcome,
                detail: Some(detail),
            }),
        }
    }

    /// A parked event applied once its gap closed: outcome `applied`, step `released`.
    pub(crate) fn released(envelope: &'a Envelope) -> Self {
        OutcomeChange {
            event_id: envelope.event_id,
            outcome: "applied",
            step: Some(Step {
                envelope,
                transition: "released",
                detail: None,
            }),
        }
    }
}

/// Sets the outcome of processed events and records their steps in `group_transition`, in one
/// statement.
pub(crate) async fn set_outcomes(
    tx: &mut PgConnection,
    group: &str,
    changes: &[OutcomeChange<'_>],
) -> Result<(), sqlx::Error> {
    if changes.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = changes.iter().map(|c| c.event_id).collect();
    let outcomes: Vec<&str> = changes.iter().map(|c| c.outcome).collect();
    let mut step_ids: Vec<Uuid> = Vec::new();
    let mut step_orders: Vec<&str> = Vec::new();
    let mut step_seqs: Vec<i64> = Vec::new();
    let mut step_types: Vec<&str> = Vec::new();
    let mut step_names: Vec<&str> = Vec::new();
    let mut step_details: Vec<Option<&str>> = Vec::new();
    for (c, s) in changes
        .iter()
        .filter_map(|c| c.step.as_ref().map(|s| (c, s)))
    {
        step_ids.push(c.event_id);
        step_orders.push(&s.envelope.aggregate_id);
        step_seqs.push(s.envelope.sequence);
        step_types.push(&s.envelope.event_type);
        step_names.push(s.transition);
        step_details.push(s.detail.as_deref());
    }
    sqlx::query(
        "WITH changed AS (
             UPDATE processed_message m SET outcome = u.outcome
             FROM unnest($2::uuid[], $3::text[]) AS u(event_id, outcome)
             WHERE m.group_name = $1 AND m.event_id = u.event_id
             RETURNING m.event_id, m.topic, m.partition, m.kafka_offset)
         INSERT INTO group_transition (group_name, event_id, order_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT $1, s.event_id, s.order_id, s.sequence, s.event_type, s.transition, s.detail,
                c.topic, c.partition, c.kafka_offset
         FROM unnest($4::uuid[], $5::text[], $6::bigint[], $7::text[], $8::text[], $9::text[])
              AS s(event_id, order_id, sequence, event_type, transition, detail)
         LEFT JOIN changed c ON c.event_id = s.event_id",
    )
    .bind(group)
    .bind(&ids)
    .bind(&outcomes)
    .bind(&step_ids)
    .bind(&step_orders)
    .bind(&step_seqs)
    .bind(&step_types)
    .bind(&step_names)
    .bind(&step_details)
    .execute(tx)
    .await?;
    Ok(())
}
