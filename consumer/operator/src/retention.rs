//! `pipeline retention`: what retention keeps and last did in each database (`status`), and a
//! run by hand (`run`, or `run --dry-run` to see what it would remove, removing nothing).
//!
//! The rules are the ones the relay and the consumers run (the outbox's in a database with the
//! outbox's tables, the groups' in one with theirs), with the windows their runners last
//! recorded in `retention_state` (the defaults where none ran yet). A run takes the same
//! advisory lock as theirs, so it never works beside one, and is recorded in `operator_action`
//! (who, why, what it removed) in each database it changed.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use pipeline_core::db::redact_url;
use pipeline_core::retention::state::{self, TableState};
use pipeline_core::retention::{Rule, Runner, TableReport, Window};
use serde::Serialize;
use sqlx::PgPool;

use crate::args::{RetentionAction, RetentionRunArgs};
use crate::error::BadInput;
use crate::output::{age, cell, table};
use crate::targets::Targets;

/// One table of one database.
#[derive(Debug, Serialize)]
pub struct TableStatus {
    /// The database (its URL, password hidden).
    pub database: String,
    /// The table.
    pub table: String,
    /// Its window in force.
    pub window: String,
    /// What it keeps whatever its age.
    pub keeps: String,
    /// Its runner's last record, if one ran.
    pub last: Option<TableState>,
}

/// One database's part of a run.
#[derive(Debug, Serialize)]
pub struct DatabaseRun {
    /// The database (its URL, password hidden).
    pub database: String,
    /// Another runner held it: nothing was done there.
    pub busy: bool,
    /// Each table's part.
    pub tables: Vec<TableReport>,
}

/// Runs `action`, printing its result.
pub async fn run(targets: &Targets, action: &RetentionAction, json: bool) -> anyhow::Result<()> {
    match action {
        RetentionAction::Status => {
            let status = status(targets).await?;
            if json {
                crate::output::json(&status)
            } else {
                print_status(&status);
                Ok(())
            }
        }
        RetentionAction::Run(args) => {
            let runs = run_now(targets, args).await?;
            if json {
                crate::output::json(&runs)
            } else {
                print_runs(&runs, args.dry_run);
                Ok(())
            }
        }
    }
}

/// The databases the commands reach: the outbox's and each `--group-database`, once each.
fn database_urls(targets: &Targets) -> Vec<String> {
    let mut urls = vec![targets.args.database_url.clone()];
    for (_, url) in &targets.args.group_databases {
        if !urls.contains(url) {
            urls.push(url.clone());
        }
    }
    urls
}

/// The rules of `pool`'s database, by the tables it holds, with the recorded windows.
async fn rules_of(pool: &PgPool) -> anyhow::Result<(Vec<Rule>, BTreeMap<String, TableState>)> {
    let (outbox_here, groups_here): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('outbox') IS NOT NULL, to_regclass('processed_message') IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    let recorded: BTreeMap<String, TableState> = if outbox_here || groups_here {
        state::read(pool)
            .await?
            .into_iter()
            .map(|s| (s.table_name.clone(), s))
            .collect()
    } else {
        BTreeMap::new()
    };
    let window =
        |table: &str, default: Window| recorded.get(table).map_or(default, TableState::window);
    let mut rules: Vec<Rule> = Vec::new();
    if outbox_here {
        let defaults = relay::retention::RetentionSettings::default();
        let settings = relay::retention::RetentionSettings {
            published: window("outbox", defaults.published),
            operator_actions: window("operator_action", defaults.operator_actions),
            ..defaults
        };
        rules.extend(relay::retention::rules(&settings, groups_here));
    }
    if groups_here {
        let defaults = consumer::retention::RetentionSettings::default();
        let settings = consumer::retention::RetentionSettings {
            dedupe: window("processed_message", defaults.dedupe),
            progress: window("aggregate_progress", defaults.progress),
            history: window("applied_effect", defaults.history),
            dead_letters: window("dead_letter", defaults.dead_letters),
            operator_actions: window("operator_action", defaults.operator_actions),
            ..defaults
        };
        for rule in consumer::retention::rules(&settings) {
            if !rules.iter().any(|r| r.table == rule.table) {
                rules.push(rule);
            }
        }
    }
    Ok((rules, recorded))
}

