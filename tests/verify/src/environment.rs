//! The run's own world: a fresh database for the pipeline, one for the broker's storage (nisshi),
//! a topic name, a consumer-group prefix and a work directory (logs, crash triggers, the broker's
//! cwd, or the Kafka nodes' configuration and data).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use pipeline_testkit::db::{create_database, drop_database, with_database};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

use super::config::{BrokerKind, Settings};

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
    /// The broker's storage database (nisshi; none for Apache Kafka, which stores on disk).
    pub broker_database: Option<String>,
    pub broker_storage: Option<String>,
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
    /// Creates the databases (the pipeline's migrated) and the work directories.
    pub async fn create(settings: &Settings) -> anyhow::Result<Environment> {
        let run_id = Uuid::new_v4().simple().to_string()[..10].to_owned();
        let database = format!("pv_verify_{run_id}");
        let broker_database =
            (settings.broker == BrokerKind::Nisshi).then(|| format!("pv_nisshi_{run_id}"));
        let database_url = create_database(&settings.server_url, &database).await?;
        if let Some(broker_database) = &broker_database {
            if let Err(e) = create_database(&settings.server_url, broker_database).await {
                drop_databases(&settings.server_url, &[&database]).await;
                return Err(e);
            }
        }
        let pool = match connect_and_migrate(&database_url).await {
            Ok(pool) => pool,
            Err(e) => {
                // Nothing else will drop them: the run has not started.
                let mut all = vec![database.as_str()];
                all.extend(broker_database.as_deref());
                drop_databases(&settings.server_url, &all).await;
                return Err(e);
            }
        };
        let broker_storage = broker_database.as_ref().map(|db| {
            let mut url = with_database(&settings.server_url, db);
            if !url.contains('?') {
                url.push_str("?sslmode=disable");
            }
            url
        });
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

    /// The run's databases, for the "whose sessions are these" check.
    pub fn databases(&self) -> Vec<String> {
        let mut all = vec![self.database.clone()];
        all.extend(self.broker_database.clone());
        all
    }

    /// Drops the run's databases, closing whatever sessions remain.
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
    pipeline_core::db::MIGRATOR
        .run(&pool)
        .await
        .context("migrating the run's database")?;
    Ok(pool)
}

/// Drops `databases` of a run that could not start; a failure is only reported.
async fn drop_databases(server_url: &str, databases: &[&str]) {
    for db in databases {
        if let Err(e) = drop_database(server_url, db).await {
            eprintln!("[verify] dropping the run's databases: {e:#}");
        }
    }
}
