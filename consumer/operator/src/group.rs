//! `pipeline group pause GROUP --note WHY` and `pipeline group resume GROUP --note WHY`: stop a
//! consumer group taking new batches, everywhere it runs, and let it go on.
//!
//! A pause is a row of `group_pause` in the group's database, written with the record of the
//! action (`operator_action`, `group.pause`: who and why) in one transaction; a resume removes the
//! row and records `group.resume` the same way. Every consumer process running the group reads
//! the row every second (see `consumer::pause`): its members finish the batch in flight, commit
//! its offsets, start no new batch and pause their partitions' fetch, while staying in the group
//! with their partitions; on resume they go on where they stopped. Nothing is lost or applied
//! twice, and the group's lag grows while it is paused.
//!
//! Both are idempotent: pausing a paused group, or resuming a running one, changes nothing and
//! records nothing, and says so ([`GroupPause::changed`] is false, and the pause in force is kept
//! as it was: its time, actor and note). Running one again after an interruption is safe.
//!
//! [`pause()`], [`resume`] and [`state`] print nothing, for any caller (the command prints their
//! results with [`print()`]).

use pipeline_core::record::escape;
use serde::Serialize;
use sqlx::PgPool;

pub use consumer::operator::PausedSince;

use crate::args::GroupAction;
use crate::error::BadInput;
use crate::output::age;
use crate::targets::{KnownBy, Targets};

/// What a pause or a resume did.
#[derive(Debug, Clone, Serialize)]
pub struct GroupPause {
    /// The group (its name without the prefix).
    pub group: String,
    /// Whether the group is paused now.
    pub paused: bool,
    /// False when it already was in that state: nothing was changed or recorded.
    pub changed: bool,
    /// After a pause, the pause in force (an earlier one when the group already was paused);
    /// after a resume, the pause it ended (`None` when the group was running).
    pub pause: Option<PausedSince>,
}

/// Pauses `group` (a name without the prefix; it must be known, see [`crate::targets`]): records
/// `actor` and `note` in `group_pause` and `operator_action`, in one transaction. A paused group
/// stays as it was paused (see the module's documentation).
pub async fn pause(
    targets: &Targets,
    group: &str,
    actor: &str,
    note: &str,
) -> anyhow::Result<GroupPause> {
    let (pool, name) = checked(targets, group, actor, note).await?;
    // The pause may be lifted between a conflicting insert and the read of the pause that
    // conflicted: then the insert is tried again.
    for _ in 0..3 {
        let mut tx = pool.begin().await?;
        let inserted: Option<PausedSince> = sqlx::query_as(
            "INSERT INTO group_pause (group_name, actor, note) VALUES ($1, $2, $3)
             ON CONFLICT (group_name) DO NOTHING
             RETURNING paused_at AS since, actor, note",
        )
        .bind(&name)
        .bind(actor)
        .bind(note)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(paused) = inserted {
            let _ = sqlx::query(
                "INSERT INTO operator_action (actor, action, reason, group_name)
                 VALUES ($1, 'group.pause', $2, $3)",
            )
            .bind(actor)
            .bind(note)
            .bind(&name)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(GroupPause {
                group: group.to_owned(),
                paused: true,
                changed: true,
                pause: Some(paused),
            });
        }
        tx.rollback().await?;
        if let Some(existing) = consumer::operator::pause_state(&pool, &name).await? {
            return Ok(GroupPause {
                group: group.to_owned(),
                paused: true,
                changed: false,
                pause: Some(existing),
            });
        }
    }
    anyhow::bail!("group {group} was paused and resumed again and again meanwhile: try again")
}

