//! `pipeline dead-letters --group G list | show | replay | skip | discard`.
//!
//! Changing actions take one letter (`--id`) or every open letter the filters match, and act on
//! them one by one in each order's sequence, each in a transaction of its own that also records
//! who acted and why. They are idempotent: a letter already resolved is reported and left as it
//! is, so a run that stopped half-way can be run again.

use chrono::{DateTime, Utc};
use consumer::operator::dead_letters::{self as resolve, Resolution, ResolveError};
use consumer::Groups;
use pipeline_core::record::{escape, RecordHeaders};
use serde::Serialize;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

use crate::args::{DeadLetterAction, DeadLetterArgs, LetterAction, LetterFilter};
use crate::error::BadInput;
use crate::output::{cell, table};
use crate::targets::{KnownBy, Targets};

/// A dead letter as listed.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Letter {
    /// The id the actions take.
    pub id: i64,
    /// The event, when the record was readable.
    pub event_id: Option<Uuid>,
    /// Its order: from the event, else from the record's key.
    pub aggregate_id: Option<String>,
    /// Its sequence, when readable.
    pub sequence: Option<i64>,
    /// Its type, when readable.
    pub event_type: Option<String>,
    /// The record's topic.
    pub topic: String,
    /// The record's partition.
    pub partition: i32,
    /// The record's offset.
    pub kafka_offset: i64,
    /// Why it was dead-lettered.
    pub reason: String,
    /// How many times it was tried.
    pub attempts: i32,
    /// open, replayed, skipped or discarded.
    pub status: String,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// When it was resolved, if it was.
    pub resolved_at: Option<DateTime<Utc>>,
    /// The note it was resolved with.
    pub note: Option<String>,
    /// Events of its order parked behind it.
    pub parked_behind: i64,
}

/// One letter whole. The record's bytes are shown escaped: UTF-8 text as it is, a backslash as
/// `\\`, control characters as `\0`, `\n`, `\u{1b}`…, and bytes that are not UTF-8 as `\xNN`
/// (reversible, so the exact bytes can be read back from it).
#[derive(Debug, Serialize)]
pub struct ShownLetter {
    /// The listed fields.
    #[serde(flatten)]
    pub letter: Letter,
    /// The record's headers in order, duplicates and all: name and escaped value (`None`: a
    /// header without a value).
    pub headers: Vec<(String, Option<String>)>,
    /// The record's value, escaped.
    pub payload: Option<String>,
    /// The value's length in bytes.
    pub payload_bytes: Option<usize>,
    /// The record's key, escaped.
    pub key: Option<String>,
    /// The key's length in bytes.
    pub key_bytes: Option<usize>,
    /// The sequences parked behind it.
    pub parked_sequences: Vec<i64>,
}

/// What an action did to one letter.
#[derive(Debug, Serialize)]
pub struct Outcome {
    /// The letter.
    pub id: i64,
    /// Its order, when known.
    pub aggregate_id: Option<String>,
    /// replayed, skipped, discarded, or already-… when it was resolved before.
    pub outcome: String,
    /// Parked events applied after it.
    pub unparked: usize,
}

const LETTER_COLUMNS: &str = "d.id, d.event_id, d.aggregate_id, d.sequence, d.event_type,
    d.topic, d.partition, d.kafka_offset, d.reason, d.attempts, d.status, d.created_at,
    d.resolved_at, d.note,
    (SELECT count(*) FROM parked_event p
     WHERE p.group_name = d.group_name AND p.aggregate_id = d.aggregate_id) AS parked_behind";

/// Which letters of a group match: `$1` the group, `$2` the status, `$3`–`$7` the filter's id,
/// reason, since, until and order.
const LETTER_MATCH: &str = "d.group_name = $1 AND ($2::text IS NULL OR d.status = $2)
    AND ($3::bigint IS NULL OR d.id = $3)
    AND ($4::text IS NULL OR strpos(d.reason, $4) > 0)
    AND ($5::timestamptz IS NULL OR d.created_at >= $5)
    AND ($6::timestamptz IS NULL OR d.created_at < $6)
    AND ($7::text IS NULL OR d.aggregate_id = $7)";

/// Refuses a status or a time range no letter could match.
fn check(filter: &LetterFilter, status: Option<&str>) -> Result<(), BadInput> {
    if let Some(s) = status {
        if !["open", "replayed", "skipped", "discarded"].contains(&s) {
            return Err(BadInput::Refused(format!(
                "unknown status {s}: open, replayed, skipped or discarded"
            )));
        }
    }
    if let (Some(since), Some(until)) = (filter.since, filter.until) {
        if since >= until {
            return Err(BadInput::Refused(format!(
                "--since {since} is not before --until {until}"
            )));
        }
    }
    Ok(())
}

