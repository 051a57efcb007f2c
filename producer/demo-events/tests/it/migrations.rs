//! The sets of migrations against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): the
//! pipeline's own create the pipeline's tables and nothing of the demonstration, and every set
//! can be applied beside the others, in any order, again and again.

use demo_events::schema::{CONSUMER_MIGRATOR, MIGRATOR};
use sqlx::migrate::Migrator;

/// The pipeline's own tables: the outbox's and the consumer library's.
const PIPELINE: [&Migrator; 2] = [&outbox::MIGRATOR, &CONSUMER_MIGRATOR];

async fn migrate(pool: &PgPool, sets: &[&Migrator]) -> Result<(), sqlx::migrate::MigrateError> {
    for set in sets {
        set.run(pool).await?;
    }
    Ok(())
}
use sqlx::PgPool;

async fn tables(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables t
         WHERE table_schema = 'public' AND table_name <> '_sqlx_migrations'
           -- a partitioned table's partitions are part of it
           AND NOT EXISTS (SELECT 1 FROM pg_class c
                           WHERE c.relname = t.table_name AND c.relispartition)
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("tables")
}

const PIPELINE_TABLES: [&str; 28] = [
    "applied_effect",
    "applied_effect_held",
    "dead_letter",
    "group_history",
    "group_pause",
    "group_rate_limit",
    "group_transition",
    "operator_action",
    "aggregate_progress",
    "outbox",
    "outbox_attempt",
    "outbox_delayed",
    "outbox_delivery",
    "outbox_history",
    "outbox_relay_wakeup",
    "outbox_schedule",
    "outbox_schedule_floor",
    "outbox_schedule_occurrence",
    "outbox_sequence",
    "outbox_status",
    "outbox_unpublished",
    "outbox_wal_source",
    "parked_event",
    "parked_record",
    "partition_owner",
    "processed_message",
    "progress_horizon",
    "retention_state",
];

#[sqlx::test(migrations = false)]
async fn the_pipeline_alone_creates_its_tables_and_none_of_the_demo(pool: PgPool) {
    migrate(&pool, &PIPELINE)
        .await
        .expect("pipeline migrations");
    let mut expected: Vec<String> = PIPELINE_TABLES.iter().map(|t| (*t).to_owned()).collect();
    expected.push("relay_lease".to_owned());
    expected.sort();
    assert_eq!(tables(&pool).await, expected);
    for demo in [
        "orders",
        "order_line",
        "product",
        "inventory_stock",
        "inventory_reservation",
        "notification",
        "export_job",
    ] {
        assert!(!tables(&pool).await.contains(&demo.to_owned()), "{demo}");
    }
}

#[sqlx::test(migrations = false)]
async fn sets_apply_beside_each_other_in_any_order_and_again(pool: PgPool) {
    migrate(&pool, &PIPELINE).await.expect("pipeline first");
    MIGRATOR.run(&pool).await.expect("then every set");
    migrate(&pool, &PIPELINE)
        .await
        .expect("the pipeline's again");
    MIGRATOR.run(&pool).await.expect("every set again");
    let all = tables(&pool).await;
    for table in PIPELINE_TABLES.iter().chain(&[
        "relay_lease",
        "orders",
        "notification",
        "inventory_stock",
        "export_job",
    ]) {
        assert!(all.contains(&(*table).to_owned()), "{table} missing");
    }
}