/// Resumes `group` (a name without the prefix; it must be known): removes its pause and records
/// `actor` and `note` in `operator_action` with the pause it ended, in one transaction. A running
/// group stays as it is (see the module's documentation).
pub async fn resume(
    targets: &Targets,
    group: &str,
    actor: &str,
    note: &str,
) -> anyhow::Result<GroupPause> {
    let (pool, name) = checked(targets, group, actor, note).await?;
    let mut tx = pool.begin().await?;
    let ended: Option<PausedSince> = sqlx::query_as(
        "DELETE FROM group_pause WHERE group_name = $1
         RETURNING paused_at AS since, actor, note",
    )
    .bind(&name)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(ended) = &ended {
        let _ = sqlx::query(
            "INSERT INTO operator_action (actor, action, reason, group_name, detail)
             VALUES ($1, 'group.resume', $2, $3,
                     jsonb_build_object('paused_at', $4::timestamptz, 'paused_by', $5::text,
                                        'pause_note', $6::text))",
        )
        .bind(actor)
        .bind(note)
        .bind(&name)
        .bind(ended.since)
        .bind(&ended.actor)
        .bind(&ended.note)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(GroupPause {
        group: group.to_owned(),
        paused: false,
        changed: ended.is_some(),
        pause: ended,
    })
}

/// The pause of the group whose id is `group_id` (its name with the prefix, as its rows carry it:
/// [`Targets::qualified`]) in its database `pool`, or `None` while it runs.
pub async fn state(pool: &PgPool, group_id: &str) -> anyhow::Result<Option<PausedSince>> {
    Ok(consumer::operator::pause_state(pool, group_id).await?)
}

/// Refuses a missing actor or note and an unknown group; returns the group's database and id.
async fn checked(
    targets: &Targets,
    group: &str,
    actor: &str,
    note: &str,
) -> anyhow::Result<(PgPool, String)> {
    if actor.trim().is_empty() {
        return Err(BadInput::NoActor.into());
    }
    if note.trim().is_empty() {
        return Err(
            BadInput::Refused("say why: --note WHY (kept with the change)".to_owned()).into(),
        );
    }
    targets.check_known(group, KnownBy::Database).await?;
    Ok((targets.group(group).await?, targets.qualified(group)))
}

/// Runs `action`, printing its result.
pub async fn run(targets: &Targets, action: &GroupAction, json: bool) -> anyhow::Result<()> {
    let done = match action {
        // The group first, so that an unknown one is the error shown, not a missing actor.
        GroupAction::Pause { group, change } => {
            targets.check_known(group, KnownBy::Database).await?;
            pause(targets, group, &change.actor()?, &change.note).await?
        }
        GroupAction::Resume { group, change } => {
            targets.check_known(group, KnownBy::Database).await?;
            resume(targets, group, &change.actor()?, &change.note).await?
        }
    };
    if json {
        crate::output::json(&done)
    } else {
        print(&done);
        Ok(())
    }
}

/// Prints what a pause or a resume did.
pub fn print(done: &GroupPause) {
    let g = &done.group;
    match (done.paused, done.changed, &done.pause) {
        (true, true, _) => println!(
            "group {g} paused: within about a second its members finish the batch in flight, \
             commit it and take no new one; they keep their partitions. Its lag grows until \
             `pipeline group resume {g} --note WHY`."
        ),
        (true, false, Some(p)) => println!(
            "group {g} was already paused ({}); nothing changed",
            describe(p)
        ),
        (false, true, Some(p)) => println!(
            "group {g} resumed (it was {}): its members go on where they stopped within about a \
             second",
            describe(p)
        ),
        _ => println!("group {g} is not paused; nothing changed"),
    }
}

/// "paused since `time` (`age` ago) by `actor`: `note`".
pub fn describe(p: &PausedSince) -> String {
    let ago = (chrono::Utc::now() - p.since).num_milliseconds().max(0) as f64 / 1000.0;
    format!(
        "paused since {} ({} ago) by {}: {}",
        p.since.format("%Y-%m-%d %H:%M:%S UTC"),
        age(ago),
        escape(p.actor.as_bytes()),
        escape(p.note.as_bytes())
    )
}