/// Every database's tables, their windows and their runners' last records.
pub async fn status(targets: &Targets) -> anyhow::Result<Vec<TableStatus>> {
    let mut out = Vec::new();
    for url in database_urls(targets) {
        let pool = targets.pool_of(&url).await?;
        let (rules, mut recorded) = rules_of(&pool).await?;
        for rule in rules {
            out.push(TableStatus {
                database: redact_url(&url),
                table: rule.table.to_owned(),
                window: rule.window.to_string(),
                keeps: rule.keeps.to_owned(),
                last: recorded.remove(rule.table),
            });
        }
    }
    Ok(out)
}

/// Runs every database's rules now (or as a dry run), to the end of what is removable.
pub async fn run_now(
    targets: &Targets,
    args: &RetentionRunArgs,
) -> anyhow::Result<Vec<DatabaseRun>> {
    let actor = match (&args.note, args.dry_run) {
        (Some(note), _) if !note.trim().is_empty() => Some(args.actor()?),
        (_, true) => None,
        _ => {
            return Err(
                BadInput::Refused("say why: --note (not needed with --dry-run)".to_owned()).into(),
            )
        }
    };
    let mut runs = Vec::new();
    for url in database_urls(targets) {
        let pool = targets.pool_of(&url).await?;
        let (rules, _) = rules_of(&pool).await?;
        if rules.is_empty() {
            continue;
        }
        let by = match &actor {
            Some(a) => format!("pipeline retention run by {a}"),
            None => "pipeline retention run --dry-run".to_owned(),
        };
        // One run to the end: every table until caught up, a swept one through a whole pass.
        let report = Runner::new(rules, by)
            .max_steps(1_000_000)
            .run_once(&pool, Utc::now(), args.dry_run)
            .await?;
        if let (Some(actor), false) = (&actor, report.skipped || args.dry_run) {
            let removed: BTreeMap<&str, u64> = report
                .tables
                .iter()
                .map(|t| (t.table.as_str(), t.removed))
                .collect();
            sqlx::query(
                "INSERT INTO operator_action (actor, action, reason, detail)
                 VALUES ($1, 'retention.run', $2, $3)",
            )
            .bind(actor)
            .bind(args.note.as_deref().unwrap_or_default())
            .bind(serde_json::json!({ "removed": removed }))
            .execute(&pool)
            .await?;
        }
        runs.push(DatabaseRun {
            database: redact_url(&url),
            busy: report.skipped,
            tables: report.tables,
        });
    }
    Ok(runs)
}

fn since(at: Option<DateTime<Utc>>) -> String {
    cell(at.map(|t| {
        format!(
            "{} ago",
            age((Utc::now() - t).num_milliseconds() as f64 / 1000.0)
        )
    }))
}

fn print_status(status: &[TableStatus]) {
    let mut t = table(&[
        "database",
        "table",
        "window",
        "last run",
        "caught up",
        "removed (last/total)",
        "oldest kept",
        "by",
    ]);
    for s in status {
        let (last_run, caught_up, removed, oldest, by) = match &s.last {
            Some(l) => (
                since(l.last_run_at),
                since(l.caught_up_at),
                format!("{}/{}", l.last_removed, l.total_removed),
                since(l.oldest_kept_at),
                cell(l.updated_by.clone()),
            ),
            None => (
                "never".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ),
        };
        crate::output::row(
            &mut t,
            vec![
                s.database.clone(),
                s.table.clone(),
                s.window.clone(),
                last_run,
                caught_up,
                removed,
                oldest,
                by,
            ],
        );
    }
    println!("{t}");
    println!("Kept whatever their age:");
    let mut seen = std::collections::BTreeSet::new();
    for s in status {
        if seen.insert(&s.table) {
            println!("  {}: {}", s.table, s.keeps);
        }
    }
}

fn print_runs(runs: &[DatabaseRun], dry_run: bool) {
    let removed = if dry_run { "would remove" } else { "removed" };
    let mut t = table(&[
        "database",
        "table",
        "window",
        "older than",
        removed,
        "caught up",
    ]);
    for r in runs {
        if r.busy {
            crate::output::row(
                &mut t,
                vec![
                    r.database.clone(),
                    "(another runner is at work: try again)".to_owned(),
                ],
            );
        }
        for table in &r.tables {
            crate::output::row(
                &mut t,
                vec![
                    r.database.clone(),
                    table.table.clone(),
                    table.window.clone(),
                    table
                        .cutoff
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    if table.partitions_removed > 0 {
                        format!(
                            "{} ({} partitions)",
                            table.removed, table.partitions_removed
                        )
                    } else {
                        table.removed.to_string()
                    },
                    if table.caught_up { "yes" } else { "no" }.to_owned(),
                ],
            );
        }
    }
    println!("{t}");
}
