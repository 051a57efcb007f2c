//! Retention by hand and on an existing database, on a real PostgreSQL (`DATABASE_URL`):
//! `pipeline retention` (status, dry run, a run recorded with who and why, bad input refused);
//! and a database filled under the schema before retention (a month of history, today's work,
//! dead letters, parked events) migrates without copying or losing a row and with every
//! guarantee's key in force, after which retention removes the month-old history and nothing
//! else.

use std::borrow::Cow;

use chrono::Utc;
use clap::Parser;
use consumer::Groups;
use operator::cli::Cli;
use operator::error::exit_code;
use pipeline_core::retention::Runner;
use pipeline_testkit::db::{
    create_database, database_url, drop_database, migrated_database, server_url,
};
use pipeline_testkit::history::{append, attempt, publish};
use sqlx::migrate::Migrator;
use sqlx::PgPool;
use uuid::Uuid;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// `migrator` without the migrations from `first_new` on: the schema before them.
fn before(migrator: &Migrator, first_new: i64) -> Migrator {
    Migrator {
        migrations: Cow::Owned(
            migrator
                .iter()
                .filter(|m| m.version < first_new)
                .cloned()
                .collect(),
        ),
        ignore_missing: true,
        ..Migrator::DEFAULT
    }
}

const TABLES: [&str; 12] = [
    "outbox",
    "outbox_unpublished",
    "outbox_delivery",
    "outbox_attempt",
    "outbox_sequence",
    "processed_message",
    "applied_effect",
    "aggregate_progress",
    "group_transition",
    "dead_letter",
    "parked_event",
    "operator_action",
];

/// Each table's rows; `aggregate_progress` under its name before the migration that renamed it
/// when the database has not run it yet.
async fn counts(pool: &PgPool) -> Vec<i64> {
    let renamed: bool = sqlx::query_scalar("SELECT to_regclass('aggregate_progress') IS NOT NULL")
        .fetch_one(pool)
        .await
        .expect("catalog");
    let mut out = Vec::new();
    for t in TABLES {
        let t = if t == "aggregate_progress" && !renamed {
            "order_progress"
        } else {
            t
        };
        out.push(count(pool, &format!("SELECT count(*) FROM {t}")).await);
    }
    out
}

#[tokio::test]
async fn a_database_filled_before_retention_migrates_with_every_row_and_guarantee() {
    let server = server_url();
    let name = format!(
        "relay_upgrade_{}",
        &Uuid::new_v4().simple().to_string()[..10]
    );
    let url = create_database(&server, &name).await.expect("create");
    let pool = PgPool::connect(&url).await.expect("connect");
    let outbox_new = 20261126000005;
    let consumer_new = 20261126000104;
    before(&outbox::MIGRATOR, outbox_new)
        .run(&pool)
        .await
        .expect("outbox schema before retention");
    before(&consumer::MIGRATOR, consumer_new)
        .run(&pool)
        .await
        .expect("consumer schema before retention");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_tables WHERE tablename = 'retention_state'"
        )
        .await,
        0
    );

    // A month of history and today's work, under the old schema.
    let old = append(&pool, 2_000, 30).await;
    publish(&pool, &old, 30).await;
    let fresh = append(&pool, 500, 0).await;
    publish(&pool, &fresh[..400], 0).await;
    attempt(&pool, fresh[450], true).await;
    sqlx::query(
        "INSERT INTO outbox_sequence (aggregate_id, last_sequence)
         SELECT aggregate_id, 1 FROM outbox",
    )
    .execute(&pool)
    .await
    .expect("sequences");
    sqlx::raw_sql(
        "INSERT INTO partition_owner (group_name, topic, partition, owner)
         VALUES ('billing', 'orders', 0, gen_random_uuid());
         INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset,
                                        outcome, processed_at)
         SELECT 'billing', o.event_id, 'orders', 0, o.id, 'applied', d.published_at
         FROM outbox o JOIN outbox_delivery d USING (id);
         INSERT INTO applied_effect (group_name, event_id, order_id, sequence, event_type,
                                     applied_at)
         SELECT 'billing', o.event_id, o.aggregate_id, 1, o.event_type, d.published_at
         FROM outbox o JOIN outbox_delivery d USING (id);
         INSERT INTO order_progress (group_name, order_id, last_sequence, updated_at)
         SELECT 'billing', o.aggregate_id, 1, d.published_at
         FROM outbox o JOIN outbox_delivery d USING (id);
         INSERT INTO group_transition (group_name, event_id, order_id, sequence, event_type,
                                       transition, detail, at)
         SELECT 'billing', event_id, aggregate_id, 1, event_type, 'duplicate', 'redelivered',
                created_at
         FROM outbox WHERE id % 100 = 0;
         INSERT INTO dead_letter (group_name, topic, partition, kafka_offset, reason, created_at)
         SELECT 'billing', 'orders', 1, g, 'bad record', now() - interval '40 days'
         FROM generate_series(1, 5) g;
         INSERT INTO parked_event (group_name, order_id, sequence, event_id, event_type, payload,
                                   topic, partition, kafka_offset, reason)
         VALUES ('billing', 'order-late', 3, gen_random_uuid(), 'order.shipped', '{}',
                 'orders', 0, 99999, 'waiting for sequence 2');
         INSERT INTO operator_action (actor, action, reason, acted_at)
         VALUES ('ops', 'outbox.requeue', 'broker fixed', now() - interval '400 days'),
                ('ops', 'dead_letter.skip', 'bad data', now());",
    )
    .execute(&pool)
    .await
    .expect("fill");
    let before_counts = counts(&pool).await;

    // Migrate while in use: the new migrations copy and rewrite nothing.
    let started = std::time::Instant::now();
    outbox::MIGRATOR
        .run(&pool)
        .await
        .expect("outbox migrations");
    consumer::MIGRATOR
        .run(&pool)
        .await
        .expect("consumer migrations");
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    // A consumer's start attaches the effect history from before its time partitions.
    consumer::retention::ensure_partitions(
        &pool,
        &consumer::retention::RetentionSettings::default(),
    )
    .await
    .expect("partitions");
    assert_eq!(counts(&pool).await, before_counts, "{TABLES:?}");

    // The guarantees' keys still hold.
    let duplicate = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            let e = sqlx::query(sql).execute(&pool).await.expect_err(sql);
            assert_eq!(
                e.as_database_error().and_then(|d| d.code()).as_deref(),
                Some("23505"),
                "{sql}: {e}"
            );
        }
    };
    duplicate(
        "INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset,
                                        outcome)
         SELECT group_name, event_id, topic, partition, kafka_offset, outcome
         FROM processed_message LIMIT 1",
    )
    .await;
    duplicate(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload)
         SELECT gen_random_uuid(), business_key, event_type, 'other', 1, topic, payload
         FROM outbox LIMIT 1",
    )
    .await;
    duplicate(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload)
         SELECT gen_random_uuid(), 'another fact', event_type, aggregate_id, sequence, topic,
                payload
         FROM outbox LIMIT 1",
    )
    .await;

    // Retention on the migrated database removes the month-old history and nothing else.
    let mut all = relay::retention::rules(&relay::retention::RetentionSettings::default(), true);
    all.extend(
        consumer::retention::rules(&consumer::retention::RetentionSettings::default())
            .into_iter()
            .filter(|r| r.table != "operator_action"),
    );
    let run = Runner::new(all, "test")
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("retention");
    let removed = |t: &str| run.tables.iter().find(|r| r.table == t).expect(t).removed;
    assert_eq!(removed("outbox"), 2_000);
    // The effect history from before the migration is one partition, kept whole until its
    // newest row is past the window.
    assert_eq!(removed("applied_effect"), 0);
    assert_eq!(removed("dead_letter"), 0, "open letters stay");
    assert_eq!(removed("operator_action"), 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 500);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_unpublished").await,
        100
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempt").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM parked_event").await, 1);
    assert_eq!(removed("processed_message"), 2_000);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_message WHERE processed_at > now() - interval '1 day'"
        )
        .await,
        400
    );

    // A week on, that partition goes whole, but for what an order held back still needs.
    let effects: Vec<_> =
        consumer::retention::rules(&consumer::retention::RetentionSettings::default())
            .into_iter()
            .filter(|r| r.table == "applied_effect")
            .collect();
    let week_on = Runner::new(effects, "test")
        .run_once(&pool, Utc::now() + chrono::Duration::days(8), false)
        .await
        .expect("retention a week on");
    let held = count(&pool, "SELECT count(*) FROM applied_effect_held").await;
    assert_eq!(week_on.tables[0].partitions_removed, 1, "{week_on:?}");
    assert_eq!(
        week_on.tables[0].removed,
        2_400 - held as u64,
        "{week_on:?}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM applied_effect").await, 0);
    pool.close().await;
    drop_database(&server, &name).await.expect("drop");
}

