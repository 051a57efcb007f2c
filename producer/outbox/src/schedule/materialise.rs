//! Due occurrences to delayed events: what the active relay runs, in a transaction it fenced
//! with its lease epoch.
//!
//! For each schedule whose next occurrence is due, the occurrences from it up to now are
//! decided by the schedule's missed-occurrence policy. On time (the relay active), that is one
//! occurrence, fired. After a time with no relay active: `all` fires every one, in order;
//! `latest` fires the latest and records the others `skipped`; `skip` fires none more than
//! [`MISSED_GRACE`] late. Each occurrence's row (schedule, fire time) is inserted first, and only
//! an occurrence whose row was new gets its event: an occurrence is materialised once, whichever
//! relay gets to it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::occurrence::occurrence_event;
use super::store::ScheduleRow;
use super::{Missed, ScheduleError};
use crate::delay::PublishAt;
use crate::{NewEvent, Outbox};

/// How late an occurrence of a `skip` schedule may be and still fire.
pub const MISSED_GRACE: Duration = Duration::from_secs(60);

/// Most occurrences one schedule materialises (fired or skipped) in one step; the rest follow in
/// the next.
const MOST_PER_STEP: usize = 1_000;

/// What one step did for one schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Materialised {
    /// The schedule.
    pub schedule: String,
    /// Occurrences fired: fire time and event.
    pub fired: Vec<(DateTime<Utc>, Uuid)>,
    /// Occurrences the missed-occurrence policy passed over.
    pub skipped: usize,
}

/// Materialises, in `tx`, every occurrence due at `now` of the schedules whose next occurrence is
/// due (up to 50 schedules, skipping any another transaction holds), recording `epoch` (the
/// relay's lease epoch) with each. The caller has fenced `tx`.
pub async fn materialise_due(
    tx: &mut Transaction<'_, Postgres>,
    outbox: &Outbox,
    now: DateTime<Utc>,
    epoch: Option<i64>,
) -> Result<Vec<Materialised>, ScheduleError> {
    let due: Vec<ScheduleRow> = sqlx::query_as(
        "SELECT name, cron, time_zone, event_type, aggregate_id, topic, payload, missed,
                enabled, next_fire_at, created_at, updated_at
         FROM outbox_schedule
         WHERE enabled AND next_fire_at <= $1
         ORDER BY next_fire_at LIMIT 50
         FOR UPDATE SKIP LOCKED",
    )
    .bind(now)
    .fetch_all(&mut **tx)
    .await?;
    let mut done = Vec::with_capacity(due.len());
    for row in due {
        done.push(materialise_one(tx, outbox, &row, now, epoch).await?);
    }
    Ok(done)
}

async fn materialise_one(
    tx: &mut Transaction<'_, Postgres>,
    outbox: &Outbox,
    row: &ScheduleRow,
    now: DateTime<Utc>,
    epoch: Option<i64>,
) -> Result<Materialised, ScheduleError> {
    let times = row.times()?;
    let policy: Missed = row.missed.parse().unwrap_or(Missed::Latest);
    let Some(first) = row.next_fire_at else {
        return Ok(Materialised {
            schedule: row.name.clone(),
            fired: Vec::new(),
            skipped: 0,
        });
    };
    let mut due = vec![first];
    due.extend(
        times
            .after(first)
            .take_while(|t| *t <= now)
            .take(MOST_PER_STEP - 1),
    );
    let last = *due.last().unwrap_or(&first);
    let fire: Vec<DateTime<Utc>> = match policy {
        Missed::All => due.clone(),
        Missed::Latest => vec![last],
        Missed::Skip => {
            let grace = chrono::Duration::from_std(MISSED_GRACE).unwrap_or_default();
            due.iter().copied().filter(|t| now - *t <= grace).collect()
        }
    };
    let skip: Vec<DateTime<Utc>> = due.iter().copied().filter(|t| !fire.contains(t)).collect();
    // The rows first: only occurrences new to the table get an event.
    let new_fired: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "INSERT INTO outbox_schedule_occurrence (schedule, fire_at, outcome, relay_epoch)
         SELECT $1, t, 'fired', $3 FROM unnest($2::timestamptz[]) AS t
         ON CONFLICT (schedule, fire_at) DO NOTHING
         RETURNING fire_at",
    )
    .bind(&row.name)
    .bind(&fire)
    .bind(epoch)
    .fetch_all(&mut **tx)
    .await?;
    let skipped = sqlx::query(
        "INSERT INTO outbox_schedule_occurrence (schedule, fire_at, outcome, relay_epoch)
         SELECT $1, t, 'skipped', $3 FROM unnest($2::timestamptz[]) AS t
         ON CONFLICT (schedule, fire_at) DO NOTHING",
    )
    .bind(&row.name)
    .bind(&skip)
    .bind(epoch)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    let events: Vec<(NewEvent, PublishAt)> = new_fired
        .iter()
        .map(|t| {
            let event = occurrence_event(
                &row.name,
                &row.event_type,
                &row.aggregate_id,
                &row.topic,
                &row.payload,
                *t,
                &times,
                "",
            );
            (event, PublishAt::At(*t))
        })
        .collect();
    let delayed = outbox.enqueue_all_at(tx, &events).await?;
    let fired: Vec<(DateTime<Utc>, Uuid)> = new_fired
        .iter()
        .copied()
        .zip(delayed.iter().map(|d| d.event_id()))
        .collect();
    if !fired.is_empty() {
        let (at, ids): (Vec<DateTime<Utc>>, Vec<Uuid>) = fired.iter().copied().unzip();
        sqlx::query(
            "UPDATE outbox_schedule_occurrence c SET event_id = u.id
             FROM unnest($2::timestamptz[], $3::uuid[]) AS u(at, id)
             WHERE c.schedule = $1 AND c.fire_at = u.at",
        )
        .bind(&row.name)
        .bind(&at)
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
    }
    let next = times.after(last).next();
    sqlx::query(
        "UPDATE outbox_schedule SET next_fire_at = $2, updated_at = clock_timestamp()
         WHERE name = $1",
    )
    .bind(&row.name)
    .bind(next)
    .execute(&mut **tx)
    .await?;
    Ok(Materialised {
        schedule: row.name.clone(),
        fired,
        skipped: usize::try_from(skipped).unwrap_or(0),
    })
}
