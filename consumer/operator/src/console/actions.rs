//! The one entry for every change (`POST /actions/NAME`, or `/api/actions/NAME` for JSON):
//! the session's CSRF token, the operator role, a note and a confirmation are checked here,
//! before anything is read; then the action runs through the same function as its `pipeline`
//! subcommand, with the logged-in user as the actor and the form's note.

use std::collections::BTreeSet;

use axum::extract::{Form, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use consumer::operator::dead_letters::Resolution;
use maud::{html, Markup};
use serde::Serialize;
use uuid::Uuid;

use super::html::{layout, Shown};
use super::letters::LetterQuery;
use super::refusal::Refusal;
use super::session::Session;
use super::{delayed, Console, BULK_LIMIT};
use crate::args::{Change, LetterAction, LetterFilter, Position, ReprocessArgs, RequeueArgs};
use crate::dead_letters::resolve_letters;
use crate::targets::KnownBy;
use crate::{reprocess, requeue};

/// A form's fields, repeated names and all.
struct Fields(Vec<(String, String)>);

impl Fields {
    /// The first non-blank value of `name`, trimmed.
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .find(|v| !v.is_empty())
    }

    /// Every non-blank value of `name`.
    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
            .collect()
    }

    /// Every distinct non-blank value of `name`, in the order given: a box ticked twice (a
    /// crafted form) counts once.
    fn ticked(&self, name: &str) -> Vec<&str> {
        let mut seen = std::collections::HashSet::new();
        self.all(name)
            .into_iter()
            .filter(|value| seen.insert(*value))
            .collect()
    }
}

/// What an action did.
#[derive(Serialize)]
struct Done {
    action: String,
    /// One row per letter or event it took.
    outcomes: serde_json::Value,
    /// Why it stopped before the end, if it did (the rest are untouched).
    error: Option<String>,
    #[serde(skip)]
    status: StatusCode,
    /// Where to look next: a page of the console (under its prefix when shown).
    #[serde(skip)]
    back: &'static str,
}

/// `POST /actions/NAME`: the result as a page.
pub(super) async fn html(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
    Path(action): Path<String>,
    Form(fields): Form<Vec<(String, String)>>,
) -> Response {
    match act(&console, &session, &action, &Fields(fields)).await {
        Err(refusal) => refusal.into_response(),
        Ok(done) => {
            let urls = console.urls();
            let body = html! {
                h1 { (Shown(&done.action)) }
                p.muted { "as " (Shown(&session.user)) }
                @if let Some(e) = &done.error {
                    p.error role="alert" { (Shown(e)) }
                } @else {
                    p.ok role="status" { "Done." }
                }
                (table(&done.outcomes))
                p { a href=(urls.to(done.back)) id="back" { "Back" } }
            };
            (done.status, layout(urls, "Done", Some(&session), body)).into_response()
        }
    }
}

/// `POST /api/actions/NAME`: the result as JSON.
pub(super) async fn json(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
    Path(action): Path<String>,
    Form(fields): Form<Vec<(String, String)>>,
) -> Response {
    match act(&console, &session, &action, &Fields(fields)).await {
        Err(refusal) => refusal.json().into_response(),
        Ok(done) => (done.status, Json(&done)).into_response(),
    }
}

async fn act(
    console: &Console,
    session: &Session,
    action: &str,
    fields: &Fields,
) -> Result<Done, Refusal> {
    if !session.csrf_matches(fields.get("csrf")) {
        tracing::warn!(user = %session.user, action, "console action refused: CSRF token");
        return Err(Refusal::csrf());
    }
    if !session.may_act() {
        return Err(Refusal::forbidden(format!(
            "refused: {} is a viewer (read-only); only an operator may act",
            session.user
        )));
    }
    if fields.get("confirm") != Some("yes") {
        return Err(Refusal::bad(
            "refused: tick \"I confirm\" to confirm the action",
        ));
    }
    let note = fields
        .get("note")
        .ok_or_else(|| Refusal::bad("refused: say why (the note is kept with the action)"))?;
    if note.len() > 1000 {
        return Err(Refusal::bad("refused: a note is at most 1,000 bytes"));
    }
    let change = Change {
        actor: Some(session.user.clone()),
        note: note.to_owned(),
    };
    tracing::info!(user = %session.user, action, note, "console action");
    match action {
        "dead-letters" => dead_letters(console, fields, change).await,
        "requeue" => requeue_events(console, fields, change).await,
        "delayed" => delayed_events(console, fields, change).await,
        "reprocess" => reprocess_group(console, fields, change).await,
        "pause" => pause_or_resume(console, fields, change, true).await,
        "resume" => pause_or_resume(console, fields, change, false).await,
        other => Err(Refusal::not_found(format!("no action {other}"))),
    }
}

