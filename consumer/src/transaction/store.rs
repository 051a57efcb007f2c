//! The batch transaction's statements: ownership fence, dedupe rows, per-aggregate progress,
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
    /// Last applied sequence of the transaction's aggregates that have one, locked for it.
    pub(crate) progress: HashMap<String, i64>,
    /// The transaction's aggregates with parked events.
    pub(crate) parked_aggregates: HashSet<String>,
    /// Aggregates whose last event was applied before this time may have had their progress
    /// removed by retention (`progress_horizon`); None while the group's never was.
    pub(crate) horizon: Option<DateTime<Utc>>,
}

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

/// One group's part of a transaction's opening statement.
pub(crate) struct GroupOpening<'a, 'm> {
    /// The group.
    pub(crate) group: &'a str,
    /// The partitions this consumer must still own.
    pub(crate) fences: Vec<&'a Fence>,
    /// The readable events, first copy of each id.
    pub(crate) valid: Vec<&'a Pending<'m>>,
    /// The events' aggregates, sorted, each once.
    pub(crate) aggregates: Vec<String>,
}

type TransactionStartRow = (
    bool,
    Vec<String>,
    Vec<Uuid>,
    Vec<String>,
    Vec<String>,
    Vec<i64>,
    Vec<String>,
    Vec<String>,
    Vec<String>,
    Vec<DateTime<Utc>>,
);

