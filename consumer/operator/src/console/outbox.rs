//! The outbox's page: failed events (requeue the ones ticked, or an order's) and delayed
//! events (publish now, cancel). Each list shows at most [`LIST_LIMIT`] rows, read by index.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Html;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::delayed::{self, DelayedEvent};
use super::html::{action_footer, esc, layout, opt, unavailable};
use super::refusal::{unanswered, Refusal};
use super::session::{url_encode, Session};
use super::Console;

/// Rows a list shows at most.
pub(super) const LIST_LIMIT: i64 = 500;

/// A failed event, waiting for an operator's requeue.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub(super) struct FailedEvent {
    event_id: Uuid,
    aggregate_id: String,
    sequence: i64,
    event_type: String,
    attempts: i32,
    last_error: Option<String>,
    created_at: DateTime<Utc>,
}

/// `/api/outbox`.
#[derive(Serialize)]
pub(super) struct OutboxData {
    failed: Vec<FailedEvent>,
    delayed: Vec<DelayedEvent>,
    /// Each list stops here.
    limit: i64,
}

/// The oldest failed events (the same rows `pipeline outbox requeue` takes).
async fn failed(pool: &PgPool) -> anyhow::Result<Vec<FailedEvent>> {
    Ok(sqlx::query_as(
        "SELECT o.event_id, o.aggregate_id, o.sequence, o.event_type, u.attempts, u.last_error,
                o.created_at
         FROM outbox_unpublished u JOIN outbox o ON o.id = u.id
         WHERE u.state = 'failed' AND u.attempts > 0
         ORDER BY u.id LIMIT $1",
    )
    .bind(LIST_LIMIT)
    .fetch_all(pool)
    .await?)
}

async fn read(console: &Console) -> anyhow::Result<OutboxData> {
    let pool = console.inner.targets.outbox().await?;
    Ok(OutboxData {
        failed: failed(&pool).await?,
        delayed: delayed::list(&pool, LIST_LIMIT).await?,
        limit: LIST_LIMIT,
    })
}

/// `GET /api/outbox`.
pub(super) async fn api(State(console): State<Console>) -> Result<Json<OutboxData>, Refusal> {
    read(&console)
        .await
        .map(Json)
        .map_err(|e| Refusal::from(e).json())
}

/// `GET /outbox`.
pub(super) async fn page(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
) -> (StatusCode, Html<String>) {
    let mut status = StatusCode::OK;
    let mut body = "<h1>Outbox</h1>".to_owned();
    match read(&console).await {
        Err(e) => {
            status = StatusCode::SERVICE_UNAVAILABLE;
            body.push_str(&unavailable(
                "The outbox's database did not answer",
                &unanswered(&e),
            ));
        }
        Ok(data) => {
            body.push_str(&failed_section(&session, &data.failed));
            body.push_str(&delayed_section(&session, &data.delayed));
        }
    }
    (status, Html(layout("Outbox", Some(&session), &body)))
}

fn order_link(order: &str) -> String {
    format!(
        r#"<a href="/timeline?id={}">{}</a>"#,
        url_encode(order),
        esc(order)
    )
}

fn failed_section(session: &Session, failed: &[FailedEvent]) -> String {
    let mut out = format!(
        r#"<section><h2>Failed events</h2><p class="muted">{} failed event(s){} hold their orders' later events until requeued.</p>
<form method="post" action="/actions/requeue" class="action">
<table class="sortable" id="failed"><thead><tr><th data-nosort>✓</th><th>event</th><th>order</th><th>seq</th><th>type</th><th>attempts</th><th>last error</th><th>written</th></tr></thead><tbody>"#,
        failed.len(),
        if failed.len() as i64 >= LIST_LIMIT {
            format!(" (the first {LIST_LIMIT})")
        } else {
            String::new()
        }
    );
    for f in failed {
        out.push_str(&format!(
            r#"<tr data-event="{e}" data-order="{o}"><td><input type="checkbox" name="event" value="{e}" aria-label="select event {e}"></td><td><code>{e}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            order_link(&f.aggregate_id),
            f.sequence,
            esc(&f.event_type),
            f.attempts,
            opt(f.last_error.as_deref()),
            f.created_at.format("%Y-%m-%d %H:%M:%S"),
            e = f.event_id,
            o = esc(&f.aggregate_id),
        ));
    }
    out.push_str(&format!(
        r#"</tbody></table>
<fieldset><legend>Requeue (back to pending: the relay publishes them, then their orders' held events, in order)</legend>
<label>…or every failed event of order <input name="order"></label>
{}</fieldset></form></section>"#,
        action_footer(session, "Requeue")
    ));
    out
}

fn delayed_section(session: &Session, delayed: &[DelayedEvent]) -> String {
    let mut out = format!(
        r#"<section><h2>Delayed events</h2><p class="muted">The next {} by publish time{}.</p>
<form method="post" action="/actions/delayed" class="action">
<table class="sortable" id="delayed"><thead><tr><th data-nosort>✓</th><th>event</th><th>order</th><th>type</th><th>topic</th><th>publish at</th><th>due</th><th>appended</th></tr></thead><tbody>"#,
        delayed.len(),
        if delayed.len() as i64 >= LIST_LIMIT {
            " (more wait)"
        } else {
            ""
        }
    );
    for d in delayed {
        out.push_str(&format!(
            r#"<tr data-event="{e}"><td><input type="checkbox" name="event" value="{e}" aria-label="select delayed event {e}"></td><td><code>{e}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            order_link(&d.aggregate_id),
            esc(&d.event_type),
            esc(&d.topic),
            d.publish_at.format("%Y-%m-%d %H:%M:%S"),
            if d.due { "yes" } else { "no" },
            d.delayed_at.format("%Y-%m-%d %H:%M:%S"),
            e = d.event_id,
        ));
    }
    out.push_str(&format!(
        r#"</tbody></table>
<fieldset><legend>Act on the delayed events ticked</legend>
<label>Action <select name="how"><option value="publish_now">publish now</option><option value="cancel">cancel (withdraw)</option></select></label>
{}</fieldset></form></section>"#,
        action_footer(session, "Apply")
    ));
    out
}
