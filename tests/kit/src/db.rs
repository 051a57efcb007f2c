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

/// Drops database `name` on `server`, if it exists, ending its sessions.
pub async fn drop_database(server: &str, name: &str) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(server)
        .await
        .context("connecting to PostgreSQL")?;
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