/// Letters of `group` matching `filter` and `status`, in each order's sequence (at most 10,000).
pub async fn list(
    pool: &PgPool,
    group: &str,
    filter: &LetterFilter,
    status: Option<&str>,
) -> anyhow::Result<Vec<Letter>> {
    list_page(pool, group, filter, status, 0, 10_000).await
}

/// The letters [`list`] gives from the `offset`th on, at most `limit` of them: one page, read as
/// such.
pub async fn list_page(
    pool: &PgPool,
    group: &str,
    filter: &LetterFilter,
    status: Option<&str>,
    offset: i64,
    limit: i64,
) -> anyhow::Result<Vec<Letter>> {
    check(filter, status)?;
    let sql = format!(
        "SELECT {LETTER_COLUMNS} FROM dead_letter d WHERE {LETTER_MATCH}
         ORDER BY d.aggregate_id, d.sequence NULLS FIRST, d.id
         OFFSET $8 LIMIT $9"
    );
    Ok(matching(sqlx::query_as(&sql), group, filter, status)
        .bind(offset)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// How many letters of `group` match `filter` and `status`.
pub async fn count(
    pool: &PgPool,
    group: &str,
    filter: &LetterFilter,
    status: Option<&str>,
) -> anyhow::Result<i64> {
    check(filter, status)?;
    let sql = format!("SELECT count(*) FROM dead_letter d WHERE {LETTER_MATCH}");
    let (count,): (i64,) = matching(sqlx::query_as(&sql), group, filter, status)
        .fetch_one(pool)
        .await?;
    Ok(count)
}

/// `query` with [`LETTER_MATCH`]'s parameters bound: the group, the status and the filter.
fn matching<'q, T>(
    query: QueryAs<'q, Postgres, T, PgArguments>,
    group: &'q str,
    filter: &'q LetterFilter,
    status: Option<&'q str>,
) -> QueryAs<'q, Postgres, T, PgArguments> {
    query
        .bind(group)
        .bind(status)
        .bind(filter.id)
        .bind(&filter.reason)
        .bind(filter.since)
        .bind(filter.until)
        .bind(&filter.aggregate)
}

/// Runs a `dead-letters` command and prints its result.
pub async fn run(
    targets: &Targets,
    args: &DeadLetterArgs,
    groups: &Groups,
    json: bool,
) -> anyhow::Result<()> {
    let group = targets.one_group(KnownBy::Database).await?;
    let pool = targets.group(&group).await?;
    let name = targets.qualified(&group);
    match &args.action {
        DeadLetterAction::List { filter, status } => {
            let letters = list(&pool, &name, filter, Some(status)).await?;
            if json {
                crate::output::json(&letters)
            } else {
                print_list(&letters);
                Ok(())
            }
        }
        DeadLetterAction::Show { id } => {
            let shown = show(&pool, &name, *id).await?;
            if json {
                crate::output::json(&shown)
            } else {
                print_shown(&shown);
                Ok(())
            }
        }
        DeadLetterAction::Replay(action) => {
            act(targets, args, groups, action, Resolution::Replay, json).await
        }
        DeadLetterAction::Skip(action) => {
            act(targets, args, groups, action, Resolution::Skip, json).await
        }
        DeadLetterAction::Discard(action) => {
            act(targets, args, groups, action, Resolution::Discard, json).await
        }
    }
}

