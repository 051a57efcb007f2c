//! Dead letters: `pipeline dead-letters list` with filters and paging, across one group or all,
//! and the form that replays, skips or discards the letters ticked, or every open letter the
//! filters match (at most [`super::BULK_LIMIT`] at a time).

use axum::extract::{Query, State};
use axum::response::Html;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use pipeline_core::record::escape;
use serde::{Deserialize, Serialize};

use super::html::{action_footer, esc, layout, opt};
use super::refusal::Refusal;
use super::session::{url_encode, Session};
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
) -> Result<Html<String>, Refusal> {
    let data = read(&console, &q).await?;
    let value = |s: &Option<String>| esc(s.as_deref().unwrap_or(""));
    let group_options: String = std::iter::once(("".to_owned(), "every group".to_owned()))
        .chain(data.groups.iter().map(|g| (g.clone(), g.clone())))
        .map(|(v, label)| {
            let selected = if some(&q.group).unwrap_or_default() == v {
                " selected"
            } else {
                ""
            };
            format!(
                r#"<option value="{}"{selected}>{}</option>"#,
                esc(&v),
                esc(&label)
            )
        })
        .collect();
    let status = q.status().unwrap_or_default();
    let status_options: String = [
        ("open", "open"),
        ("replayed", "replayed"),
        ("skipped", "skipped"),
        ("discarded", "discarded"),
        ("", "any"),
    ]
    .iter()
    .map(|(v, label)| {
        let selected = if status == *v { " selected" } else { "" };
        format!(r#"<option value="{v}"{selected}>{label}</option>"#)
    })
    .collect();
    let mut body = format!(
        r#"<h1>Dead letters</h1>
<form method="get" action="/dead-letters" class="filters">
<label>Group <select name="group">{group_options}</select></label>
<label>Status <select name="status">{status_options}</select></label>
<label>Order <input name="order" value="{}"></label>
<label>Reason contains <input name="reason" value="{}"></label>
<label>Since <input name="since" value="{}" placeholder="2026-11-25T03:00:00Z"></label>
<label>Until <input name="until" value="{}" placeholder="RFC 3339"></label>
<button type="submit">Filter</button></form>
<p class="muted" id="letters-count">{} letter(s) match; page {} of {}.</p>"#,
        value(&q.order),
        value(&q.reason),
        value(&q.since),
        value(&q.until),
        data.total,
        data.page,
        data.total.div_ceil(PAGE_SIZE).max(1),
    );
    body.push_str(r#"<form method="post" action="/actions/dead-letters" class="action">"#);
    body.push_str(
        r#"<table class="letters sortable" id="letters"><thead><tr><th data-nosort>✓</th><th>group</th><th>id</th><th>order</th><th>seq</th><th>type</th><th>partition/offset</th><th>reason</th><th>attempts</th><th>status</th><th>recorded</th><th>parked behind</th></tr></thead><tbody>"#,
    );
    for GroupLetter { group, letter: l } in &data.letters {
        let order = l
            .aggregate_id
            .as_deref()
            .map(|o| escape(o.as_bytes()).into_owned());
        let order_cell = match (&l.aggregate_id, &order) {
            (Some(raw), Some(shown)) => format!(
                r#"<a href="/timeline?id={}">{}</a>"#,
                url_encode(raw),
                esc(shown)
            ),
            _ => "-".to_owned(),
        };
        body.push_str(&format!(
            r#"<tr data-letter="{id}" data-order="{o}"><td><input type="checkbox" name="letter" value="{g}:{id}" aria-label="select letter {id}"></td><td>{g}</td><td>{id}</td><td>{order_cell}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            opt(l.sequence),
            opt(l.event_type.as_deref().map(|t| escape(t.as_bytes()))),
            l.partition,
            l.kafka_offset,
            esc(&escape(l.reason.as_bytes())),
            l.attempts,
            esc(&l.status),
            l.created_at.format("%Y-%m-%d %H:%M:%S"),
            l.parked_behind,
            id = l.id,
            g = esc(group),
            o = esc(order.as_deref().unwrap_or("")),
        ));
    }
    body.push_str("</tbody></table>");
    let mut pager = String::new();
    let link = |page: usize| {
        let mut params = query_pairs(&q);
        params.push(("page".to_owned(), page.to_string()));
        params
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encode(v)))
            .collect::<Vec<_>>()
            .join("&amp;")
    };
    if data.page > 1 {
        pager.push_str(&format!(
            r#"<a href="/dead-letters?{}">← previous</a> "#,
            link(data.page - 1)
        ));
    }
    if data.page.saturating_mul(PAGE_SIZE) < data.total {
        pager.push_str(&format!(
            r#"<a href="/dead-letters?{}">next →</a>"#,
            link(data.page + 1)
        ));
    }
    body.push_str(&format!(r#"<p class="pager">{pager}</p>"#));
    // The filters travel with the form, for "every letter that matches".
    for (k, v) in query_pairs(&q) {
        body.push_str(&format!(
            r#"<input type="hidden" name="filter_{}" value="{}">"#,
            esc(&k),
            esc(&v)
        ));
    }
    body.push_str(&format!(
        r#"<fieldset><legend>Act on dead letters</legend>
<label>Action <select name="how"><option value="replay">replay (apply again, then the parked events)</option><option value="skip">skip (pass over; apply the parked events)</option><option value="discard">discard (close a letter that holds nothing back)</option></select></label>
<label>Which <select name="scope"><option value="selected">the letters ticked above</option><option value="matching">every open letter the filters match (one group, at most {BULK_LIMIT})</option></select></label>
<label>For order (skip of an unreadable record whose key names no order; optional) <input name="for_order"></label>
{}</fieldset></form>"#,
        action_footer(&session, "Apply")
    ));
    Ok(Html(layout("Dead letters", Some(&session), &body)))
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
