//! Session settings reach every pooled connection. Needs `DATABASE_URL` (any database of the
//! test server; nothing is written).

use std::time::Duration;

use pipeline_core::db::{DbArgs, Planner};

fn args() -> DbArgs {
    DbArgs {
        database_url: std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server"),
        database_max_connections: 2,
        migrate: false,
    }
}

async fn show(pool: &sqlx::PgPool, setting: &str) -> String {
    sqlx::query_scalar(&format!("SHOW {setting}"))
        .fetch_one(pool)
        .await
        .expect("SHOW")
}

#[tokio::test]
async fn sessions_start_with_the_settings_asked_for() {
    let pool = args()
        .connect_with_statement_timeout(Some(Duration::from_millis(1500)), &[])
        .await
        .expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "1500ms");
    pool.close().await;
}

#[tokio::test]
async fn default_sessions_keep_the_server_defaults() {
    let pool = args().connect(&[]).await.expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "0");
    pool.close().await;
}

/// The plan of a key lookup (an UPDATE joined to an array of keys, as the order service and the
/// consumers write them) made by a session of `planner` on a small table, as a prepared
/// statement's cached generic plan.
async fn plan_of_key_lookup(planner: Planner) -> String {
    let pool = args()
        .connect_session(None, planner, &[])
        .await
        .expect("connect");
    let mut conn = pool.acquire().await.expect("connection");
    for statement in [
        "CREATE TEMP TABLE lookup (id int PRIMARY KEY, v int NOT NULL)",
        "INSERT INTO lookup SELECT i, 0 FROM generate_series(1, 200) i",
        "ANALYZE lookup",
        "SET plan_cache_mode = force_generic_plan",
        "PREPARE bump(int[]) AS UPDATE lookup SET v = v + 1 FROM unnest($1) AS u(id)
         WHERE lookup.id = u.id",
    ] {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .expect(statement);
    }
    let plan: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE bump('{1,2}')")
        .fetch_all(&mut *conn)
        .await
        .expect("EXPLAIN");
    drop(conn);
    pool.close().await;
    plan.join("\n")
}

#[tokio::test]
async fn key_lookup_sessions_plan_small_tables_by_index() {
    // PostgreSQL's own choice on a small table reads it whole; a prepared statement would keep
    // that plan as the table grows.
    let default = plan_of_key_lookup(Planner::Default).await;
    assert!(default.contains("Seq Scan on lookup"), "{default}");

    let keyed = plan_of_key_lookup(Planner::KeyLookups).await;
    assert!(keyed.contains("Index Scan using lookup_pkey"), "{keyed}");
    assert!(!keyed.contains("Seq Scan on lookup"), "{keyed}");
    assert!(!keyed.contains("Hash Join"), "{keyed}");
}
