//! Session settings reach every pooled connection. Needs `DATABASE_URL` (any database of the
//! test server; nothing is written).

use std::time::Duration;

use pipeline_core::db::DbArgs;

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
        .connect_with_statement_timeout(Some(Duration::from_millis(1500)))
        .await
        .expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "1500ms");
    pool.close().await;
}

#[tokio::test]
async fn default_sessions_keep_the_server_defaults() {
    let pool = args().connect().await.expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "0");
    pool.close().await;
}