async fn dead_letters(console: &Console, fields: &Fields, change: Change) -> Result<Done, Refusal> {
    let how = match fields.get("how") {
        Some("replay") => Resolution::Replay,
        Some("skip") => Resolution::Skip,
        Some("discard") => Resolution::Discard,
        _ => return Err(Refusal::bad("choose replay, skip or discard")),
    };
    let targets = &console.inner.targets;
    let for_order = fields.get("for_order").map(str::to_owned);
    // (group, filter, limit) for each resolve call.
    let mut batches: Vec<(String, LetterFilter, bool, usize)> = Vec::new();
    match fields.get("scope").unwrap_or("selected") {
        "selected" => {
            let letters = fields.ticked("letter");
            if letters.is_empty() {
                return Err(Refusal::bad(
                    "tick at least one letter (or choose every letter that matches)",
                ));
            }
            if letters.len() > BULK_LIMIT {
                return Err(Refusal::bad(format!(
                    "at most {BULK_LIMIT} letters at a time"
                )));
            }
            for l in letters {
                let (group, id) = l
                    .rsplit_once(':')
                    .and_then(|(g, id)| id.parse::<i64>().ok().map(|id| (g, id)))
                    .ok_or_else(|| Refusal::bad(format!("`{l}` is not GROUP:ID")))?;
                let filter = LetterFilter {
                    id: Some(id),
                    ..LetterFilter::default()
                };
                batches.push((group.to_owned(), filter, false, 1));
            }
        }
        "matching" => {
            let query = LetterQuery {
                group: fields.get("filter_group").map(str::to_owned),
                reason: fields.get("filter_reason").map(str::to_owned),
                order: fields.get("filter_order").map(str::to_owned),
                since: fields.get("filter_since").map(str::to_owned),
                until: fields.get("filter_until").map(str::to_owned),
                ..LetterQuery::default()
            };
            let group = query.group.clone().ok_or_else(|| {
                Refusal::bad("every letter that matches: choose one group in the filters first")
            })?;
            let filter = query.filter()?;
            let all = filter.is_empty();
            batches.push((group, filter, all, BULK_LIMIT));
        }
        other => return Err(Refusal::bad(format!("unknown scope {other}"))),
    }
    let mut known = BTreeSet::new();
    let mut outcomes = Vec::new();
    let mut error = None;
    let mut status = StatusCode::OK;
    for (group, filter, all, limit) in batches {
        if known.insert(group.clone()) {
            targets.check_known(&group, KnownBy::Database).await?;
        }
        let action = LetterAction {
            filter,
            all,
            for_aggregate: for_order.clone(),
            change: change.clone(),
        };
        let resolved = match resolve_letters(
            targets,
            &group,
            &console.inner.settings.dead_letter_topic,
            &console.inner.groups,
            &action,
            how,
            limit,
        )
        .await
        {
            Ok(r) => r,
            Err(e) if outcomes.is_empty() => return Err(e.into()),
            Err(e) => {
                let refusal = Refusal::from(e);
                status = refusal.status;
                error = Some(refusal.message);
                break;
            }
        };
        for o in &resolved.outcomes {
            outcomes.push(serde_json::json!({
                "group": group,
                "dead_letter": o.id,
                "order": o.aggregate_id,
                "outcome": o.outcome,
                "parked_events_unparked": o.unparked,
            }));
        }
        if let Some(e) = resolved.failure {
            let refusal = Refusal::from(e);
            status = refusal.status;
            error = Some(refusal.message);
            break;
        }
    }
    if outcomes.is_empty() && error.is_none() {
        return Err(Refusal::bad("no open dead letter matches: nothing to do"));
    }
    Ok(Done {
        action: "Dead letters".to_owned(),
        outcomes: serde_json::Value::Array(outcomes),
        error,
        status,
        back: "/dead-letters",
    })
}

fn uuids(fields: &Fields, name: &str) -> Result<Vec<Uuid>, Refusal> {
    let values = fields.all(name);
    if values.len() > BULK_LIMIT {
        return Err(Refusal::bad(format!(
            "at most {BULK_LIMIT} events at a time"
        )));
    }
    values
        .iter()
        .map(|v| Uuid::parse_str(v).map_err(|_| Refusal::bad(format!("`{v}` is not an event id"))))
        .collect()
}

async fn requeue_events(
    console: &Console,
    fields: &Fields,
    change: Change,
) -> Result<Done, Refusal> {
    let events = uuids(fields, "event")?;
    let order = fields.get("order").map(str::to_owned);
    if events.is_empty() && order.is_none() {
        return Err(Refusal::bad(
            "tick at least one failed event, or name an order",
        ));
    }
    let args = RequeueArgs {
        events,
        aggregate: order,
        error: None,
        all: false,
        change,
    };
    let pool = console.inner.targets.outbox().await?;
    let requeued = requeue::requeue(&pool, &args).await?;
    Ok(Done {
        action: "Requeued".to_owned(),
        outcomes: serde_json::to_value(&requeued).unwrap_or_default(),
        error: None,
        status: StatusCode::OK,
        back: "/outbox",
    })
}