/// One letter of `group` (its qualified name) whole.
pub async fn show(pool: &PgPool, group: &str, id: i64) -> anyhow::Result<ShownLetter> {
    let filter = LetterFilter {
        id: Some(id),
        ..LetterFilter::default()
    };
    let letter = list(pool, group, &filter, None)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| BadInput::NotFound {
            what: "dead letter",
            id: format!("{id} in group {group}"),
        })?;
    let stored: StoredRecord = sqlx::query_as(
        "SELECT headers, header_names, header_values, payload, key FROM dead_letter WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await?;
    let parked_sequences: Vec<i64> = sqlx::query_scalar(
        "SELECT sequence FROM parked_event WHERE group_name = $1 AND aggregate_id = $2 ORDER BY sequence",
    )
    .bind(group)
    .bind(&letter.aggregate_id)
    .fetch_all(pool)
    .await?;
    let text = |b: &Option<Vec<u8>>| b.as_deref().map(|b| escape(b).into_owned());
    let headers = match (&stored.header_names, &stored.header_values) {
        (Some(names), Some(values)) => RecordHeaders::from_columns(names, values)
            .iter()
            .map(|(k, v)| {
                (
                    escape(k.as_bytes()).into_owned(),
                    v.map(|v| escape(v).into_owned()),
                )
            })
            .collect(),
        // A letter without its exact headers: their readable form.
        _ => match &stored.headers {
            serde_json::Value::Object(map) => map
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().map(str::to_owned)))
                .collect(),
            _ => Vec::new(),
        },
    };
    Ok(ShownLetter {
        letter,
        headers,
        payload: text(&stored.payload),
        payload_bytes: stored.payload.as_ref().map(Vec::len),
        key: text(&stored.key),
        key_bytes: stored.key.as_ref().map(Vec::len),
        parked_sequences,
    })
}

#[derive(sqlx::FromRow)]
struct StoredRecord {
    headers: serde_json::Value,
    header_names: Option<Vec<Vec<u8>>>,
    header_values: Option<Vec<Option<Vec<u8>>>>,
    payload: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
}

/// What [`resolve_letters`] did: an outcome for each letter it reached, and, when it stopped
/// early, why (the letters after that one are untouched).
#[derive(Debug, Serialize)]
pub struct Resolved {
    /// Letters the filters matched (at most the limit given).
    pub matched: usize,
    /// What happened to each letter, in the order they were taken.
    pub outcomes: Vec<Outcome>,
    /// Why it stopped before the end, if it did.
    #[serde(skip)]
    pub failure: Option<anyhow::Error>,
}

/// Replays, skips or discards the letters of `group` (a known name without the prefix) that
/// `action` selects, at most `limit` of them, one by one in each order's sequence, each recorded
/// with `action.change`'s actor and note. `dead_letter_topic` is the groups' template (empty: do
/// not publish letters raised while unparking parked events). The `dead-letters` command and the
/// web console both act through here.
pub async fn resolve_letters(
    targets: &Targets,
    group: &str,
    dead_letter_topic: &str,
    groups: &Groups,
    action: &LetterAction,
    how: Resolution,
    limit: usize,
) -> anyhow::Result<Resolved> {
    let (verb, resolved) = match how {
        Resolution::Replay => ("replay", "replayed"),
        Resolution::Skip => ("skip", "skipped"),
        Resolution::Discard => ("discard", "discarded"),
    };
    if action.filter.is_empty() && !action.all {
        return Err(BadInput::NoFilter(verb).into());
    }
    let actor = action.change.actor()?;
    let pool = targets.group(group).await?;
    let name = targets.qualified(group);
    let handler = groups
        .handler(group, name.clone())
        .map_err(|e| BadInput::Refused(format!("{e}: {verb} needs the group's handler")))?;
    let sink = if dead_letter_topic.is_empty() {
        None
    } else {
        Some(consumer::operator::DeadLetterSink::new(
            &targets.args.kafka,
            dead_letter_topic,
        )?)
    };
    // An id names one letter, resolved or not; filters select the open ones.
    let status = if action.filter.id.is_some() {
        None
    } else {
        Some("open")
    };
    let mut letters = list(&pool, &name, &action.filter, status).await?;
    letters.truncate(limit);
    if letters.is_empty() {
        if let Some(id) = action.filter.id {
            return Err(BadInput::NotFound {
                what: "dead letter",
                id: format!("{id} in group {group}"),
            }
            .into());
        }
    }
    let mut outcomes = Vec::new();
    let mut failure = None;
    for letter in &letters {
        if letter.status != "open" {
            outcomes.push(Outcome {
                id: letter.id,
                aggregate_id: letter.aggregate_id.clone(),
                outcome: format!("already {}", letter.status),
                unparked: 0,
            });
            continue;
        }
        let request = resolve::Request {
            id: letter.id,
            how,
            actor: &actor,
            note: &action.change.note,
            for_aggregate: action.for_aggregate.as_deref(),
        };
        match resolve::resolve(&pool, handler.as_ref(), sink.as_ref(), request).await {
            Ok(done) => outcomes.push(Outcome {
                id: letter.id,
                aggregate_id: done.aggregate_id,
                outcome: resolved.to_owned(),
                unparked: done.unparked,
            }),
            Err(e @ ResolveError::Process(_)) => {
                failure = Some(anyhow::Error::from(e));
                break;
            }
            Err(e) => {
                failure = Some(BadInput::Refused(format!("dead letter {}: {e}", letter.id)).into());
                break;
            }
        }
    }
    let failure = failure.map(|e| {
        e.context(format!(
            "stopped after {} of {} letter(s); the rest are untouched",
            outcomes.len(),
            letters.len()
        ))
    });
    Ok(Resolved {
        matched: letters.len(),
        outcomes,
        failure,
    })
}

