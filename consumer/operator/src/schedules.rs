//! `pipeline schedules`: the outbox's recurring schedules: list them with their next fire times,
//! show one with its last occurrences and where their events are, add, pause, resume, remove,
//! and run one now. Every change is made through the outbox library (`outbox::schedule`), in a
//! transaction that records it in `operator_action` with who and why (it shows in `trace` of the
//! schedule's aggregate, or of the schedule's name).

use chrono::{DateTime, Utc};
use outbox::schedule::{self, NewSchedule, Occurrence, ScheduleError, ScheduleRow};
use outbox::Outbox;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::args::{AddScheduleArgs, ScheduleAction};
use crate::error::BadInput;
use crate::output::{cell, table};
use crate::targets::Targets;

/// Occurrences `show` lists.
const SHOWN_OCCURRENCES: i64 = 10;
/// Fire times ahead `list` and `show` print.
const SHOWN_NEXT: usize = 5;

/// A schedule with its next fire times.
#[derive(Debug, Serialize)]
pub struct Listed {
    /// The schedule as stored.
    #[serde(flatten)]
    pub schedule: ScheduleRow,
    /// Its next fire times (none while paused), with the wall-clock time in its zone.
    pub next: Vec<(DateTime<Utc>, String)>,
}

/// One schedule, its next fire times and its last occurrences.
#[derive(Debug, Serialize)]
pub struct Shown {
    /// The schedule and its next fire times.
    #[serde(flatten)]
    pub listed: Listed,
    /// Its last occurrences, newest first.
    pub occurrences: Vec<Occurrence>,
}

/// Runs `action`, printing its result.
pub async fn run(targets: &Targets, action: &ScheduleAction, json: bool) -> anyhow::Result<()> {
    let pool = targets.outbox().await?;
    match action {
        ScheduleAction::List => {
            let listed = list(&pool).await?;
            if json {
                return crate::output::json(&listed);
            }
            print_list(&listed);
        }
        ScheduleAction::Show { name } => {
            let shown = show(&pool, name).await?;
            if json {
                return crate::output::json(&shown);
            }
            print_list(std::slice::from_ref(&shown.listed));
            print_occurrences(&shown.occurrences);
        }
        ScheduleAction::Add(args) => {
            let row = add(&pool, args).await?;
            report(json, "added", &row)?;
        }
        ScheduleAction::Pause { name, change } | ScheduleAction::Resume { name, change } => {
            let enable = matches!(action, ScheduleAction::Resume { .. });
            let mut tx = pool.begin().await?;
            let row = schedule::set_enabled(&mut tx, name, enable)
                .await
                .map_err(bad_input)?;
            let what = if enable {
                "schedule.resume"
            } else {
                "schedule.pause"
            };
            record(
                &mut tx,
                &change.actor()?,
                what,
                &change.note,
                &row,
                None,
                serde_json::json!({}),
            )
            .await?;
            tx.commit().await?;
            report(json, if enable { "resumed" } else { "paused" }, &row)?;
        }
        ScheduleAction::Remove { name, change } => {
            let mut tx = pool.begin().await?;
            let row = schedule::remove_schedule(&mut tx, name)
                .await
                .map_err(bad_input)?;
            record(
                &mut tx,
                &change.actor()?,
                "schedule.remove",
                &change.note,
                &row,
                None,
                serde_json::json!({"cron": row.cron, "time_zone": row.time_zone}),
            )
            .await?;
            tx.commit().await?;
            report(json, "removed", &row)?;
        }
        ScheduleAction::RunNow { name, change } => {
            let mut tx = pool.begin().await?;
            let (at, event_id) = schedule::run_now(&mut tx, &Outbox::default(), name)
                .await
                .map_err(bad_input)?;
            let row = schedule::get_schedule(&mut tx, name)
                .await
                .map_err(bad_input)?;
            record(
                &mut tx,
                &change.actor()?,
                "schedule.run_now",
                &change.note,
                &row,
                Some(event_id),
                serde_json::json!({"fire_at": at}),
            )
            .await?;
            tx.commit().await?;
            if json {
                return crate::output::json(&serde_json::json!({
                    "schedule": name, "fire_at": at, "event_id": event_id
                }));
            }
            println!(
                "schedule {name}: one extra occurrence at {at}, event {event_id}; the relay \
                 publishes it within its release interval"
            );
        }
    }
    Ok(())
}

/// Every schedule with its next fire times.
pub async fn list(pool: &PgPool) -> anyhow::Result<Vec<Listed>> {
    let rows = schedule::list_schedules(&mut *pool.acquire().await?).await?;
    Ok(rows.into_iter().map(with_next).collect())
}