/// Opens the batches of one or more groups (each given once) in one round trip: checks, with
/// share locks held until the transaction ends, that this consumer still owns every partition
/// in the groups' fences, inserts the `processed_message` rows of their events (the dedupe
/// constraint decides which are new to each group), and locks (in group and aggregate order) and
/// reads the groups' progress and parked events of the transaction's aggregates. If any partition
/// is no longer owned, nothing is inserted and the transaction is reported as
/// [`ProcessError::Fenced`]. One start per group, in the order given.
pub(crate) async fn start_transaction(
    tx: &mut PgConnection,
    groups: &[GroupOpening<'_, '_>],
) -> Result<Vec<TransactionStart>, ProcessError> {
    if groups
        .iter()
        .all(|g| g.valid.is_empty() && g.fences.is_empty())
    {
        return Ok(groups.iter().map(|_| TransactionStart::default()).collect());
    }
    let mut rows = EventRows::default();
    let mut fences = FenceRows::default();
    let mut aggregates: Vec<&str> = Vec::new();
    for g in groups {
        for p in &g.valid {
            rows.groups.push(g.group);
            rows.ids.push(p.event.envelope.event_id);
            rows.topics.push(p.msg.topic.as_str());
            rows.partitions.push(p.msg.partition);
            rows.offsets.push(p.msg.offset);
        }
        for f in &g.fences {
            fences.groups.push(g.group);
            fences.topics.push(f.topic.as_str());
            fences.partitions.push(f.partition);
            fences.owners.push(f.owner);
        }
        aggregates.extend(g.aggregates.iter().map(String::as_str));
    }
    let names: Vec<&str> = groups.iter().map(|g| g.group).collect();
    // Each group's progress and parked events are read for every aggregate of the transaction:
    // the index scans take both arrays, whatever the batches' size. A group's rows of an
    // aggregate only another group's batch has are read and locked too, and never consulted (the
    // groups of one transaction consume the same events, so there are few or none).
    aggregates.sort_unstable();
    aggregates.dedup();
    let row: TransactionStartRow = sqlx::query_as(
        "WITH want AS (
                 SELECT * FROM unnest($6::text[], $7::text[], $8::int[], $9::uuid[])
                     AS w(group_name, topic, partition, owner)),
             owner AS (
                 SELECT 1 FROM partition_owner o JOIN want w
                     ON o.group_name = w.group_name AND o.topic = w.topic
                        AND o.partition = w.partition AND o.owner = w.owner
                 FOR SHARE OF o),
             fence AS (
                 SELECT (SELECT count(*) FROM owner) = (SELECT count(*) FROM want) AS owned),
             new AS (
                 INSERT INTO processed_message (group_name, event_id, topic, partition,
                                                kafka_offset, outcome)
                 SELECT g, e, t, p, o, 'applied'
                 FROM unnest($1::text[], $2::uuid[], $3::text[], $4::int[], $5::bigint[])
                     AS u(g, e, t, p, o)
                 WHERE (SELECT owned FROM fence)
                 ON CONFLICT (group_name, event_id) DO NOTHING
                 RETURNING group_name, event_id),
             progress AS (
                 SELECT group_name, aggregate_id, last_sequence FROM aggregate_progress
                 WHERE group_name = ANY($10) AND aggregate_id = ANY($11)
                       AND (SELECT owned FROM fence)
                 ORDER BY group_name, aggregate_id FOR UPDATE),
             parked AS (
                 SELECT group_name, aggregate_id FROM parked_event
                 WHERE group_name = ANY($10) AND aggregate_id = ANY($11))
         SELECT f.owned,
                COALESCE(n.groups, '{}'), COALESCE(n.ids, '{}'),
                COALESCE(p.groups, '{}'), COALESCE(p.aggregates, '{}'), COALESCE(p.seqs, '{}'),
                COALESCE(k.groups, '{}'), COALESCE(k.aggregates, '{}'),
                COALESCE(h.groups, '{}'), COALESCE(h.horizons, '{}')
         FROM fence f,
              LATERAL (SELECT array_agg(group_name) AS groups, array_agg(event_id) AS ids
                       FROM new) n,
              LATERAL (SELECT array_agg(group_name) AS groups, array_agg(aggregate_id) AS aggregates,
                              array_agg(last_sequence) AS seqs
                       FROM progress) p,
              LATERAL (SELECT array_agg(group_name) AS groups, array_agg(aggregate_id) AS aggregates
                       FROM parked) k,
              LATERAL (SELECT array_agg(group_name) AS groups,
                              array_agg(forgotten_before) AS horizons
                       FROM progress_horizon
                       WHERE group_name = ANY($10) AND isfinite(forgotten_before)) h",
    )
    .bind(&rows.groups)
    .bind(&rows.ids)
    .bind(&rows.topics)
    .bind(&rows.partitions)
    .bind(&rows.offsets)
    .bind(&fences.groups)
    .bind(&fences.topics)
    .bind(&fences.partitions)
    .bind(&fences.owners)
    .bind(&names)
    .bind(&aggregates)
    .fetch_one(&mut *tx)
    .await?;
    let (owned, new_groups, new_ids, progress_groups, progress_aggregates, progress_seqs) =
        (row.0, row.1, row.2, row.3, row.4, row.5);
    let (parked_groups, parked_aggregates, horizon_groups, horizons) = (row.6, row.7, row.8, row.9);
    if !owned {
        return Err(ProcessError::Fenced);
    }
    let mut starts: HashMap<String, TransactionStart> = HashMap::with_capacity(groups.len());
    for (group, id) in new_groups.into_iter().zip(new_ids) {
        starts.entry(group).or_default().new_ids.insert(id);
    }
    for ((group, order), seq) in progress_groups
        .into_iter()
        .zip(progress_aggregates)
        .zip(progress_seqs)
    {
        starts.entry(group).or_default().progress.insert(order, seq);
    }
    for (group, order) in parked_groups.into_iter().zip(parked_aggregates) {
        starts
            .entry(group)
            .or_default()
            .parked_aggregates
            .insert(order);
    }
    for (group, horizon) in horizon_groups.into_iter().zip(horizons) {
        starts.entry(group).or_default().horizon = Some(horizon);
    }
    Ok(groups
        .iter()
        .map(|g| starts.remove(g.group).unwrap_or_default())
        .collect())
}

/// The rows of a statement's events, one array a column.
#[derive(Default)]
struct EventRows<'a> {
    groups: Vec<&'a str>,
    ids: Vec<Uuid>,
    topics: Vec<&'a str>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
}

/// The partitions a statement's groups must own, one array a column.
#[derive(Default)]
struct FenceRows<'a> {
    groups: Vec<&'a str>,
    topics: Vec<&'a str>,
    partitions: Vec<i32>,
    owners: Vec<Uuid>,
}

pub(crate) struct AppliedEffect {
    event_id: Uuid,
    aggregate_id: String,
    sequence: i64,
    event_type: String,
    pub(crate) occurred_at: DateTime<Utc>,
}

impl AppliedEffect {
    pub(crate) fn of(event: &Event) -> Self {
        AppliedEffect {
            event_id: event.envelope.event_id,
            aggregate_id: event.envelope.aggregate_id.clone(),
            sequence: event.envelope.sequence,
            event_type: event.envelope.event_type.clone(),
            occurred_at: event.envelope.occurred_at,
        }
    }
}

