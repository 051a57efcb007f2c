//! An order's timeline (or one event's): `pipeline trace`, searched by order id, event id or
//! schedule name; every step across the outbox, the relay and each group, operators' actions
//! with who and why among them.

use axum::extract::{Query, State};
use axum::response::Html;
use axum::{Extension, Json};
use pipeline_core::record::escape;
use serde::Deserialize;

use super::html::{esc, layout, opt};
use super::refusal::Refusal;
use super::session::{url_encode, Session};
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
) -> Result<Html<String>, Refusal> {
    let id = wanted(&q)?;
    let mut body = format!(
        r#"<h1>Order timeline</h1>
<form method="get" action="/timeline" class="search">
<label>Order id, event id or schedule <input name="id" value="{}" size="44" required></label>
<button type="submit">Show</button></form>"#,
        esc(id.as_deref().unwrap_or(""))
    );
    if let Some(id) = id {
        let trace = trace::read(&console.inner.targets, &id).await?;
        body.push_str(&render(&trace));
    }
    Ok(Html(layout("Order timeline", Some(&session), &body)))
}

fn render(trace: &Trace) -> String {
    let order = escape(trace.aggregate_id.as_bytes());
    let mut out = match trace.event_id {
        Some(e) => format!(
            r#"<h2>Event <code>{}</code> of order <code id="order-id">{}</code></h2>"#,
            e,
            esc(&order)
        ),
        None => format!(
            r#"<h2>Order <code id="order-id">{}</code></h2>"#,
            esc(&order)
        ),
    };
    out.push_str(&format!(
        r#"<p class="muted">{} step(s), oldest first · <a href="/dead-letters?order={}&amp;status=">its dead letters</a> · <a href="/api/timeline?id={}">JSON</a></p>"#,
        trace.steps.len(),
        url_encode(&trace.aggregate_id),
        url_encode(&trace.aggregate_id),
    ));
    out.push_str(
        r#"<table class="timeline" id="timeline"><thead><tr><th>at</th><th>where</th><th>what</th><th>seq</th><th>event</th><th>partition/offset</th><th>detail</th></tr></thead><tbody>"#,
    );
    for s in &trace.steps {
        let class = match s.transition.as_str() {
            "failed" | "attempt_failed" | "dead_lettered" => "bad",
            "parked" => "warn",
            "applied" | "unparked" | "published" => "good",
            t if t.contains('.') => "action",
            _ => "",
        };
        out.push_str(&format!(
            r#"<tr class="step {class}" data-transition="{t}" data-place="{p}"><td>{}</td><td>{p}</td><td>{t}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            s.at.format("%Y-%m-%d %H:%M:%S%.3f"),
            opt(s.sequence),
            esc(&s
                .event_type
                .clone()
                .or_else(|| s.event_id.map(|e| e.to_string()))
                .unwrap_or_else(|| "-".to_owned())),
            crate::trace::position(s.kafka_partition, s.kafka_offset),
            esc(&s.detail.as_deref().map(|d| escape(d.as_bytes()).into_owned()).unwrap_or_default()),
            t = esc(&s.transition),
            p = esc(&s.place),
        ));
    }
    out.push_str("</tbody></table>");
    out
}
