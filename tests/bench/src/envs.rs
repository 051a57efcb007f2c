//! The environments the benchmark creates (database, topic, group prefix, log folder, through
//! the harness's [`TestEnv`]) and their removal.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pipeline_testkit::db::{drop_database, server_url};
use pipeline_testkit::kafka::brokers;
use pipeline_testkit::TestEnv;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use sqlx::{Connection, PgConnection};

/// What the benchmark created: dropped at the end (or as soon as a phase is done with it), unless
/// `--keep`.
pub struct EnvRegistry {
    keep: bool,
    left: Mutex<Vec<Created>>,
}

/// A database, topic and log folder of one environment; a topic alone for the broker phase.
#[derive(Debug, Clone)]
struct Created {
    database: Option<String>,
    topic: String,
    log_dir: Option<PathBuf>,
}

impl EnvRegistry {
    pub fn new(keep: bool) -> EnvRegistry {
        EnvRegistry {
            keep,
            left: Mutex::new(Vec::new()),
        }
    }

    /// A fresh environment (database, topic, group prefix), remembered for clean-up.
    pub async fn create(&self, name: &str, partitions: i32) -> anyhow::Result<TestEnv> {
        let env = TestEnv::new(name, partitions).await?;
        self.remember(Created {
            database: Some(database_name(&env.database_url).to_owned()),
            topic: env.topic.clone(),
            log_dir: Some(env.log_dir.clone()),
        });
        Ok(env)
    }

    /// Remembers a topic created outside an environment.
    pub fn track_topic(&self, topic: &str) {
        self.remember(Created {
            database: None,
            topic: topic.to_owned(),
            log_dir: None,
        });
    }

    fn remember(&self, created: Created) {
        if let Ok(mut left) = self.left.lock() {
            left.push(created);
        }
    }

    /// Drops what `env` created now, unless `--keep`. Returns what could not be removed.
    pub async fn release(&self, env: TestEnv) -> Vec<String> {
        env.pool.close().await;
        self.release_topic(&env.topic).await
    }

    /// Drops what was created with `topic` (its environment's database and logs too).
    pub async fn release_topic(&self, topic: &str) -> Vec<String> {
        let found = self.left.lock().ok().and_then(|mut left| {
            let i = left.iter().position(|c| c.topic == topic)?;
            Some(left.remove(i))
        });
        match found {
            Some(created) if !self.keep => remove(&created).await,
            _ => Vec::new(),
        }
    }

    /// Leaves what `env` created in place (for a look at something odd); returns where it is.
    pub fn retain(&self, env: &TestEnv) -> String {
        if let Ok(mut left) = self.left.lock() {
            left.retain(|c| c.topic != env.topic);
        }
        format!(
            "kept for inspection: database {}, topic {}, logs {}",
            database_name(&env.database_url),
            env.topic,
            env.log_dir.display()
        )
    }

    /// Drops everything not yet released, unless `--keep`.
    pub async fn cleanup(&self) -> Vec<String> {
        let left: Vec<Created> = self
            .left
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        let mut problems = Vec::new();
        if !self.keep {
            for created in &left {
                problems.extend(remove(created).await);
            }
        }
        problems
    }
}

async fn remove(created: &Created) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(db) = &created.database {
        if let Err(e) = drop_database(&server_url(), db).await {
            problems.push(format!("dropping database {db}: {e:#}"));
        }
    }
    if let Err(e) = delete_topic(&created.topic).await {
        problems.push(format!("deleting topic {}: {e:#}", created.topic));
    }
    if let Some(dir) = &created.log_dir {
        if let Err(e) = std::fs::remove_dir_all(dir) {
            problems.push(format!("removing {}: {e}", dir.display()));
        }
    }
    problems
}

/// The database a URL names.
pub fn database_name(url: &str) -> &str {
    let path = url.split('?').next().unwrap_or(url);
    path.rsplit('/').next().unwrap_or(path)
}

async fn delete_topic(topic: &str) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.delete_topics(&[topic], &opts).await? {
        if let Err((_, code)) = result {
            anyhow::bail!("{code}");
        }
    }
    Ok(())
}

/// `SELECT version()` of the server the environments are created on.
pub async fn postgres_version() -> anyhow::Result<String> {
    let mut admin = PgConnection::connect(&server_url()).await?;
    Ok(sqlx::query_scalar("SELECT version()")
        .fetch_one(&mut admin)
        .await?)
}
