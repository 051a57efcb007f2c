//! Delayed events (appended with an earliest publish time, waiting in `outbox_delayed` until the
//! active relay moves them into the outbox): the next ones due, and two actions, each recorded
//! in `operator_action` in the same transaction and shown by `trace`:
//! - publish now: the event falls due at once, and the relay moves it on its next pass;
//! - cancel: withdrawn through the outbox library's [`outbox::cancel_delayed`], as the service
//!   that appended it would (an event already moved into the outbox is published whatever).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::BadInput;

/// A delayed event as listed.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct DelayedEvent {
    /// The event's id.
    pub event_id: Uuid,
    /// Its aggregate (order).
    pub aggregate_id: String,
    /// Its type.
    pub event_type: String,
    /// Its business key.
    pub business_key: String,
    /// The topic it goes to.
    pub topic: String,
    /// When it was appended.
    pub delayed_at: DateTime<Utc>,
    /// Its earliest publish time.
    pub publish_at: DateTime<Utc>,
    /// Already due (waiting for the relay).
    pub due: bool,
}

/// What an action did to one delayed event.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct DelayedChange {
    /// The event.
    pub event_id: Uuid,
    /// Its aggregate.
    pub aggregate_id: String,
    /// Its type.
    pub event_type: String,
}

/// The next `limit` delayed events by publish time (read by the publish-time index).
pub async fn list(pool: &PgPool, limit: i64) -> anyhow::Result<Vec<DelayedEvent>> {
    Ok(sqlx::query_as(
        "SELECT event_id, aggregate_id, event_type, business_key, topic, delayed_at, publish_at,
                publish_at <= clock_timestamp() AS due
         FROM outbox_delayed ORDER BY publish_at, event_id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Makes the delayed events `ids` due now; recorded as `outbox.delayed.publish_now`.
pub async fn publish_now(
    pool: &PgPool,
    ids: &[Uuid],
    actor: &str,
    note: &str,
) -> anyhow::Result<Vec<DelayedChange>> {
    check(ids, actor, note)?;
    let mut tx = pool.begin().await?;
    let changed: Vec<DelayedChange> = sqlx::query_as(
        "WITH target AS (
             SELECT event_id, aggregate_id, event_type, publish_at FROM outbox_delayed
             WHERE event_id = ANY ($1) ORDER BY event_id FOR UPDATE),
         moved AS (
             UPDATE outbox_delayed d SET publish_at = LEAST(d.publish_at, clock_timestamp())
             FROM target t WHERE d.event_id = t.event_id
             RETURNING d.event_id),
         recorded AS (
             INSERT INTO operator_action (actor, action, reason, event_id, aggregate_id, detail)
             SELECT $2, 'outbox.delayed.publish_now', $3, t.event_id, t.aggregate_id,
                    jsonb_build_object('event_type', t.event_type, 'publish_at', t.publish_at)
             FROM target t
             RETURNING 1)
         SELECT t.event_id, t.aggregate_id, t.event_type FROM target t
         WHERE (SELECT count(*) FROM moved) = (SELECT count(*) FROM recorded)
         ORDER BY t.event_id",
    )
    .bind(ids)
    .bind(actor)
    .bind(note)
    .fetch_all(&mut *tx)
    .await?;
    if changed.is_empty() {
        return Err(nothing(ids));
    }
    outbox::notify_relay(&mut tx).await?;
    tx.commit().await?;
    Ok(changed)
}

/// Withdraws the delayed events `ids`; recorded as `outbox.delayed.cancel`.
pub async fn cancel(
    pool: &PgPool,
    ids: &[Uuid],
    actor: &str,
    note: &str,
) -> anyhow::Result<Vec<DelayedChange>> {
    check(ids, actor, note)?;
    let mut tx = pool.begin().await?;
    let rows: Vec<(Uuid, String, String, String)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, event_type, business_key FROM outbox_delayed
         WHERE event_id = ANY ($1) ORDER BY event_id FOR UPDATE",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Err(nothing(ids));
    }
    let facts: Vec<(&str, &str)> = rows
        .iter()
        .map(|(_, _, event_type, key)| (key.as_str(), event_type.as_str()))
        .collect();
    let _ = outbox::cancel_delayed(&mut tx, &facts).await?;
    let mut changed = Vec::with_capacity(rows.len());
    for (event_id, aggregate_id, event_type, business_key) in rows {
        let _ = sqlx::query(
            "INSERT INTO operator_action (actor, action, reason, event_id, aggregate_id, detail)
             VALUES ($1, 'outbox.delayed.cancel', $2, $3, $4,
                     jsonb_build_object('event_type', $5::text, 'business_key', $6::text))",
        )
        .bind(actor)
        .bind(note)
        .bind(event_id)
        .bind(&aggregate_id)
        .bind(&event_type)
        .bind(&business_key)
        .execute(&mut *tx)
        .await?;
        changed.push(DelayedChange {
            event_id,
            aggregate_id,
            event_type,
        });
    }
    tx.commit().await?;
    Ok(changed)
}

fn check(ids: &[Uuid], actor: &str, note: &str) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Err(BadInput::Refused("say which delayed events".to_owned()).into());
    }
    if actor.trim().is_empty() {
        return Err(BadInput::NoActor.into());
    }
    if note.trim().is_empty() {
        return Err(BadInput::Refused("say why (a note)".to_owned()).into());
    }
    Ok(())
}

fn nothing(ids: &[Uuid]) -> anyhow::Error {
    BadInput::NothingMatches(format!(
        "none of {} delayed event(s) is still waiting (already published or cancelled)",
        ids.len()
    ))
    .into()
}
