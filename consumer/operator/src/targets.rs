//! Connections to the databases the commands read and change: the outbox's, and each group's
//! (the outbox's unless `--group-database` names another).

use std::collections::BTreeMap;

use anyhow::Context;
use pipeline_core::db::redact_url;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::cli::TargetArgs;
use crate::error::BadInput;

/// Open pools, one per distinct database URL.
pub struct Targets {
    /// The shared flags.
    pub args: TargetArgs,
    pools: tokio::sync::Mutex<BTreeMap<String, PgPool>>,
}

impl Targets {
    /// Nothing is connected until a command needs it.
    pub fn new(args: TargetArgs) -> Self {
        Targets {
            args,
            pools: tokio::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// The outbox's database.
    pub async fn outbox(&self) -> anyhow::Result<PgPool> {
        let url = self.args.database_url.clone();
        self.pool(&url).await
    }

    /// The database of `group` (a name without the prefix).
    pub async fn group(&self, group: &str) -> anyhow::Result<PgPool> {
        let url = self.group_url(group).to_owned();
        self.pool(&url).await
    }

    /// The URL of `group`'s database.
    pub fn group_url(&self, group: &str) -> &str {
        self.args
            .group_databases
            .iter()
            .find(|(name, _)| name == group)
            .map(|(_, url)| url.as_str())
            .unwrap_or(&self.args.database_url)
    }

    /// The name the group's rows and its Kafka group id carry.
    pub fn qualified(&self, group: &str) -> String {
        format!("{}{group}", self.args.group_prefix)
    }

    /// The one group `--group` names, for the commands that act on one.
    pub fn one_group(&self) -> Result<String, BadInput> {
        match self.args.groups.as_slice() {
            [group] => Ok(group.clone()),
            [] => Err(BadInput::Refused("name the group: --group G".to_owned())),
            many => Err(BadInput::Refused(format!(
                "name one group, not {}: --group G",
                many.join(", ")
            ))),
        }
    }

    /// The groups to show: those given, else every group owning a partition in one of the
    /// databases (read from `partition_owner`, one row per group and partition).
    pub async fn groups(&self) -> anyhow::Result<Vec<String>> {
        if !self.args.groups.is_empty() {
            return Ok(self.args.groups.clone());
        }
        let mut urls: Vec<String> = vec![self.args.database_url.clone()];
        urls.extend(self.args.group_databases.iter().map(|(_, u)| u.clone()));
        urls.sort();
        urls.dedup();
        let mut found = std::collections::BTreeSet::new();
        for url in urls {
            let pool = self.pool(&url).await?;
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT group_name FROM partition_owner WHERE starts_with(group_name, $1)",
            )
            .bind(&self.args.group_prefix)
            .fetch_all(&pool)
            .await
            .or_else(|e| match &e {
                // A database without the consumer's tables has no group.
                sqlx::Error::Database(d) if d.code().as_deref() == Some("42P01") => Ok(Vec::new()),
                _ => Err(e),
            })?;
            for name in names {
                let _ = found.insert(name[self.args.group_prefix.len()..].to_owned());
            }
        }
        Ok(found.into_iter().collect())
    }

    async fn pool(&self, url: &str) -> anyhow::Result<PgPool> {
        let mut pools = self.pools.lock().await;
        if let Some(pool) = pools.get(url) {
            return Ok(pool.clone());
        }
        let options: PgConnectOptions = url
            .parse()
            .with_context(|| format!("invalid database URL {}", redact_url(url)))?;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(options.application_name("pipeline-operator"))
            .await
            .with_context(|| format!("connecting to {}", redact_url(url)))?;
        let _ = pools.insert(url.to_owned(), pool.clone());
        Ok(pool)
    }
}
