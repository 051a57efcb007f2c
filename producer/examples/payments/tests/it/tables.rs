//! The example's program sets up the outbox's tables, the consumer library's and its own, and
//! nothing of the demonstration: run against a fresh database (`#[sqlx::test]`, `DATABASE_URL`)
//! and the broker (`KAFKA_BROKERS`), it leaves no table, view or index the demonstration's
//! migrations create.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;

use payments_example::program;
use pipeline_testkit::db::database_url;
use pipeline_testkit::kafka::{brokers, kafka_args};
use pipeline_testkit::scrape;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The tables, views, indexes and sequences the `.sql` files of `migrations/<set>` leave: those
/// they create, under the names later migrations of the set rename them to.
fn created_by(set: &str) -> BTreeSet<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../migrations")
        .join(set);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "sql"))
        .collect();
    paths.sort();
    let mut names = BTreeSet::new();
    for path in paths {
        let sql = std::fs::read_to_string(&path).expect("a migration");
        names.extend(created_names(&sql));
        for (old, new) in renamed_names(&sql) {
            if names.remove(&old) {
                names.insert(new);
            }
        }
    }
    assert!(!names.is_empty(), "{set} creates nothing?");
    names
}

/// The (old, new) names of `ALTER TABLE|INDEX|VIEW|SEQUENCE old RENAME TO new`.
fn renamed_names(sql: &str) -> Vec<(String, String)> {
    let words = words(sql);
    words
        .windows(4)
        .filter(|w| w[1] == "rename" && w[2] == "to")
        .map(|w| {
            (
                w[0].trim_matches('"').to_owned(),
                w[3].trim_matches('"').to_owned(),
            )
        })
        .collect()
}

/// The statement's words, lower case, without comments.
fn words(sql: &str) -> Vec<String> {
    let code: String = sql
        .lines()
        .map(|l| l.split("--").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join(" ");
    code.split(|c: char| c.is_whitespace() || c == '(' || c == ';')
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect()
}

/// The names after `CREATE [OR REPLACE] [UNIQUE] TABLE|VIEW|INDEX|SEQUENCE [IF NOT EXISTS]`.
fn created_names(sql: &str) -> Vec<String> {
    let words = words(sql);
    let mut names = Vec::new();
    for (i, word) in words.iter().enumerate() {
        if word != "create" {
            continue;
        }
        let mut rest = words[i + 1..]
            .iter()
            .skip_while(|w| ["or", "replace", "unique"].contains(&w.as_str()));
        if !rest
            .next()
            .is_some_and(|kind| ["table", "view", "index", "sequence"].contains(&kind.as_str()))
        {
            continue;
        }
        if let Some(name) = rest.find(|w| !["if", "not", "exists"].contains(&w.as_str())) {
            names.push(name.trim_matches('"').to_owned());
        }
    }
    names
}

#[sqlx::test(migrations = false)]
async fn the_program_sets_up_the_libraries_tables_and_its_own_and_nothing_of_the_demo(
    pool: PgPool,
) {
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("payment-events-{run_id}");
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 2)
        .await
        .expect("topic");
    let shutdown = CancellationToken::new();
    let program = program::start(
        common::config(&database_url(&pool), &topic, &format!("{run_id}-")),
        shutdown.clone(),
    )
    .await
    .expect("the program starts");
    // The runtime's metrics are on the program's own registry, served by its own route.
    let metrics = scrape(&program.addr.to_string()).await.expect("metrics");
    assert!(
        metrics.contains(&format!(
            "consumer_messages_total{{group=\"{run_id}-shipping\""
        )),
        "{metrics}"
    );
    shutdown.cancel();
    program.wait().await.expect("the program stops cleanly");

    let present: BTreeSet<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema()",
    )
    .fetch_all(&pool)
    .await
    .expect("relations")
    .into_iter()
    .collect();
    let demo: BTreeSet<String> = created_by("demo-orders")
        .into_iter()
        .chain(created_by("demo-groups"))
        .collect();
    for name in [
        "orders",
        "order_line",
        "product",
        "export_job",
        "inventory_stock",
    ] {
        assert!(
            demo.contains(name),
            "{name} not found in the demo's migrations"
        );
    }
    let leaked: Vec<&String> = demo.intersection(&present).collect();
    assert!(
        leaked.is_empty(),
        "the demonstration's {leaked:?} were set up"
    );
    let libraries: BTreeSet<String> = created_by("outbox")
        .into_iter()
        .chain(created_by("consumer"))
        .chain(["payment".to_owned(), "shipment_log".to_owned()])
        .collect();
    let missing: Vec<&String> = libraries.difference(&present).collect();
    assert!(missing.is_empty(), "{missing:?} were not set up");
}