/// Runs `pipeline args…` in-process against `pool`'s database.
async fn pipeline(pool: &PgPool, args: &[&str]) -> anyhow::Result<()> {
    let url = database_url(pool);
    let argv = ["pipeline", "--database-url", &url]
        .into_iter()
        .map(str::to_owned)
        .chain(args.iter().map(|a| (*a).to_owned()));
    let cli = Cli::try_parse_from(argv).expect("arguments");
    operator::run(cli, &Groups::new()).await
}

#[tokio::test]
async fn pipeline_retention_shows_dry_runs_and_runs_with_who_and_why() {
    let (name, pool) = migrated_database("operator_retention")
        .await
        .expect("database");
    let old = append(&pool, 100, 30).await;
    publish(&pool, &old, 30).await;
    let _fresh = append(&pool, 10, 0).await;

    pipeline(&pool, &["retention", "status"])
        .await
        .expect("status");
    pipeline(&pool, &["retention", "run", "--dry-run"])
        .await
        .expect("dry run");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 110);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM operator_action").await,
        0
    );

    // A run that changes something says why.
    let e = pipeline(&pool, &["retention", "run"])
        .await
        .expect_err("no note");
    assert_eq!(exit_code(&e), 2, "{e:#}");
    assert!(e.to_string().contains("--note"), "{e:#}");
    let e = pipeline(
        &pool,
        &["retention", "run", "--note", "  ", "--actor", "ops"],
    )
    .await
    .expect_err("blank note");
    assert_eq!(exit_code(&e), 2, "{e:#}");

    pipeline(
        &pool,
        &[
            "retention",
            "run",
            "--note",
            "disk filling up",
            "--actor",
            "ops",
        ],
    )
    .await
    .expect("run");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 10);
    let (actor, reason, removed): (String, String, i64) = sqlx::query_as(
        "SELECT actor, reason, (detail -> 'removed' ->> 'outbox')::bigint FROM operator_action
         WHERE action = 'retention.run'",
    )
    .fetch_one(&pool)
    .await
    .expect("recorded");
    assert_eq!(
        (actor.as_str(), reason.as_str(), removed),
        ("ops", "disk filling up", 100)
    );
    let by: String =
        sqlx::query_scalar("SELECT updated_by FROM retention_state WHERE table_name = 'outbox'")
            .fetch_one(&pool)
            .await
            .expect("state");
    assert_eq!(by, "pipeline retention run by ops");
    pipeline(&pool, &["retention", "status"])
        .await
        .expect("status");
    pool.close().await;
    drop_database(&server_url(), &name).await.expect("drop");
}
