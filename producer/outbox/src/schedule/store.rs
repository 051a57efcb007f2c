//! The schedules' rows, and what changes them in the caller's transaction: add, pause, resume,
//! remove, run now; and what they did (their occurrences).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::occurrence::occurrence_event;
use super::times::CronTimes;
use super::{NewSchedule, ScheduleError};
use crate::delay::PublishAt;
use crate::{Delayed, Outbox};

/// A schedule as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ScheduleRow {
    /// Its name.
    pub name: String,
    /// Its cron expression.
    pub cron: String,
    /// Its time zone.
    pub time_zone: String,
    /// The event type of its events.
    pub event_type: String,
    /// Their aggregate.
    pub aggregate_id: String,
    /// Their topic.
    pub topic: String,
    /// The payload template.
    pub payload: Value,
    /// The missed-occurrence policy (`latest`, `all`, `skip`).
    pub missed: String,
    /// Paused when false.
    pub enabled: bool,
    /// The next occurrence to materialise (None while paused).
    pub next_fire_at: Option<DateTime<Utc>>,
    /// When it was added.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl ScheduleRow {
    /// Its expression, parsed.
    pub fn times(&self) -> Result<CronTimes, ScheduleError> {
        CronTimes::parse(&self.cron, &self.time_zone)
    }
}

/// One occurrence of a schedule, and where its event is now.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Occurrence {
    /// The schedule.
    pub schedule: String,
    /// Its fire time.
    pub fire_at: DateTime<Utc>,
    /// `fired`, `skipped` (the missed-occurrence policy passed over it) or `run_now`.
    pub outcome: String,
    /// The event it appended.
    pub event_id: Option<Uuid>,
    /// The epoch of the relay that materialised it.
    pub relay_epoch: Option<i64>,
    /// When it was recorded.
    pub recorded_at: DateTime<Utc>,
    /// Where its event is: `delayed` (not released yet), the outbox's state (`pending`,
    /// `failed`, `published`), or None (no event, or removed by retention).
    pub event_state: Option<String>,
}

const COLUMNS: &str = "name, cron, time_zone, event_type, aggregate_id, topic, payload, missed,
                       enabled, next_fire_at, created_at, updated_at";

fn check_name(name: &str) -> Result<(), ScheduleError> {
    let ok = (1..=63).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(ScheduleError::InvalidName(name.to_owned()))
    }
}

/// The least time between two occurrences a schedule may have: the deployment's setting, the one
/// row of `outbox_schedule_floor` (1 minute unless its owner changed it), which
/// [`add_schedule`] holds every schedule to.
pub async fn schedule_floor(conn: impl sqlx::PgExecutor<'_>) -> Result<Duration, ScheduleError> {
    let micros: i64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM least_gap) * 1000000)::bigint FROM outbox_schedule_floor",
    )
    .fetch_one(conn)
    .await?;
    Ok(Duration::from_micros(u64::try_from(micros).unwrap_or(0)))
}

/// Adds `schedule` in `tx`, checked first: its name, expression and time zone, that it never
/// fires more often than the database's floor ([`schedule_floor`]), and that `outbox` would take
/// its events. Its first occurrence is the first after now. A name taken is
/// [`ScheduleError::Duplicate`].
pub async fn add_schedule(
    tx: &mut Transaction<'_, Postgres>,
    outbox: &Outbox,
    schedule: &NewSchedule,
) -> Result<ScheduleRow, ScheduleError> {
    check_name(&schedule.name)?;
    let floor = schedule_floor(&mut **tx).await?;
    let times = CronTimes::parse(&schedule.cron, &schedule.time_zone)?;
    let now = Utc::now();
    let first = times
        .after(now)
        .next()
        .ok_or_else(|| ScheduleError::InvalidCron {
            expression: schedule.cron.clone(),
            reason: "it never fires".to_owned(),
        })?;
    if let Some(every) = times.shortest_gap(now, 200) {
        if every < floor {
            return Err(ScheduleError::TooFrequent {
                expression: schedule.cron.clone(),
                every,
                floor,
            });
        }
    }
    let sample = occurrence_event(
        &schedule.name,
        &schedule.event_type,
        &schedule.aggregate_id,
        &schedule.topic,
        &schedule.payload,
        first,
        &times,
        "",
    );
    outbox.check(&sample)?;
    let row: Option<ScheduleRow> = sqlx::query_as(&format!(
        "INSERT INTO outbox_schedule (name, cron, time_zone, event_type, aggregate_id, topic,
                                      payload, missed, next_fire_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (name) DO NOTHING
         RETURNING {COLUMNS}"
    ))
    .bind(&schedule.name)
    .bind(schedule.cron.trim())
    .bind(schedule.time_zone.trim())
    .bind(&schedule.event_type)
    .bind(&schedule.aggregate_id)
    .bind(&schedule.topic)
    .bind(&schedule.payload)
    .bind(schedule.missed.as_str())
    .bind(first)
    .fetch_optional(&mut **tx)
    .await?;
    row.ok_or_else(|| ScheduleError::Duplicate(schedule.name.clone()))
}

