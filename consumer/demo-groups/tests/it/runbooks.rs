//! Every command and SQL statement the runbooks give (the alert rules' `runbook` annotations and
//! deploy/README.md) works: each `pipeline …` command parses, and each SQL statement runs against
//! a database migrated with the pipeline's migrations (`#[sqlx::test]`, `DATABASE_URL`).

use clap::Parser;
use operator::cli::Cli;
use sqlx::PgPool;

const ALERTS: &str = include_str!("../../../../deploy/prometheus/alerts.yml");
const DEPLOY_README: &str = include_str!("../../../../deploy/README.md");

/// What a runbook tells the operator to run.
#[derive(Debug, Default)]
struct Runbook {
    commands: Vec<String>,
    statements: Vec<String>,
}

/// The snippets of `text`: inline `code` (a folded YAML block's lines joined first) and the lines
/// of fenced blocks; template placeholders filled in as an operator would.
fn runbook(text: &str) -> Runbook {
    let mut found = Runbook::default();
    let mut sort = |snippet: &str| {
        let snippet = snippet
            .replace("{{ $labels.group }}", "inventory")
            .split(" # ")
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        if snippet.starts_with("pipeline ") {
            found.commands.push(snippet);
        } else if snippet.to_ascii_uppercase().starts_with("SELECT ") {
            found
                .statements
                .push(snippet.trim_end_matches(';').to_owned());
        }
    };
    let mut fenced = false;
    let mut prose = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            sort(line);
        } else {
            prose.push(' ');
            prose.push_str(line.trim());
        }
    }
    // Inline code: from a backtick to the next, at least one character between (a second
    // backtick right after the first may open the next span).
    let mut rest = prose.as_str();
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        match after.find('`') {
            Some(0) => rest = after,
            Some(close) => {
                sort(&after[..close]);
                rest = &after[close + 1..];
            }
            None => break,
        }
    }
    found
}

#[test]
fn runbooks_name_the_operator_command_and_current_sql() {
    let alerts = runbook(ALERTS);
    assert!(alerts.commands.len() >= 4, "{alerts:?}");
    assert!(alerts.statements.len() >= 2, "{alerts:?}");
    let readme = runbook(DEPLOY_README);
    assert!(readme.commands.len() >= 6, "{readme:?}");
}

#[test]
fn every_runbook_command_parses() {
    for command in runbook(ALERTS)
        .commands
        .into_iter()
        .chain(runbook(DEPLOY_README).commands)
    {
        let args = shell_words::split(&command).expect("shell words");
        if let Err(e) = Cli::try_parse_from(&args) {
            panic!("runbook command `{command}` does not parse: {e}");
        }
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn every_runbook_statement_runs_on_the_current_schema(pool: PgPool) {
    let statements: Vec<String> = runbook(ALERTS)
        .statements
        .into_iter()
        .chain(runbook(DEPLOY_README).statements)
        .collect();
    for statement in &statements {
        let mut tx = pool.begin().await.expect("begin");
        if let Err(e) = sqlx::query(statement).fetch_all(&mut *tx).await {
            panic!("runbook statement `{statement}` fails: {e}");
        }
        tx.rollback().await.expect("rollback");
    }
}
