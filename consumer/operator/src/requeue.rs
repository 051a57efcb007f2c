//! `pipeline outbox requeue`: failed events back to pending. The relay then publishes each one
//! and, behind it, the later events of its order that it held, in sequence order. The event's
//! attempts start again from zero, its earlier attempts stay in its history, and the requeue is
//! recorded (who, why) in the same transaction.

use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::args::RequeueArgs;
use crate::error::BadInput;
use crate::output::table;

/// An event set back to pending.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Requeued {
    /// The event.
    pub event_id: Uuid,
    /// Its order.
    pub aggregate_id: String,
    /// Its sequence within the order.
    pub sequence: i64,
    /// Attempts it had made.
    pub attempts: i32,
    /// Its last error.
    pub last_error: Option<String>,
}

/// Requeues the failed events `args` selects, all or none.
pub async fn requeue(pool: &PgPool, args: &RequeueArgs) -> anyhow::Result<Vec<Requeued>> {
    if args.events.is_empty() && args.aggregate.is_none() && args.error.is_none() && !args.all {
        return Err(BadInput::Refused(
            "say which failed events: --event, --aggregate, --error or --all".to_owned(),
        )
        .into());
    }
    for event_id in &args.events {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM outbox_status WHERE event_id = $1")
                .bind(event_id)
                .fetch_optional(pool)
                .await?;
        match state.as_deref() {
            None => {
                return Err(BadInput::NotFound {
                    what: "outbox event",
                    id: event_id.to_string(),
                }
                .into())
            }
            Some("failed") => {}
            Some(other) => {
                return Err(BadInput::NotFailed {
                    event_id: *event_id,
                    state: other.to_owned(),
                }
                .into())
            }
        }
    }
    // Who acts, once what to requeue is known to make sense.
    let actor = args.change.actor()?;
    let events: Option<&[Uuid]> = (!args.events.is_empty()).then_some(args.events.as_slice());
    let mut tx = pool.begin().await?;
    let requeued: Vec<Requeued> = sqlx::query_as(
        "WITH target AS (
             SELECT u.id, o.event_id, o.aggregate_id, o.sequence, u.attempts, u.last_error
             FROM outbox_unpublished u JOIN outbox o ON o.id = u.id
             WHERE u.state = 'failed' AND u.attempts > 0
               AND ($1::uuid[] IS NULL OR o.event_id = ANY ($1))
               AND ($2::text IS NULL OR u.aggregate_id = $2)
               AND ($3::text IS NULL OR strpos(u.last_error, $3) > 0)
             ORDER BY u.id
             FOR UPDATE OF u),
         pending AS (
             UPDATE outbox_unpublished u
             SET state = 'pending', attempts = 0, next_attempt_at = '-infinity'
             FROM target t WHERE u.id = t.id
             RETURNING u.id),
         recorded AS (
             INSERT INTO operator_action (actor, action, reason, event_id, aggregate_id, detail)
             SELECT $4, 'outbox.requeue', $5, t.event_id, t.aggregate_id,
                    jsonb_build_object('attempts', t.attempts, 'last_error', t.last_error)
             FROM target t ORDER BY t.id
             RETURNING 1)
         SELECT t.event_id, t.aggregate_id, t.sequence, t.attempts, t.last_error
         FROM target t
         WHERE (SELECT count(*) FROM pending) = (SELECT count(*) FROM recorded)
         ORDER BY t.id",
    )
    .bind(events)
    .bind(&args.aggregate)
    .bind(&args.error)
    .bind(&actor)
    .bind(&args.change.note)
    .fetch_all(&mut *tx)
    .await?;
    if requeued.is_empty() {
        return Err(BadInput::NothingMatches("no failed outbox event matches".to_owned()).into());
    }
    // No insert announces a requeue: wake a waiting relay now rather than at its safety poll.
    outbox::notify_relay(&mut tx).await?;
    tx.commit().await?;
    Ok(requeued)
}

/// Prints what was requeued.
pub fn print(requeued: &[Requeued]) {
    let mut t = table(&[
        "requeued event",
        "order",
        "sequence",
        "attempts",
        "last error",
    ]);
    for r in requeued {
        crate::output::row(
            &mut t,
            vec![
                r.event_id.to_string(),
                r.aggregate_id.clone(),
                r.sequence.to_string(),
                r.attempts.to_string(),
                r.last_error.clone().unwrap_or_default(),
            ],
        );
    }
    println!("{t}");
    println!(
        "{} event(s) requeued: the relay publishes them and their orders' held events in order",
        requeued.len()
    );
}
