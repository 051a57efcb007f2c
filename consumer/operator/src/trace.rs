//! `pipeline trace <order id | event id | schedule>`: every state change of an order's events (or
//! of one event), in time order: written by the service, each failed publish attempt, published
//! with its partition and offset, and each group's outcome, with the operators' actions among
//! them. A schedule's name traces its events' aggregate, with each occurrence (fired, skipped,
//! run now) and each change to the schedule.
//! Reads the outbox's history (`outbox_history`) and each group's (`group_history`) by index.
//!
//! A record that names no order (no key, or a key that cannot be an order id: not UTF-8, a NUL,
//! too long) is found by its key as `pipeline dead-letters show` prints it, escaped (`\xff\xfe`).

use chrono::{DateTime, Utc};
use pipeline_core::record::{escape, unescape};
use serde::Serialize;
use uuid::Uuid;

use crate::error::BadInput;
use crate::output::{cell, table};
use crate::targets::{KnownBy, Targets};

/// Operator actions on a whole group: they show in every order's trace, from the order's first
/// step on.
const GROUP_WIDE: [&str; 3] = ["group.reprocess", "group.pause", "group.resume"];

/// One state change.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Step {
    /// When it happened (each database's clock).
    pub at: DateTime<Utc>,
    /// Where: `outbox`, or a group's name.
    #[sqlx(default)]
    pub place: String,
    /// What happened: written, attempt_failed, failed, requeued, published; applied, duplicate,
    /// parked, unparked, stale, dead_lettered; operator actions by name.
    pub transition: String,
    /// The event, when known.
    pub event_id: Option<Uuid>,
    /// Its sequence within the order.
    pub sequence: Option<i64>,
    /// Its type.
    pub event_type: Option<String>,
    /// The error, the reason or the operator's note.
    pub detail: Option<String>,
    /// The Kafka partition, where it concerns a record.
    pub kafka_partition: Option<i32>,
    /// The Kafka offset, where it concerns a record.
    pub kafka_offset: Option<i64>,
}

/// The trace of one order or event.
#[derive(Debug, Serialize)]
pub struct Trace {
    /// The order.
    pub aggregate_id: String,
    /// The event, when one was asked for.
    pub event_id: Option<Uuid>,
    /// Every step, oldest first.
    pub steps: Vec<Step>,
}