async fn delayed_events(
    console: &Console,
    fields: &Fields,
    change: Change,
) -> Result<Done, Refusal> {
    let events = uuids(fields, "event")?;
    if events.is_empty() {
        return Err(Refusal::bad("tick at least one delayed event"));
    }
    let actor = change.actor.unwrap_or_default();
    let pool = console.inner.targets.outbox().await?;
    let (title, changed) = match fields.get("how") {
        Some("publish_now") => (
            "Published now",
            delayed::publish_now(&pool, &events, &actor, &change.note).await?,
        ),
        Some("cancel") => (
            "Cancelled",
            delayed::cancel(&pool, &events, &actor, &change.note).await?,
        ),
        _ => return Err(Refusal::bad("choose publish now or cancel")),
    };
    Ok(Done {
        action: title.to_owned(),
        outcomes: serde_json::to_value(&changed).unwrap_or_default(),
        error: None,
        status: StatusCode::OK,
        back: "/outbox",
    })
}

async fn reprocess_group(
    console: &Console,
    fields: &Fields,
    change: Change,
) -> Result<Done, Refusal> {
    let group = fields
        .get("group")
        .ok_or_else(|| Refusal::bad("name the group"))?;
    let from = fields
        .get("from")
        .ok_or_else(|| Refusal::bad("say where to start again: a time or an offset"))?;
    let from = match from.parse::<i64>() {
        Ok(offset) if offset >= 0 => Position::Offset(offset),
        Ok(offset) => return Err(Refusal::bad(format!("offset {offset} is negative"))),
        Err(_) => chrono::DateTime::parse_from_rfc3339(from)
            .map(|t| Position::Time(t.with_timezone(&chrono::Utc)))
            .map_err(|_| {
                Refusal::bad(format!(
                    "`{from}` is neither an offset nor an RFC 3339 time (e.g. 2026-11-25T03:00:00Z)"
                ))
            })?,
    };
    let targets = &console.inner.targets;
    targets.check_known(group, KnownBy::Database).await?;
    let args = ReprocessArgs {
        from,
        clear_dedupe: fields.get("clear_dedupe") == Some("yes"),
        change,
    };
    let done = reprocess::reprocess_group(targets, group, &args).await?;
    Ok(Done {
        action: format!("Reprocess of {group}"),
        outcomes: serde_json::to_value(&done.partitions).unwrap_or_default(),
        error: None,
        status: StatusCode::OK,
        back: "/groups",
    })
}

async fn pause_or_resume(
    console: &Console,
    fields: &Fields,
    change: Change,
    pause: bool,
) -> Result<Done, Refusal> {
    let group = fields
        .get("group")
        .ok_or_else(|| Refusal::bad("name the group"))?;
    let targets = &console.inner.targets;
    let actor = change.actor.unwrap_or_default();
    let done = if pause {
        crate::group::pause(targets, group, &actor, &change.note).await?
    } else {
        crate::group::resume(targets, group, &actor, &change.note).await?
    };
    let outcome = match (done.paused, done.changed) {
        (true, true) => "paused",
        (true, false) => "already paused (nothing changed)",
        (false, true) => "resumed",
        (false, false) => "already running (nothing changed)",
    };
    Ok(Done {
        action: format!("{} {group}", if pause { "Pause of" } else { "Resume of" }),
        outcomes: serde_json::json!([{
            "group": done.group,
            "outcome": outcome,
            "paused since": done.pause.as_ref().map(|p| p.since.to_rfc3339()),
            "paused by": done.pause.as_ref().map(|p| p.actor.clone()),
        }]),
        error: None,
        status: StatusCode::OK,
        back: "/groups",
    })
}

/// An array of objects as a table, its columns from the first object's fields.
fn table(rows: &serde_json::Value) -> Markup {
    let Some(rows) = rows.as_array() else {
        return html! {};
    };
    let Some(first) = rows.first().and_then(|r| r.as_object()) else {
        return html! { p { "Nothing changed." } };
    };
    let columns: Vec<&String> = first.keys().collect();
    let cell = |row: &serde_json::Value, column: &str| match row.get(column) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Null) | None => "-".to_owned(),
        Some(v) => v.to_string(),
    };
    html! {
        table #outcomes {
            thead { tr { @for c in &columns { th { (Shown(c)) } } } }
            tbody {
                @for row in rows {
                    tr { @for c in &columns { td { (Shown(&cell(row, c))) } } }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Fields;

    #[test]
    fn a_letter_ticked_twice_is_taken_once() {
        let fields = Fields(
            [
                ("letter", "ga:7"),
                ("letter", " ga:7 "),
                ("letter", "ga:8"),
                ("letter", "ga:7"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        );
        assert_eq!(fields.ticked("letter"), vec!["ga:7", "ga:8"]);
    }
}
