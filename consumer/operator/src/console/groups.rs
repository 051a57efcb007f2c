//! The groups' page: each known group with its lag (from the overview's last reading) and the
//! group actions: pause and resume (`pipeline group pause|resume`), reprocess from a time or an
//! offset (`pipeline reprocess`).

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use maud::{html, Markup};
use serde::Serialize;

use super::html::{action_footer, layout, unavailable, Shown};
use super::refusal::{page_status, unanswered, Refusal};
use super::session::Session;
use super::urls::Urls;
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
) -> (StatusCode, Markup) {
    let urls = console.urls();
    let read = read(&console).await;
    let status = page_status(&read);
    let body = html! {
        h1 { "Groups" }
        p.muted { "Lag and members: see the " a href=(urls.to("/")) { "overview" } "." }
        @match &read {
            Err(e) => { (unavailable("The groups' databases did not answer", &unanswered(e))) }
            Ok(data) => {
                @for state in &data.groups {
                    (group_section(urls, &session, state))
                }
                @if data.groups.is_empty() {
                    p { "No group has owned a partition yet." }
                }
            }
        }
    };
    (status, layout(urls, "Groups", Some(&session), body))
}

fn group_section(urls: Urls<'_>, session: &Session, state: &GroupState) -> Markup {
    let (verb, class) = match &state.paused {
        Some(_) => ("Resume", "resume"),
        None => ("Pause", "pause"),
    };
    // The group's name as stored goes back with the forms; it is shown through `Shown`.
    let group = &state.group;
    html! {
        section.group data-group=(Shown(group)) {
            h2 { (Shown(group)) }
            @match &state.paused {
                Some(p) => {
                    p.state-warn data-state="paused" {
                        "paused since " (p.since.format("%Y-%m-%d %H:%M:%S"))
                        " by " (Shown(&p.actor)) ": " (Shown(&p.note))
                    }
                }
                None => { p.state-good data-state="running" { "running" } }
            }
            form method="post" action=(urls.to(&format!("/actions/{class}"))) class={ "action " (class) } {
                input type="hidden" name="group" value=(group);
                fieldset {
                    legend {
                        (verb) " (its members finish and commit the batch in flight, then take no \
                        new one until resumed)"
                    }
                    (action_footer(session, verb))
                }
            }
            form method="post" action=(urls.to("/actions/reprocess")) class="action" {
                input type="hidden" name="group" value=(group);
                fieldset {
                    legend { "Reprocess (stop the group's members first)" }
                    label {
                        "From (RFC 3339 time, or an offset for every partition) "
                        input name="from" required placeholder="2026-11-25T03:00:00Z";
                    }
                    label.check {
                        input type="checkbox" name="clear_dedupe" value="yes";
                        " also clear the dedupe rows (apply the effects a second time)"
                    }
                    (action_footer(session, "Reprocess"))
                }
            }
        }
    }
}