async fn act(
    targets: &Targets,
    args: &DeadLetterArgs,
    groups: &Groups,
    action: &LetterAction,
    how: Resolution,
    json: bool,
) -> anyhow::Result<()> {
    let verb = match how {
        Resolution::Replay => "replay",
        Resolution::Skip => "skip",
        Resolution::Discard => "discard",
    };
    if action.filter.is_empty() && !action.all {
        return Err(BadInput::NoFilter(verb).into());
    }
    let group = targets.one_group(KnownBy::Database).await?;
    let resolved = resolve_letters(
        targets,
        &group,
        &args.dead_letter_topic,
        groups,
        action,
        how,
        usize::MAX,
    )
    .await?;
    if resolved.matched == 0 {
        println!("no open dead letter of {group} matches: nothing to do");
        return Ok(());
    }
    if json {
        crate::output::json(&resolved.outcomes)?;
    } else {
        let mut t = table(&["dead letter", "order", "outcome", "parked events unparked"]);
        for o in &resolved.outcomes {
            crate::output::row(
                &mut t,
                vec![
                    o.id.to_string(),
                    cell(o.aggregate_id.as_ref()),
                    o.outcome.clone(),
                    o.unparked.to_string(),
                ],
            );
        }
        println!("{t}");
    }
    match resolved.failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn print_list(letters: &[Letter]) {
    let mut t = table(&[
        "id",
        "order",
        "seq",
        "type",
        "partition/offset",
        "reason",
        "attempts",
        "status",
        "recorded",
        "parked behind",
    ]);
    for l in letters {
        crate::output::row(
            &mut t,
            vec![
                l.id.to_string(),
                text_cell(l.aggregate_id.as_deref()),
                cell(l.sequence),
                text_cell(l.event_type.as_deref()),
                format!("{}/{}", l.partition, l.kafka_offset),
                text_cell(Some(&l.reason)),
                l.attempts.to_string(),
                l.status.clone(),
                l.created_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                l.parked_behind.to_string(),
            ],
        );
    }
    println!("{t}");
    println!("{} letter(s)", letters.len());
}

fn print_shown(s: &ShownLetter) {
    let l = &s.letter;
    let mut t = table(&["field", "value"]);
    let rows: Vec<(&str, String)> = vec![
        ("id", l.id.to_string()),
        ("status", l.status.clone()),
        ("order", text_cell(l.aggregate_id.as_deref())),
        ("sequence", cell(l.sequence)),
        ("event", cell(l.event_id)),
        ("type", text_cell(l.event_type.as_deref())),
        (
            "record",
            format!(
                "{} partition {} offset {}",
                l.topic, l.partition, l.kafka_offset
            ),
        ),
        ("reason", text_cell(Some(&l.reason))),
        ("attempts", l.attempts.to_string()),
        ("recorded", l.created_at.to_rfc3339()),
        ("resolved", cell(l.resolved_at.map(|t| t.to_rfc3339()))),
        ("note", text_cell(l.note.as_deref())),
        ("key", bytes_cell(s.key.as_ref(), s.key_bytes)),
        (
            "headers",
            s.headers
                .iter()
                .map(|(k, v)| match v {
                    Some(v) => format!("{k}: {v}"),
                    None => format!("{k} (no value)"),
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        ("payload", bytes_cell(s.payload.as_ref(), s.payload_bytes)),
        ("parked behind", format!("{:?}", s.parked_sequences)),
    ];
    for (k, v) in rows {
        crate::output::row(&mut t, vec![k.to_owned(), v]);
    }
    println!("{t}");
}

/// Escaped bytes with their length: `"…" (N bytes)`, or `-` when there are none.
fn bytes_cell(text: Option<&String>, len: Option<usize>) -> String {
    match (text, len) {
        (Some(t), Some(n)) => format!("{t} ({n} bytes)"),
        _ => cell(text),
    }
}

/// Text that came with a record, escaped for a terminal (no control characters).
fn text_cell(text: Option<&str>) -> String {
    cell(text.map(|t| escape(t.as_bytes())))
}
