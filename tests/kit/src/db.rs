//! Test databases: the server they are made on, their URLs, making and dropping them.

use anyhow::Context;
use sqlx::{Connection, PgConnection, PgPool};

/// The server when `DATABASE_URL` is not set: the local one `scripts/test.sh` runs.
const LOCAL_SERVER: &str = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable";

/// The server test databases are made on: `DATABASE_URL` (its own database is only used to make
/// the others), by default the local one.
pub fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| LOCAL_SERVER.to_owned())
}

/// `url` with its database replaced by `db` (the query string kept).
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let root = match base[authority_start..].find('/') {
        Some(i) => &base[..authority_start + i],
        None => base,
    };
    match query {
        Some(q) => format!("{root}/{db}?{q}"),
        None => format!("{root}/{db}"),
    }
}

/// The URL of `pool`'s database (a `#[sqlx::test]` one, say) on the [`server_url`] server, with
/// its credentials and options: for a binary under test, or a client of its own.
pub fn database_url(pool: &PgPool) -> String {
    let options = pool.connect_options();
    let db = options
        .get_database()
        .expect("a test pool names its database");
    with_database(&server_url(), db)
}

/// Events the relay has not published yet: queued (pending or failed), or, streamed from the
/// write-ahead log, past the stream's horizon without a delivery (the horizon trails the stream
/// by a second or two, so the last published ones count a moment longer).
pub const UNPUBLISHED_SQL: &str = "SELECT (SELECT count(*) FROM outbox_unpublished)
      + COALESCE((SELECT count(*) FROM outbox o, outbox_wal_source w
                  WHERE w.streaming AND o.id > w.horizon_id
                    AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
                    AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)), 0)";

/// Makes database `name` on `server` (a URL of the server); returns the new database's URL.
pub async fn create_database(server: &str, name: &str) -> anyhow::Result<String> {
    let mut admin = PgConnection::connect(server)
        .await
        .context("connecting to PostgreSQL (is it running? set DATABASE_URL)")?;
    let _ = sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut admin)
        .await
        .with_context(|| format!("creating database {name}"))?;
    let _ = admin.close().await;
    Ok(with_database(server, name))
}

/// Drops database `name` on `server`, if it exists, ending its sessions, and its replication
/// slots (a relay's with `--source wal`: a slot keeps its database from being dropped).
pub async fn drop_database(server: &str, name: &str) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(server)
        .await
        .context("connecting to PostgreSQL")?;
    for _ in 0..50 {
        let _ = sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
             WHERE database = $1 AND active_pid IS NOT NULL",
        )
        .bind(name)
        .execute(&mut admin)
        .await;
        let dropped = sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE database = $1",
        )
        .bind(name)
        .execute(&mut admin)
        .await;
        match dropped {
            // A terminated session lets go of its slot a moment later.
            Err(e) if e.to_string().contains("is active") => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await
            }
            Err(e) => return Err(e).with_context(|| format!("dropping the slots of {name}")),
            Ok(_) => break,
        }
    }
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .with_context(|| format!("dropping database {name}"))?;
    let _ = admin.close().await;
    Ok(())
}

/// A new database named `<prefix>_<random>` on the [`server_url`] server with the pipeline's
/// migrations applied; returns its name and a pool. Drop it with [`drop_database`].
pub async fn migrated_database(prefix: &str) -> anyhow::Result<(String, PgPool)> {
    let name = format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let url = create_database(&server_url(), &name).await?;
    let pool = PgPool::connect(&url).await?;
    demo_events::MIGRATOR.run(&pool).await?;
    Ok((name, pool))
}

/// How often statements whose text contains `text` ran in `pool`'s database, as
/// `pg_stat_statements` counts them (the project's scripts load it when they start PostgreSQL):
/// for a test of how many statements a program makes.
pub async fn statement_calls(pool: &PgPool, text: &str) -> i64 {
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(pool)
        .await
        .expect("pg_stat_statements must be in shared_preload_libraries");
    sqlx::query_scalar(
        "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND strpos(query, $1) > 0",
    )
    .bind(text)
    .fetch_one(pool)
    .await
    .expect("pg_stat_statements")
}