/// Reads the trace of `id`: an event id (a UUID the outbox knows) or an order id.
pub async fn read(targets: &Targets, id: &str) -> anyhow::Result<Trace> {
    // PostgreSQL's text refuses NUL: no order, event or schedule holds one.
    if id.contains('\0') {
        return Err(crate::error::BadInput::Refused(
            "an id cannot hold a NUL character".to_owned(),
        )
        .into());
    }
    // Names first: a group nothing knows is reported whatever else answers.
    let groups = targets.groups(KnownBy::Database).await?;
    let outbox = targets.outbox().await?;
    let event_id = Uuid::parse_str(id).ok();
    let aggregate_id = match event_id {
        Some(event) => {
            sqlx::query_scalar::<_, String>("SELECT aggregate_id FROM outbox WHERE event_id = $1")
                .bind(event)
                .fetch_optional(&outbox)
                .await?
        }
        None => None,
    };
    // A schedule's name stands for its events' aggregate.
    let schedule_aggregate: Option<String> = match aggregate_id {
        Some(_) => None,
        None => {
            sqlx::query_scalar("SELECT aggregate_id FROM outbox_schedule WHERE name = $1")
                .bind(id)
                .fetch_optional(&outbox)
                .await?
        }
    };
    let (aggregate_id, event_id) = match (aggregate_id, event_id, schedule_aggregate) {
        (Some(order), Some(event), _) => (order, Some(event)),
        (_, _, Some(aggregate)) => (aggregate, None),
        _ => (id.to_owned(), None),
    };
    let mut steps: Vec<Step> = sqlx::query_as(
        "SELECT at, 'outbox' AS place, transition, event_id, sequence, event_type, detail,
                kafka_partition, kafka_offset
         FROM outbox_history
         WHERE aggregate_id = $1 AND ($2::uuid IS NULL OR event_id = $2)",
    )
    .bind(&aggregate_id)
    .bind(event_id)
    .fetch_all(&outbox)
    .await?;
    // Occurrences of the schedules whose events are this aggregate's, and changes to them.
    let scheduled: Vec<Step> = sqlx::query_as(
        "SELECT c.recorded_at AS at, 'schedule' AS place, 'occurrence_' || c.outcome AS transition,
                c.event_id, NULL::bigint AS sequence, s.event_type,
                format('%s: fire time %s (relay epoch %s)', c.schedule, c.fire_at,
                       COALESCE(c.relay_epoch::text, '-')) AS detail,
                NULL::integer AS kafka_partition, NULL::bigint AS kafka_offset
         FROM outbox_schedule_occurrence c JOIN outbox_schedule s ON s.name = c.schedule
         WHERE s.aggregate_id = $1 AND ($2::uuid IS NULL OR c.event_id = $2)
         UNION ALL
         SELECT x.acted_at, 'schedule', x.action, x.event_id, NULL, NULL,
                format('%s by %s: %s', x.detail ->> 'schedule', x.actor, x.reason), NULL, NULL
         FROM operator_action x
         WHERE x.aggregate_id = $1 AND x.action LIKE 'schedule.%'
           AND ($2::uuid IS NULL OR x.event_id = $2)",
    )
    .bind(&aggregate_id)
    .bind(event_id)
    .fetch_all(&outbox)
    .await?;
    steps.extend(scheduled);
    // Operators' actions on delayed events (published early, cancelled): the outbox's history
    // shows the events themselves, these say who acted and why.
    let delayed_actions: Vec<Step> = sqlx::query_as(
        "SELECT x.acted_at AS at, 'outbox' AS place, x.action AS transition, x.event_id,
                NULL::bigint AS sequence, x.detail ->> 'event_type' AS event_type,
                format('by %s: %s', x.actor, x.reason) AS detail,
                NULL::integer AS kafka_partition, NULL::bigint AS kafka_offset
         FROM operator_action x
         WHERE x.aggregate_id = $1 AND x.action LIKE 'outbox.delayed.%'
           AND ($2::uuid IS NULL OR x.event_id = $2)",
    )
    .bind(&aggregate_id)
    .bind(event_id)
    .fetch_all(&outbox)
    .await?;
    steps.extend(delayed_actions);
    for group in groups {
        let pool = targets.group(&group).await?;
        let mut rows: Vec<Step> = sqlx::query_as(
            "SELECT at, transition, event_id, sequence, event_type, detail,
                    partition AS kafka_partition, kafka_offset
             FROM group_history
             WHERE group_name = $1
               AND ((aggregate_id = $2 AND ($3::uuid IS NULL OR event_id = $3))
                    -- A reprocess, a pause or a resume acts on the whole group: it shows in
                    -- every order's trace.
                    OR (aggregate_id IS NULL AND transition = ANY ($4)))",
        )
        .bind(targets.qualified(&group))
        .bind(&aggregate_id)
        .bind(event_id)
        .bind(&GROUP_WIDE[..])
        .fetch_all(&pool)
        .await?;
        // Dead letters without an order whose record's key is `id` (escaped): their steps are
        // found by their record, and the operators' actions by the letter.
        let key = unescape(id).unwrap_or_else(|_| id.as_bytes().to_vec());
        let unnamed: Vec<Step> = sqlx::query_as(
            "WITH letter AS (
                 SELECT id, topic, partition, kafka_offset FROM dead_letter
                 WHERE group_name = $1 AND key = $2 AND aggregate_id IS NULL)
             SELECT t.at, t.transition, t.event_id, t.sequence, t.event_type, t.detail,
                    t.partition AS kafka_partition, t.kafka_offset
             FROM group_transition t
             JOIN letter l ON (l.topic, l.partition, l.kafka_offset) = (t.topic, t.partition, t.kafka_offset)
             WHERE t.group_name = $1 AND t.aggregate_id IS NULL
             UNION ALL
             SELECT x.acted_at, x.action, x.event_id, NULL, NULL,
                    format('by %s: %s', x.actor, x.reason), l.partition, l.kafka_offset
             FROM operator_action x
             JOIN letter l ON x.detail ->> 'dead_letter' = l.id::text
             WHERE x.group_name = $1",
        )
        .bind(targets.qualified(&group))
        .bind(&key)
        .fetch_all(&pool)
        .await?;
        rows.extend(unnamed);
        for row in &mut rows {
            row.place.clone_from(&group);
        }
        steps.extend(rows);
    }
    // Group-wide actions from before the order existed say nothing about it.
    let group_wide = |s: &Step| GROUP_WIDE.contains(&s.transition.as_str());
    let first = steps.iter().filter(|s| !group_wide(s)).map(|s| s.at).min();
    steps.retain(|s| !group_wide(s) || first.is_some_and(|f| s.at >= f));
    if steps.is_empty() {
        return Err(BadInput::NotFound {
            what: "order or event",
            id: id.to_owned(),
        }
        .into());
    }
    // Time order; within one instant, the outbox's steps before the groups', then by sequence,
    // an event's writing before the rest (a streamed event is published "at" its writing).
    steps.sort_by(|a, b| {
        let key = |s: &Step| {
            (
                s.at,
                s.place != "outbox",
                s.sequence,
                s.transition != "written",
            )
        };
        key(a).cmp(&key(b))
    });
    Ok(Trace {
        aggregate_id,
        event_id,
        steps,
    })
}

/// Where a step's Kafka record is, as `partition/offset`: `offset unknown` for a write Kafka
/// confirmed without its offset, `-` where no record is concerned.
pub fn position(partition: Option<i32>, offset: Option<i64>) -> String {
    match (partition, offset) {
        (Some(p), Some(o)) => format!("{p}/{o}"),
        (Some(p), None) => format!("{p}/offset unknown"),
        (None, _) => "-".to_owned(),
    }
}

/// Prints the trace as a table.
pub fn print(trace: &Trace) {
    match trace.event_id {
        Some(e) => println!(
            "event {e} of order {}",
            escape(trace.aggregate_id.as_bytes())
        ),
        None => println!("order {}", escape(trace.aggregate_id.as_bytes())),
    }
    let mut t = table(&[
        "at",
        "where",
        "what",
        "seq",
        "event",
        "partition/offset",
        "detail",
    ]);
    for s in &trace.steps {
        crate::output::row(
            &mut t,
            vec![
                s.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                s.place.clone(),
                s.transition.clone(),
                cell(s.sequence),
                cell(
                    s.event_type
                        .clone()
                        .or_else(|| s.event_id.map(|e| e.to_string())),
                ),
                position(s.kafka_partition, s.kafka_offset),
                s.detail
                    .as_deref()
                    .map(|d| escape(d.as_bytes()).into_owned())
                    .unwrap_or_default(),
            ],
        );
    }
    println!("{t}");
}

#[cfg(test)]
mod tests {
    use super::position;

    #[test]
    fn a_record_s_position_says_when_its_offset_is_unknown() {
        assert_eq!(position(Some(3), Some(42)), "3/42");
        assert_eq!(position(Some(3), None), "3/offset unknown");
        assert_eq!(position(None, None), "-");
    }
}
