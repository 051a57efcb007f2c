//! The batch transaction's statements: ownership fence, dedupe rows, per-order progress,
//! effect history and outcomes.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::apply::{Fence, Pending, ProcessError};
use crate::handler::Event;

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

pub(crate) async fn insert_processed(
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

pub(crate) async fn load_progress(
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

/// Records the batch's applied effects and the orders' advanced progress, in one statement.
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