/// Pauses (`false`) or resumes (`true`) the schedule `name` in `tx`. A paused schedule fires
/// nothing; resumed, it fires from its first occurrence after now (what fell due while paused is
/// not fired).
pub async fn set_enabled(
    tx: &mut Transaction<'_, Postgres>,
    name: &str,
    enabled: bool,
) -> Result<ScheduleRow, ScheduleError> {
    let current = one(tx, name, true).await?;
    let next = if enabled {
        current.times()?.after(Utc::now()).next()
    } else {
        None
    };
    let row: ScheduleRow = sqlx::query_as(&format!(
        "UPDATE outbox_schedule SET enabled = $2, next_fire_at = $3, updated_at = clock_timestamp()
         WHERE name = $1 RETURNING {COLUMNS}"
    ))
    .bind(name)
    .bind(enabled)
    .bind(next)
    .fetch_one(&mut **tx)
    .await?;
    Ok(row)
}

/// Removes the schedule `name` and its occurrences' records in `tx`; events it already appended
/// stay (a delayed one is still published).
pub async fn remove_schedule(
    tx: &mut Transaction<'_, Postgres>,
    name: &str,
) -> Result<ScheduleRow, ScheduleError> {
    let row: Option<ScheduleRow> = sqlx::query_as(&format!(
        "DELETE FROM outbox_schedule WHERE name = $1 RETURNING {COLUMNS}"
    ))
    .bind(name)
    .fetch_optional(&mut **tx)
    .await?;
    row.ok_or_else(|| ScheduleError::NotFound(name.to_owned()))
}

/// Every schedule, by name.
pub async fn list_schedules(conn: &mut PgConnection) -> Result<Vec<ScheduleRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM outbox_schedule ORDER BY name"
    ))
    .fetch_all(conn)
    .await
}

/// The schedule `name` ([`ScheduleError::NotFound`] when there is none).
pub async fn get_schedule(
    conn: &mut PgConnection,
    name: &str,
) -> Result<ScheduleRow, ScheduleError> {
    one(conn, name, false).await
}

/// The schedule `name` (locked for the transaction when `lock`).
pub(crate) async fn one(
    conn: &mut PgConnection,
    name: &str,
    lock: bool,
) -> Result<ScheduleRow, ScheduleError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM outbox_schedule WHERE name = $1{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    sqlx::query_as(&sql)
        .bind(name)
        .fetch_optional(conn)
        .await?
        .ok_or_else(|| ScheduleError::NotFound(name.to_owned()))
}

/// An extra occurrence of `name` now, in `tx`: its event is appended as a delayed event due at
/// once (the relay publishes it within its release interval), whatever the schedule's times,
/// and paused or not. Returns the occurrence's time and event.
pub async fn run_now(
    tx: &mut Transaction<'_, Postgres>,
    outbox: &Outbox,
    name: &str,
) -> Result<(DateTime<Utc>, Uuid), ScheduleError> {
    let row = one(tx, name, true).await?;
    let times = row.times()?;
    let at: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut **tx)
        .await?;
    let event = occurrence_event(
        &row.name,
        &row.event_type,
        &row.aggregate_id,
        &row.topic,
        &row.payload,
        at,
        &times,
        ":run-now",
    );
    let event_id = match outbox.enqueue_at(tx, &event, PublishAt::At(at)).await? {
        Delayed::New { event_id, .. } | Delayed::Duplicate { event_id } => event_id,
    };
    sqlx::query(
        "INSERT INTO outbox_schedule_occurrence (schedule, fire_at, outcome, event_id)
         VALUES ($1, $2, 'run_now', $3)",
    )
    .bind(name)
    .bind(at)
    .bind(event_id)
    .execute(&mut **tx)
    .await?;
    Ok((at, event_id))
}

/// The latest `limit` occurrences of `name`, newest first, with where each event is.
pub async fn occurrences(
    conn: &mut PgConnection,
    name: &str,
    limit: i64,
) -> Result<Vec<Occurrence>, sqlx::Error> {
    sqlx::query_as(
        "SELECT c.schedule, c.fire_at, c.outcome, c.event_id, c.relay_epoch, c.recorded_at,
                CASE WHEN d.event_id IS NOT NULL THEN 'delayed' ELSE s.state END AS event_state
         FROM outbox_schedule_occurrence c
         LEFT JOIN outbox_delayed d ON d.event_id = c.event_id
         LEFT JOIN outbox_status s ON s.event_id = c.event_id
         WHERE c.schedule = $1
         ORDER BY c.fire_at DESC LIMIT $2",
    )
    .bind(name)
    .bind(limit)
    .fetch_all(conn)
    .await
}