/// One schedule, its next fire times and its last occurrences.
pub async fn show(pool: &PgPool, name: &str) -> anyhow::Result<Shown> {
    let mut conn = pool.acquire().await?;
    let row = schedule::get_schedule(&mut conn, name)
        .await
        .map_err(bad_input)?;
    let occurrences = schedule::occurrences(&mut conn, name, SHOWN_OCCURRENCES).await?;
    Ok(Shown {
        listed: with_next(row),
        occurrences,
    })
}

fn with_next(schedule: ScheduleRow) -> Listed {
    let next = match (schedule.enabled, schedule.times()) {
        (true, Ok(times)) => {
            let from = schedule
                .next_fire_at
                .map_or_else(Utc::now, |t| t - chrono::Duration::microseconds(1));
            times
                .after(from)
                .take(SHOWN_NEXT)
                .map(|t| (t, times.local(t)))
                .collect()
        }
        _ => Vec::new(),
    };
    Listed { schedule, next }
}

/// Adds the schedule `args` describe.
pub async fn add(pool: &PgPool, args: &AddScheduleArgs) -> anyhow::Result<ScheduleRow> {
    let payload: serde_json::Value = serde_json::from_str(&args.payload)
        .map_err(|e| BadInput::Refused(format!("--payload is not JSON: {e}")))?;
    let new = NewSchedule {
        name: args.name.clone(),
        cron: args.cron.clone(),
        time_zone: args.time_zone.clone(),
        event_type: args.event_type.clone(),
        aggregate_id: args
            .aggregate
            .clone()
            .unwrap_or_else(|| format!("schedule:{}", args.name)),
        topic: args.topic.clone(),
        payload,
        missed: args.missed,
    };
    let mut tx = pool.begin().await?;
    let row = schedule::add_schedule(&mut tx, &Outbox::default(), &new)
        .await
        .map_err(bad_input)?;
    record(
        &mut tx,
        &args.change.actor()?,
        "schedule.add",
        &args.change.note,
        &row,
        None,
        serde_json::json!({
            "cron": row.cron, "time_zone": row.time_zone, "missed": row.missed,
            "event_type": row.event_type, "topic": row.topic,
        }),
    )
    .await?;
    tx.commit().await?;
    Ok(row)
}

/// A schedule error the operator can fix is bad input (exit status 2); the database's is not.
fn bad_input(e: ScheduleError) -> anyhow::Error {
    match e {
        ScheduleError::Database(e) => e.into(),
        other => BadInput::Refused(other.to_string()).into(),
    }
}

/// Records an action on `schedule` (under its aggregate, so `trace` shows it).
async fn record(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    actor: &str,
    action: &str,
    note: &str,
    schedule: &ScheduleRow,
    event_id: Option<Uuid>,
    detail: serde_json::Value,
) -> anyhow::Result<()> {
    let mut detail = detail;
    detail["schedule"] = serde_json::Value::String(schedule.name.clone());
    sqlx::query(
        "INSERT INTO operator_action (actor, action, reason, event_id, aggregate_id, detail)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(actor)
    .bind(action)
    .bind(note)
    .bind(event_id)
    .bind(&schedule.aggregate_id)
    .bind(detail)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn report(json: bool, what: &str, row: &ScheduleRow) -> anyhow::Result<()> {
    if json {
        return crate::output::json(row);
    }
    println!(
        "schedule {} {what}: {} ({}), next {}",
        row.name,
        row.cron,
        row.time_zone,
        cell(row.next_fire_at)
    );
    Ok(())
}

fn print_list(listed: &[Listed]) {
    let mut t = table(&[
        "schedule",
        "cron",
        "zone",
        "event",
        "aggregate",
        "missed",
        "state",
        "next fire times",
    ]);
    for l in listed {
        let s = &l.schedule;
        crate::output::row(
            &mut t,
            vec![
                s.name.clone(),
                s.cron.clone(),
                s.time_zone.clone(),
                format!("{} → {}", s.event_type, s.topic),
                s.aggregate_id.clone(),
                s.missed.clone(),
                if s.enabled { "active" } else { "paused" }.to_owned(),
                l.next
                    .iter()
                    .map(|(_, local)| local.clone())
                    .collect::<Vec<_>>()
                    .join("\n"),
            ],
        );
    }
    println!("{t}");
}

fn print_occurrences(occurrences: &[Occurrence]) {
    let mut t = table(&[
        "fire time",
        "outcome",
        "event",
        "event state",
        "relay epoch",
    ]);
    for o in occurrences {
        crate::output::row(
            &mut t,
            vec![
                o.fire_at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                o.outcome.clone(),
                cell(o.event_id),
                cell(o.event_state.clone()),
                cell(o.relay_epoch),
            ],
        );
    }
    println!("{t}");
}
