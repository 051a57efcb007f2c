//! The outbox's page: failed events (requeue the ones ticked, or an order's) and delayed
//! events (publish now, cancel). Each list shows at most [`LIST_LIMIT`] rows, read by index.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::delayed::{self, DelayedEvent};
use super::html::{action_footer, layout, opt, unavailable, Shown};
use super::refusal::{page_status, unanswered, Refusal};
use super::session::Session;
use super::urls::{url_encode, Urls};
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
) -> (StatusCode, Markup) {
    let urls = console.urls();
    let read = read(&console).await;
    let status = page_status(&read);
    let body = html! {
        h1 { "Outbox" }
        @match &read {
            Err(e) => { (unavailable("The outbox's database did not answer", &unanswered(e))) }
            Ok(data) => {
                (failed_section(urls, &session, &data.failed))
                (delayed_section(urls, &session, &data.delayed))
            }
        }
    };
    (status, layout(urls, "Outbox", Some(&session), body))
}

fn order_link(urls: Urls<'_>, order: &str) -> Markup {
    html! {
        a href=(urls.to(&format!("/timeline?id={}", url_encode(order)))) { (Shown(order)) }
    }
}

fn failed_section(urls: Urls<'_>, session: &Session, failed: &[FailedEvent]) -> Markup {
    let capped = failed.len() as i64 >= LIST_LIMIT;
    html! {
        section {
            h2 { "Failed events" }
            p.muted {
                (failed.len()) " failed event(s)"
                @if capped { " (the first " (LIST_LIMIT) ")" }
                " hold their orders' later events until requeued."
            }
            form method="post" action=(urls.to("/actions/requeue")) class="action" {
                table.sortable #failed {
                    thead {
                        tr {
                            th data-nosort { "✓" } th { "event" } th { "order" } th { "seq" }
                            th { "type" } th { "attempts" } th { "last error" } th { "written" }
                        }
                    }
                    tbody {
                        @for f in failed {
                            tr data-event=(f.event_id) data-order=(Shown(&f.aggregate_id)) {
                                td {
                                    input type="checkbox" name="event" value=(f.event_id)
                                        aria-label={ "select event " (f.event_id) };
                                }
                                td { code { (f.event_id) } }
                                td { (order_link(urls, &f.aggregate_id)) }
                                td { (f.sequence) }
                                td { (Shown(&f.event_type)) }
                                td { (f.attempts) }
                                td { (opt(f.last_error.as_deref())) }
                                td { (f.created_at.format("%Y-%m-%d %H:%M:%S")) }
                            }
                        }
                    }
                }
                fieldset {
                    legend {
                        "Requeue (back to pending: the relay publishes them, then their orders' \
                         held events, in order)"
                    }
                    label { "…or every failed event of order " input name="order"; }
                    (action_footer(session, "Requeue"))
                }
            }
        }
    }
}

fn delayed_section(urls: Urls<'_>, session: &Session, delayed: &[DelayedEvent]) -> Markup {
    let capped = delayed.len() as i64 >= LIST_LIMIT;
    html! {
        section {
            h2 { "Delayed events" }
            p.muted {
                "The next " (delayed.len()) " by publish time" @if capped { " (more wait)" } "."
            }
            form method="post" action=(urls.to("/actions/delayed")) class="action" {
                table.sortable #delayed {
                    thead {
                        tr {
                            th data-nosort { "✓" } th { "event" } th { "order" } th { "type" }
                            th { "topic" } th { "publish at" } th { "due" } th { "appended" }
                        }
                    }
                    tbody {
                        @for d in delayed {
                            tr data-event=(d.event_id) {
                                td {
                                    input type="checkbox" name="event" value=(d.event_id)
                                        aria-label={ "select delayed event " (d.event_id) };
                                }
                                td { code { (d.event_id) } }
                                td { (order_link(urls, &d.aggregate_id)) }
                                td { (Shown(&d.event_type)) }
                                td { (Shown(&d.topic)) }
                                td { (d.publish_at.format("%Y-%m-%d %H:%M:%S")) }
                                td { @if d.due { "yes" } @else { "no" } }
                                td { (d.delayed_at.format("%Y-%m-%d %H:%M:%S")) }
                            }
                        }
                    }
                }
                fieldset {
                    legend { "Act on the delayed events ticked" }
                    label {
                        "Action "
                        select name="how" {
                            option value="publish_now" { "publish now" }
                            option value="cancel" { "cancel (withdraw)" }
                        }
                    }
                    (action_footer(session, "Apply"))
                }
            }
        }
    }
}
