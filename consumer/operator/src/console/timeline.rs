//! An order's timeline (or one event's): `pipeline trace`, searched by order id, event id or
//! schedule name; every step across the outbox, the relay and each group, operators' actions
//! with who and why among them.

use axum::extract::{Query, State};
use axum::{Extension, Json};
use maud::{html, Markup};
use pipeline_core::record::escape;
use serde::Deserialize;

use super::html::{layout, opt, Shown};
use super::refusal::Refusal;
use super::session::Session;
use super::urls::{url_encode, Urls};
use super::Console;
use crate::trace::{self, Trace};

#[derive(Deserialize)]
pub(super) struct TimelineQuery {
    id: Option<String>,
}

fn wanted(q: &TimelineQuery) -> Result<Option<String>, Refusal> {
    match q.id.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(id) if id.len() > 512 => Err(Refusal::bad("an id is at most 512 characters")),
        Some(id) if id.contains('\0') => Err(Refusal::bad("an id cannot hold a NUL character")),
        Some(id) => Ok(Some(id.to_owned())),
    }
}

/// `GET /api/timeline?id=…`.
pub(super) async fn api(
    State(console): State<Console>,
    Query(q): Query<TimelineQuery>,
) -> Result<Json<Trace>, Refusal> {
    let id = wanted(&q)
        .map_err(Refusal::json)?
        .ok_or_else(|| Refusal::bad("give ?id=ORDER or ?id=EVENT").json())?;
    let trace = trace::read(&console.inner.targets, &id)
        .await
        .map_err(|e| Refusal::from(e).json())?;
    Ok(Json(trace))
}

/// `GET /timeline?id=…`: the search form and, for an id, its timeline.
pub(super) async fn page(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
    Query(q): Query<TimelineQuery>,
) -> Result<Markup, Refusal> {
    let id = wanted(&q)?;
    let trace = match &id {
        Some(id) => Some(trace::read(&console.inner.targets, id).await?),
        None => None,
    };
    let urls = console.urls();
    let body = html! {
        h1 { "Order timeline" }
        form method="get" action=(urls.to("/timeline")) class="search" {
            label {
                "Order id, event id or schedule "
                input name="id" value=(Shown(id.as_deref().unwrap_or(""))) size="44" required;
            }
            button type="submit" { "Show" }
        }
        @if let Some(trace) = &trace {
            (render(urls, trace))
        }
    };
    Ok(layout(urls, "Order timeline", Some(&session), body))
}

fn render(urls: Urls<'_>, trace: &Trace) -> Markup {
    let order = escape(trace.aggregate_id.as_bytes());
    let encoded = url_encode(&trace.aggregate_id);
    html! {
        h2 {
            @if let Some(event) = trace.event_id {
                "Event " code { (event) } " of order "
            } @else {
                "Order "
            }
            code #order-id { (Shown(&order)) }
        }
        p.muted {
            (trace.steps.len()) " step(s), oldest first · "
            a href=(urls.to(&format!("/dead-letters?order={encoded}&status="))) { "its dead letters" }
            " · "
            a href=(urls.to(&format!("/api/timeline?id={encoded}"))) { "JSON" }
        }
        table.timeline #timeline {
            thead {
                tr {
                    th { "at" } th { "where" } th { "what" } th { "seq" } th { "event" }
                    th { "partition/offset" } th { "detail" }
                }
            }
            tbody {
                @for s in &trace.steps {
                    @let event = s
                        .event_type
                        .clone()
                        .or_else(|| s.event_id.map(|e| e.to_string()))
                        .unwrap_or_else(|| "-".to_owned());
                    @let detail = s
                        .detail
                        .as_deref()
                        .map(|d| escape(d.as_bytes()).into_owned())
                        .unwrap_or_default();
                    tr class={ "step " (step_class(&s.transition)) } data-transition=(Shown(&s.transition))
                        data-place=(Shown(&s.place)) {
                        td { (s.at.format("%Y-%m-%d %H:%M:%S%.3f")) }
                        td { (Shown(&s.place)) }
                        td { (Shown(&s.transition)) }
                        td { (opt(s.sequence)) }
                        td { (Shown(&event)) }
                        td { (crate::trace::position(s.kafka_partition, s.kafka_offset)) }
                        td { (Shown(&detail)) }
                    }
                }
            }
        }
    }
}

/// A step's class: how its row is coloured.
fn step_class(transition: &str) -> &'static str {
    match transition {
        "failed" | "attempt_failed" | "dead_lettered" => "bad",
        "parked" => "warn",
        "applied" | "unparked" | "published" => "good",
        t if t.contains('.') => "action",
        _ => "",
    }
}
