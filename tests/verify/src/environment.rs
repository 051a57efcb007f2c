//! The run's own world: a fresh database for the pipeline, a topic name, a consumer-group prefix
//! and a work directory (logs, crash triggers, the Kafka nodes' configuration and data).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use pipeline_testkit::db::{create_database, drop_database};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

use super::config::Settings;

/// The run's consumer groups (each run by consumer processes of its own).
pub const GROUP_KINDS: [&str; 2] = ["inventory", "notification"];

/// Names and places of one run.
#[derive(Debug)]
pub struct Environment {
    pub run_id: String,
    pub server_url: String,
    /// The pipeline's database.
    pub database: String,
    pub database_url: String,
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
    /// Creates the pipeline's database (migrated) and the work directories.
    pub async fn create(settings: &Settings) -> anyhow::Result<Environment> {
        let run_id = Uuid::new_v4().simple().to_string()[..10].to_owned();
        let database = format!("pv_verify_{run_id}");
        let database_url = create_database(&settings.server_url, &database).await?;
        let pool = match connect_and_migrate(&database_url).await {
            Ok(pool) => pool,
            Err(e) => {
                // Nothing else will drop it: the run has not started.
                if let Err(drop_error) = drop_database(&settings.server_url, &database).await {
                    eprintln!("[verify] dropping the run's database: {drop_error:#}");
                }
                return Err(e);
            }
        };
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

    /// The run's databases, for the "whose sessions are these" check.
    pub fn databases(&self) -> Vec<String> {
        vec![self.database.clone()]
    }

    /// The replication slot of the run's relays (with `--relay-source wal`).
    pub fn slot(&self) -> String {
        format!("verify_{}", self.run_id)
    }

    /// Drops the run's databases, closing whatever sessions remain, and the replication slot
    /// of its relays.
    pub async fn drop_databases(&self) -> anyhow::Result<()> {
        self.pool.close().await;
        for db in self.databases() {
            drop_database(&self.server_url, &db).await?;
        }
        Ok(())
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
    demo_events::MIGRATOR
        .run(&pool)
        .await
        .context("migrating the run's database")?;
    Ok(pool)
}
