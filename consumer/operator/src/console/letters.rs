//! Dead letters: `pipeline dead-letters list` with filters and paging, across one group or all,
//! and the form that replays, skips or discards the letters ticked, or every open letter the
//! filters match (at most [`super::BULK_LIMIT`] at a time).

use axum::extract::{Query, State};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use pipeline_core::record::escape;
use serde::{Deserialize, Serialize};

use super::html::{action_footer, layout, opt, Shown};
use super::refusal::Refusal;
use super::session::Session;
use super::urls::{url_encode, Urls};
use super::Console;
use super::BULK_LIMIT;
use crate::args::LetterFilter;
use crate::dead_letters::{count, list_page, Letter};
use crate::targets::KnownBy;

/// Letters on a page.
const PAGE_SIZE: usize = 50;

/// The filters of the list, as the page's query string gives them.
#[derive(Debug, Default, Deserialize, Serialize)]
pub(super) struct LetterQuery {
    /// One group (default: every group).
    #[serde(default)]
    pub(super) group: Option<String>,
    /// open (default), replayed, skipped, discarded; empty: any.
    #[serde(default)]
    pub(super) status: Option<String>,
    #[serde(default)]
    pub(super) reason: Option<String>,
    #[serde(default)]
    pub(super) order: Option<String>,
    #[serde(default)]
    pub(super) since: Option<String>,
    #[serde(default)]
    pub(super) until: Option<String>,
    #[serde(default)]
    pub(super) page: Option<usize>,
}

/// A letter with its group.
#[derive(Serialize)]
pub(super) struct GroupLetter {
    group: String,
    #[serde(flatten)]
    letter: Letter,
}

/// `/api/dead-letters`.
#[derive(Serialize)]
pub(super) struct LetterPage {
    letters: Vec<GroupLetter>,
    /// Letters matching, over every page.
    total: usize,
    page: usize,
    page_size: usize,
    groups: Vec<String>,
}

fn some(s: &Option<String>) -> Option<String> {
    s.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

pub(super) fn parse_time(name: &str, s: &Option<String>) -> Result<Option<DateTime<Utc>>, Refusal> {
    some(s)
        .map(|t| {
            DateTime::parse_from_rfc3339(&t)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| {
                    Refusal::bad(format!(
                        "{name} `{t}` is not an RFC 3339 time (e.g. 2026-11-25T03:00:00Z): {e}"
                    ))
                })
        })
        .transpose()
}

impl LetterQuery {
    /// The filter (without an id) these fields give.
    pub(super) fn filter(&self) -> Result<LetterFilter, Refusal> {
        Ok(LetterFilter {
            id: None,
            reason: some(&self.reason),
            since: parse_time("since", &self.since)?,
            until: parse_time("until", &self.until)?,
            aggregate: some(&self.order),
        })
    }

    fn status(&self) -> Option<String> {
        match &self.status {
            None => Some("open".to_owned()),
            s => some(s),
        }
    }
}

async fn read(console: &Console, q: &LetterQuery) -> Result<LetterPage, Refusal> {
    let targets = &console.inner.targets;
    let filter = q.filter()?;
    let all = targets.groups(KnownBy::Database).await?;
    let groups = match some(&q.group) {
        Some(g) => {
            targets.check_known(&g, KnownBy::Database).await?;
            vec![g]
        }
        None => all.clone(),
    };
    let status = q.status();
    // Paged in SQL: each group's matching letters counted, and only the page's rows read, the
    // groups one after the other in the order listed.
    let page = q.page.unwrap_or(1).max(1);
    let mut skip = i64::try_from((page - 1).saturating_mul(PAGE_SIZE)).unwrap_or(i64::MAX);
    let mut room = PAGE_SIZE as i64;
    let mut total = 0;
    let mut letters = Vec::new();
    for group in &groups {
        let pool = targets.group(group).await?;
        let name = targets.qualified(group);
        let matching = count(&pool, &name, &filter, status.as_deref()).await?;
        total += matching;
        if room == 0 || skip >= matching {
            skip = skip.saturating_sub(matching);
            continue;
        }
        let found = list_page(&pool, &name, &filter, status.as_deref(), skip, room).await?;
        skip = 0;
        room -= found.len() as i64;
        letters.extend(found.into_iter().map(|letter| GroupLetter {
            group: group.clone(),
            letter,
        }));
    }
    let total = usize::try_from(total).unwrap_or(usize::MAX);
    Ok(LetterPage {
        letters,
        total,
        page,
        page_size: PAGE_SIZE,
        groups: all,
    })
}

/// `GET /api/dead-letters`.
pub(super) async fn api(
    State(console): State<Console>,
    Query(q): Query<LetterQuery>,
) -> Result<Json<LetterPage>, Refusal> {
    read(&console, &q).await.map(Json).map_err(Refusal::json)
}