/// What one group applied in a transaction: its effects and its aggregates' advanced progress.
pub(crate) struct GroupApplied<'a> {
    pub(crate) group: &'a str,
    pub(crate) effects: &'a [AppliedEffect],
    pub(crate) progress: &'a HashMap<String, i64>,
}

/// Records a group's applied effects and its aggregates' advanced progress, in one statement.
pub(crate) async fn record_applied(
    tx: &mut PgConnection,
    group: &str,
    effects: &[AppliedEffect],
    progress: &HashMap<String, i64>,
) -> Result<(), sqlx::Error> {
    let applied = GroupApplied {
        group,
        effects,
        progress,
    };
    record_groups_applied(tx, std::slice::from_ref(&applied)).await
}

/// Records the applied effects and advanced progress of one or more groups (each given once),
/// in one statement.
pub(crate) async fn record_groups_applied(
    tx: &mut PgConnection,
    groups: &[GroupApplied<'_>],
) -> Result<(), sqlx::Error> {
    if groups
        .iter()
        .all(|g| g.effects.is_empty() && g.progress.is_empty())
    {
        return Ok(());
    }
    let mut e = EffectRows::default();
    let (mut progress_groups, mut progress_aggregates, mut progress_seqs) =
        (Vec::new(), Vec::new(), Vec::new());
    for g in groups {
        for effect in g.effects {
            e.groups.push(g.group);
            e.ids.push(effect.event_id);
            e.aggregates.push(effect.aggregate_id.as_str());
            e.seqs.push(effect.sequence);
            e.types.push(effect.event_type.as_str());
            e.at.push(effect.occurred_at);
        }
        for (order, seq) in g.progress {
            progress_groups.push(g.group);
            progress_aggregates.push(order.as_str());
            progress_seqs.push(*seq);
        }
    }
    sqlx::query(
        "WITH effects AS (
             INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type,
                                         occurred_at)
             SELECT g, e, o, s, t, a
             FROM unnest($1::text[], $2::uuid[], $3::text[], $4::bigint[], $5::text[],
                         $6::timestamptz[])
                  WITH ORDINALITY AS u(g, e, o, s, t, a, n)
             ORDER BY n)
         INSERT INTO aggregate_progress (group_name, aggregate_id, last_sequence)
         SELECT * FROM unnest($7::text[], $8::text[], $9::bigint[])
         ON CONFLICT (group_name, aggregate_id) DO UPDATE
         SET last_sequence = GREATEST(aggregate_progress.last_sequence, EXCLUDED.last_sequence),
             updated_at = clock_timestamp()",
    )
    .bind(&e.groups)
    .bind(&e.ids)
    .bind(&e.aggregates)
    .bind(&e.seqs)
    .bind(&e.types)
    .bind(&e.at)
    .bind(&progress_groups)
    .bind(&progress_aggregates)
    .bind(&progress_seqs)
    .execute(tx)
    .await?;
    Ok(())
}

/// The rows of applied effects, one array a column.
#[derive(Default)]
struct EffectRows<'a> {
    groups: Vec<&'a str>,
    ids: Vec<Uuid>,
    aggregates: Vec<&'a str>,
    seqs: Vec<i64>,
    types: Vec<&'a str>,
    at: Vec<DateTime<Utc>>,
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
    let aggregates: Vec<&str> = duplicates
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
        "INSERT INTO group_transition (group_name, event_id, aggregate_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT $1, e, o, s, y, 'duplicate', 'already processed', t, p, k
         FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::int[],
                     $8::bigint[]) AS u(e, o, s, y, t, p, k)",
    )
    .bind(group)
    .bind(&ids)
    .bind(&aggregates)
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

    /// A parked event applied once its gap closed: outcome `applied`, step `unparked`.
    pub(crate) fn unparked(envelope: &'a Envelope) -> Self {
        OutcomeChange {
            event_id: envelope.event_id,
            outcome: "applied",
            step: Some(Step {
                envelope,
                transition: "unparked",
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
         INSERT INTO group_transition (group_name, event_id, aggregate_id, sequence, event_type,
                                       transition, detail, topic, partition, kafka_offset)
         SELECT $1, s.event_id, s.aggregate_id, s.sequence, s.event_type, s.transition, s.detail,
                c.topic, c.partition, c.kafka_offset
         FROM unnest($4::uuid[], $5::text[], $6::bigint[], $7::text[], $8::text[], $9::text[])
              AS s(event_id, aggregate_id, sequence, event_type, transition, detail)
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
