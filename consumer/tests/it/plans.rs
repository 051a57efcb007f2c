//! The consumers' per-batch lookups stay key lookups however small the tables were when
//! PostgreSQL planned them: a prepared statement keeps its generic plan as the tables grow.
//! Needs `DATABASE_URL` (`#[sqlx::test]` creates a migrated database per test).

use sqlx::PgPool;

/// The generic plan of `statement` (two parameters: arrays of groups and of orders, pairwise the
/// keys a transaction reads), made on a session that plans as the consumer's do.
async fn generic_plan(pool: &PgPool, statement: &str, args: &str) -> String {
    let mut conn = pool.acquire().await.expect("connection");
    for (setting, value) in pipeline_core::db::KEY_LOOKUP_PLANNER {
        sqlx::raw_sql(&format!("SET {setting} = {value}"))
            .execute(&mut *conn)
            .await
            .expect("SET");
    }
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .expect("SET");
    sqlx::raw_sql(&format!("PREPARE lookup(text[], text[]) AS {statement}"))
        .execute(&mut *conn)
        .await
        .expect("PREPARE");
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN EXECUTE lookup({args})"))
        .fetch_all(&mut *conn)
        .await
        .expect("EXPLAIN");
    // Pooled sessions are reused by later calls, which prepare `lookup` again.
    sqlx::raw_sql("DEALLOCATE lookup")
        .execute(&mut *conn)
        .await
        .expect("DEALLOCATE");
    plan.join("\n")
}

#[sqlx::test(migrator = "consumer::MIGRATOR")]
async fn aggregate_progress_of_a_batch_is_read_by_key(pool: PgPool) {
    // A few rows, as when the first batches plan their statements.
    sqlx::query(
        "INSERT INTO aggregate_progress (group_name, aggregate_id, last_sequence)
         SELECT g, 'order-' || i, 1 FROM generate_series(1, 7) i, unnest('{inventory,other}'::text[]) g",
    )
    .execute(&pool)
    .await
    .expect("progress rows");
    let plan = generic_plan(
        &pool,
        "SELECT group_name, aggregate_id, last_sequence FROM aggregate_progress
         WHERE group_name = ANY($1) AND aggregate_id = ANY($2)
         ORDER BY group_name, aggregate_id FOR UPDATE",
        "'{inventory,other}', '{order-1,order-2}'",
    )
    .await;
    // The transaction's aggregates bound the index scan: no reading of a group's every row.
    assert!(
        index_condition(&plan).contains("aggregate_id = ANY ($2)"),
        "{plan}"
    );
    assert!(!plan.contains("Seq Scan"), "{plan}");

    let parked = generic_plan(
        &pool,
        "SELECT group_name, aggregate_id FROM parked_event
         WHERE group_name = ANY($1) AND aggregate_id = ANY($2)",
        "'{inventory,other}', '{order-1,order-2}'",
    )
    .await;
    assert!(
        index_condition(&parked).contains("aggregate_id = ANY ($2)"),
        "{parked}"
    );
    assert!(!parked.contains("Seq Scan"), "{parked}");
}

/// The plan's index conditions, one a line.
fn index_condition(plan: &str) -> String {
    plan.lines()
        .filter(|l| l.trim_start().starts_with("Index Cond:"))
        .collect::<Vec<_>>()
        .join("\n")
}
