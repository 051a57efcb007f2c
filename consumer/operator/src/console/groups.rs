//! The groups' page: each known group with its lag (from the overview's last reading) and the
//! group actions: reprocess from a time or an offset (`pipeline reprocess`).

use axum::extract::State;
use axum::response::Html;
use axum::{Extension, Json};
use serde::Serialize;

use super::html::{action_footer, esc, layout, unavailable};
use super::refusal::Refusal;
use super::session::Session;
use super::Console;
use crate::targets::KnownBy;

/// `/api/groups`.
#[derive(Serialize)]
pub(super) struct GroupsData {
    /// Every group owning a partition in the databases given (or the ones `--group` names).
    groups: Vec<String>,
}

async fn read(console: &Console) -> anyhow::Result<GroupsData> {
    Ok(GroupsData {
        groups: console.inner.targets.groups(KnownBy::Database).await?,
    })
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
) -> Html<String> {
    let mut body =
        r#"<h1>Groups</h1><p class="muted">Lag and members: see the <a href="/">overview</a>.</p>"#
            .to_owned();
    match read(&console).await {
        Err(e) => body.push_str(&unavailable(
            "The groups' databases did not answer",
            &format!("{e:#}"),
        )),
        Ok(data) => {
            for group in &data.groups {
                body.push_str(&group_section(&session, group));
            }
            if data.groups.is_empty() {
                body.push_str("<p>No group has owned a partition yet.</p>");
            }
        }
    }
    Html(layout("Groups", Some(&session), &body))
}

fn group_section(session: &Session, group: &str) -> String {
    let g = esc(group);
    format!(
        r#"<section class="group" data-group="{g}"><h2>{g}</h2>
<form method="post" action="/actions/reprocess" class="action">
<input type="hidden" name="group" value="{g}">
<fieldset><legend>Reprocess (stop the group's members first)</legend>
<label>From (RFC 3339 time, or an offset for every partition) <input name="from" required placeholder="2026-11-25T03:00:00Z"></label>
<label class="check"><input type="checkbox" name="clear_dedupe" value="yes"> also clear the dedupe rows (apply the effects a second time)</label>
{}</fieldset></form></section>"#,
        action_footer(session, "Reprocess")
    )
}
