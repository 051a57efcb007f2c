//! What the consumer's tests share: a database of their own, with the consumer library's
//! migrations, on the server `DATABASE_URL` names.

use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// A new database `<prefix>_<random>`, migrated, with the effect history's partitions for the
/// time to come (as a consumer makes them at start), then `setup` run in it (any SQL, several
/// statements allowed); returns a pool and its name.
pub(crate) async fn database(prefix: &str, setup: &str) -> (PgPool, String) {
    let (pool, name) = empty_database(prefix).await;
    consumer::MIGRATOR.run(&pool).await.expect("migrate");
    consumer::retention::ensure_partitions(
        &pool,
        &consumer::retention::RetentionSettings::default(),
    )
    .await
    .expect("partitions");
    sqlx::raw_sql(setup).execute(&pool).await.expect("setup");
    (pool, name)
}

/// A new database `<prefix>_<random>` with nothing in it; returns a pool and its name.
pub(crate) async fn empty_database(prefix: &str) -> (PgPool, String) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = format!("{prefix}_{}", Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(&url).await.expect("connect");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create database");
    let (base, query) = url.split_once('?').unwrap_or((&url, ""));
    let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&format!("{base}/{name}?{query}"))
        .await
        .expect("connect");
    (pool, name)
}

/// Drops a database [`database`] made, once its test passed.
pub(crate) async fn drop_database(pool: PgPool, name: &str) {
    pool.close().await;
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let mut admin = PgConnection::connect(&url).await.expect("connect");
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .expect("drop database");
}
