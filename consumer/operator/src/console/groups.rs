//! The groups' page: each known group with its lag (from the overview's last reading) and the
//! group actions: pause and resume (`pipeline group pause|resume`), reprocess from a time or an
//! offset (`pipeline reprocess`).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Html;
use axum::{Extension, Json};
use serde::Serialize;

use super::html::{action_footer, esc, layout, unavailable};
use super::refusal::{unanswered, Refusal};
use super::session::Session;
use super::Console;
use crate::group::PausedSince;
use crate::targets::KnownBy;

/// `/api/groups`.
#[derive(Serialize)]
pub(super) struct GroupsData {
    /// Every group owning a partition in the databases given (or the ones `--group` names).
    groups: Vec<GroupState>,
}

/// A group and whether it is paused.
#[derive(Serialize)]
pub(super) struct GroupState {
    group: String,
    /// While paused: since when, by whom and why.
    paused: Option<PausedSince>,
}

async fn read(console: &Console) -> anyhow::Result<GroupsData> {
    let targets = &console.inner.targets;
    let mut groups = Vec::new();
    for group in targets.groups(KnownBy::Database).await? {
        let pool = targets.group(&group).await?;
        let paused = crate::group::state(&pool, &targets.qualified(&group)).await?;
        groups.push(GroupState { group, paused });
    }
    Ok(GroupsData { groups })
}

/// `GET /api/groups`.
pub(super) async fn api(State(console): State<Console>) -> Result<Json<GroupsData>, Refusal> {
    read(&console)
        .await
        .map(Json)
        .map_err(|e| Refusal::from(e).json())
}

/// `GET /groups`.
pub(super) async fn page(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
) -> (StatusCode, Html<String>) {
    let mut status = StatusCode::OK;
    let mut body =
        r#"<h1>Groups</h1><p class="muted">Lag and members: see the <a href="/">overview</a>.</p>"#
            .to_owned();
    match read(&console).await {
        Err(e) => {
            status = StatusCode::SERVICE_UNAVAILABLE;
            body.push_str(&unavailable(
                "The groups' databases did not answer",
                &unanswered(&e),
            ));
        }
        Ok(data) => {
            for state in &data.groups {
                body.push_str(&group_section(&session, state));
            }
            if data.groups.is_empty() {
                body.push_str("<p>No group has owned a partition yet.</p>");
            }
        }
    }
    (status, Html(layout("Groups", Some(&session), &body)))
}

fn group_section(session: &Session, state: &GroupState) -> String {
    let g = esc(&state.group);
    let (now, verb, class) = match &state.paused {
        Some(p) => (
            format!(
                r#"<p class="state-warn" data-state="paused">paused since {} by {}: {}</p>"#,
                p.since.format("%Y-%m-%d %H:%M:%S"),
                esc(&p.actor),
                esc(&p.note)
            ),
            "Resume",
            "resume",
        ),
        None => (
            r#"<p class="state-good" data-state="running">running</p>"#.to_owned(),
            "Pause",
            "pause",
        ),
    };
    format!(
        r#"<section class="group" data-group="{g}"><h2>{g}</h2>{now}
<form method="post" action="/actions/{class}" class="action {class}">
<input type="hidden" name="group" value="{g}">
<fieldset><legend>{verb} (its members finish and commit the batch in flight, then take no new one until resumed)</legend>
{}</fieldset></form>
<form method="post" action="/actions/reprocess" class="action">
<input type="hidden" name="group" value="{g}">
<fieldset><legend>Reprocess (stop the group's members first)</legend>
<label>From (RFC 3339 time, or an offset for every partition) <input name="from" required placeholder="2026-11-25T03:00:00Z"></label>
<label class="check"><input type="checkbox" name="clear_dedupe" value="yes"> also clear the dedupe rows (apply the effects a second time)</label>
{}</fieldset></form></section>"#,
        action_footer(session, verb),
        action_footer(session, "Reprocess")
    )
}
