//! The run's own world: a fresh database for the pipeline, one for the broker's storage, a topic
//! name, a consumer-group prefix and a work directory (logs, crash triggers, the broker's cwd).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use super::config::Settings;

/// The consumer groups every consumer process runs.
pub const GROUP_KINDS: [&str; 2] = ["inventory", "notification"];

/// Names and places of one run.
#[derive(Debug)]
pub struct Environment {
    pub run_id: String,
    pub server_url: String,
    /// The pipeline's database.
    pub database: String,
    pub database_url: String,
    /// The broker's storage database.
    pub broker_database: String,
    pub broker_storage: String,
    pub topic: String,
    pub group_prefix: String,
    pub work_dir: PathBuf,
    pub log_dir: PathBuf,
    pub trigger_dir: PathBuf,
    pub broker_dir: PathBuf,
    /// A small pool on the pipeline's database, for the checks and the recovery probes.
    pub pool: PgPool,
}

impl Environment {
    /// Creates both databases (the pipeline's migrated) and the work directories.
    pub async fn create(settings: &Settings) -> anyhow::Result<Environment> {
        let run_id = Uuid::new_v4().simple().to_string()[..10].to_owned();
        let database = format!("pv_verify_{run_id}");
        let broker_database = format!("pv_nisshi_{run_id}");
        let mut admin = PgConnection::connect(&settings.server_url)
            .await
            .context("connecting to PostgreSQL (is it running? set DATABASE_URL)")?;
        for db in [&database, &broker_database] {
            let _ = sqlx::query(&format!("CREATE DATABASE \"{db}\""))
                .execute(&mut admin)
                .await
                .with_context(|| format!("creating database {db}"))?;
        }
        let _ = admin.close().await;
        let database_url = with_database(&settings.server_url, &database);
        let pool = match connect_and_migrate(&database_url).await {
            Ok(pool) => pool,
            Err(e) => {
                // Nothing else will drop them: the run has not started.
                if let Err(drop_error) =
                    drop_databases(&settings.server_url, &[&database, &broker_database]).await
                {
                    eprintln!("[verify] dropping the run's databases: {drop_error:#}");
                }
                return Err(e);
            }
        };
        let mut broker_storage = with_database(&settings.server_url, &broker_database);
        if !broker_storage.contains('?') {
            broker_storage.push_str("?sslmode=disable");
        }
        let work_dir = settings.work_root.join(format!(
            "{}-{run_id}",
            chrono::Local::now().format("%Y%m%d-%H%M%S")
        ));
        let (log_dir, trigger_dir, broker_dir) = (
            work_dir.join("logs"),
            work_dir.join("triggers"),
            work_dir.join("broker"),
        );
        for dir in [&log_dir, &trigger_dir, &broker_dir] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(Environment {
            topic: format!("verify-orders-{run_id}"),
            group_prefix: format!("v{run_id}-"),
            run_id,
            server_url: settings.server_url.clone(),
            database,
            database_url,
            broker_database,
            broker_storage,
            work_dir,
            log_dir,
            trigger_dir,
            broker_dir,
            pool,
        })
    }

    /// The Kafka group id of a group kind.
    pub fn group(&self, kind: &str) -> String {
        format!("{}{kind}", self.group_prefix)
    }

    /// Both databases, for the "whose sessions are these" check.
    pub fn databases(&self) -> Vec<String> {
        vec![self.database.clone(), self.broker_database.clone()]
    }

    /// Drops both databases, closing whatever sessions remain.
    pub async fn drop_databases(&self) -> anyhow::Result<()> {
        self.pool.close().await;
        drop_databases(&self.server_url, &[&self.database, &self.broker_database]).await
    }
}

/// A small pool on the run's database, migrated. Retried for a while: other clients of a shared
/// server may hold every connection slot for a moment.
async fn connect_and_migrate(database_url: &str) -> anyhow::Result<PgPool> {
    let pool = pipeline_testkit::wait_until(
        "a connection to the run's database",
        Duration::from_secs(30),
        || async {
            Ok(Some(
                PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect(database_url)
                    .await?,
            ))
        },
    )
    .await?;
    pipeline_core::db::MIGRATOR
        .run(&pool)
        .await
        .context("migrating the run's database")?;
    Ok(pool)
}

async fn drop_databases(server_url: &str, databases: &[&str]) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(server_url).await?;
    for db in databases {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)"))
            .execute(&mut admin)
            .await
            .with_context(|| format!("dropping database {db}"))?;
    }
    let _ = admin.close().await;
    Ok(())
}

/// `url` with its database replaced by `db` (the query string kept).
pub(crate) fn with_database(url: &str, db: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_and_keeps_the_query() {
        assert_eq!(
            with_database("postgres://u@h:5432/postgres", "x"),
            "postgres://u@h:5432/x"
        );
        assert_eq!(
            with_database("postgres://u@h/postgres?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
    }
}