/// `GET /dead-letters`.
pub(super) async fn page(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
    Query(q): Query<LetterQuery>,
) -> Result<Markup, Refusal> {
    let data = read(&console, &q).await?;
    let urls = console.urls();
    let value = |s: &Option<String>| s.clone().unwrap_or_default();
    let group = some(&q.group).unwrap_or_default();
    let groups = std::iter::once(("", "every group"))
        .chain(data.groups.iter().map(|g| (g.as_str(), g.as_str())));
    let status = q.status().unwrap_or_default();
    let statuses = [
        ("open", "open"),
        ("replayed", "replayed"),
        ("skipped", "skipped"),
        ("discarded", "discarded"),
        ("", "any"),
    ];
    let pages = data.total.div_ceil(PAGE_SIZE).max(1);
    let link = |page: usize| {
        let mut params = query_pairs(&q);
        params.push(("page".to_owned(), page.to_string()));
        let query = params
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        urls.to(&format!("/dead-letters?{query}"))
    };
    let body = html! {
        h1 { "Dead letters" }
        form method="get" action=(urls.to("/dead-letters")) class="filters" {
            label {
                "Group "
                select name="group" {
                    @for (v, label) in groups {
                        option value=(v) selected[group == v] { (Shown(label)) }
                    }
                }
            }
            label {
                "Status "
                select name="status" {
                    @for (v, label) in statuses {
                        option value=(v) selected[status == v] { (label) }
                    }
                }
            }
            label { "Order " input name="order" value=(Shown(&value(&q.order))); }
            label { "Reason contains " input name="reason" value=(Shown(&value(&q.reason))); }
            label {
                "Since "
                input name="since" value=(Shown(&value(&q.since))) placeholder="2026-11-25T03:00:00Z";
            }
            label {
                "Until " input name="until" value=(Shown(&value(&q.until))) placeholder="RFC 3339";
            }
            button type="submit" { "Filter" }
        }
        p.muted #letters-count {
            (data.total) " letter(s) match; page " (data.page) " of " (pages) "."
        }
        form method="post" action=(urls.to("/actions/dead-letters")) class="action" {
            table.letters.sortable #letters {
                thead {
                    tr {
                        th data-nosort { "✓" } th { "group" } th { "id" } th { "order" } th { "seq" }
                        th { "type" } th { "partition/offset" } th { "reason" } th { "attempts" }
                        th { "status" } th { "recorded" } th { "parked behind" }
                    }
                }
                tbody {
                    @for GroupLetter { group, letter } in &data.letters {
                        (letter_row(urls, group, letter))
                    }
                }
            }
            p.pager {
                @if data.page > 1 {
                    a href=(link(data.page - 1)) { "← previous" } " "
                }
                @if data.page.saturating_mul(PAGE_SIZE) < data.total {
                    a href=(link(data.page + 1)) { "next →" }
                }
            }
            // The filters travel with the form, for "every letter that matches".
            @for (k, v) in query_pairs(&q) {
                input type="hidden" name={ "filter_" (k) } value=(v);
            }
            fieldset {
                legend { "Act on dead letters" }
                label {
                    "Action "
                    select name="how" {
                        option value="replay" { "replay (apply again, then the parked events)" }
                        option value="skip" { "skip (pass over; apply the parked events)" }
                        option value="discard" { "discard (close a letter that holds nothing back)" }
                    }
                }
                label {
                    "Which "
                    select name="scope" {
                        option value="selected" { "the letters ticked above" }
                        option value="matching" {
                            "every open letter the filters match (one group, at most "
                            (BULK_LIMIT) ")"
                        }
                    }
                }
                label {
                    "For order (skip of an unreadable record whose key names no order; optional) "
                    input name="for_order";
                }
                (action_footer(&session, "Apply"))
            }
        }
    };
    Ok(layout(urls, "Dead letters", Some(&session), body))
}

/// A letter's row: its box to tick (the group as stored and the id, sent back with the form),
/// and its fields as shown.
fn letter_row(urls: Urls<'_>, group: &str, l: &Letter) -> Markup {
    let order = l
        .aggregate_id
        .as_deref()
        .map(|o| escape(o.as_bytes()).into_owned());
    let event_type = l.event_type.as_deref().map(|t| escape(t.as_bytes()));
    html! {
        tr data-letter=(l.id) data-order=(Shown(order.as_deref().unwrap_or(""))) {
            td {
                input type="checkbox" name="letter" value={ (group) ":" (l.id) }
                    aria-label={ "select letter " (l.id) };
            }
            td { (Shown(group)) }
            td { (l.id) }
            td {
                @match (&l.aggregate_id, &order) {
                    (Some(raw), Some(shown)) => {
                        a href=(urls.to(&format!("/timeline?id={}", url_encode(raw)))) {
                            (Shown(shown))
                        }
                    }
                    _ => { "-" }
                }
            }
            td { (opt(l.sequence)) }
            td { (opt(event_type)) }
            td { (l.partition) "/" (l.kafka_offset) }
            td { (Shown(&escape(l.reason.as_bytes()))) }
            td { (l.attempts) }
            td { (Shown(&l.status)) }
            td { (l.created_at.format("%Y-%m-%d %H:%M:%S")) }
            td { (l.parked_behind) }
        }
    }
}

/// The query's filled fields, as name and value pairs (for links and hidden fields).
fn query_pairs(q: &LetterQuery) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (k, v) in [
        ("group", &q.group),
        ("status", &q.status),
        ("reason", &q.reason),
        ("order", &q.order),
        ("since", &q.since),
        ("until", &q.until),
    ] {
        if let Some(v) = v {
            out.push((k.to_owned(), v.clone()));
        }
    }
    out
}
