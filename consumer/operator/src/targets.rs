//! What the commands act on: the databases (the outbox's, and each group's: the outbox's unless
//! `--group-database` names another), the groups, and the topics they consume.
//!
//! A group name is *known* when the program registers it, when its database holds rows of it
//! (processed events, dead letters, partition owners) or, for the commands that read Kafka's
//! offsets of it (`status`), when Kafka knows its group id (a live group, or committed offsets
//! on its topics). Any other name is bad input: a typo must not pass for a healthy, empty group.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::Context;
use consumer::Groups;
use pipeline_core::db::redact_url;
use pipeline_core::kafka::{offsets_reader, partition_lags};
use rdkafka::consumer::Consumer;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::args::TargetArgs;
use crate::error::BadInput;

/// How long Kafka may take to say whether it knows a group.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a group may be known from, besides the program's registry and its database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownBy {
    /// The registry and the database only.
    Database,
    /// Also Kafka: a group id it knows (for the commands that read its offsets).
    DatabaseOrKafka,
}

/// Open pools, one per distinct database URL, and the groups the program registers.
pub struct Targets {
    /// The shared flags.
    pub args: TargetArgs,
    registered: BTreeSet<String>,
    groups: Groups,
    pools: tokio::sync::Mutex<BTreeMap<String, Opened>>,
}

/// A database's pool, or why it could not be opened and when.
#[derive(Debug)]
enum Opened {
    Pool(PgPool),
    Failed(Instant, String),
}

/// How long a client waits for one of a pool's connections, and the first one's connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a database that could not be reached is not tried again: the requests that come
/// meanwhile are refused at once instead of each waiting for its own connection attempt.
const RETRY_AFTER: Duration = Duration::from_secs(2);

impl Targets {
    /// Nothing is connected until a command needs it; `groups` are the names the program
    /// registers.
    pub fn new(args: TargetArgs, groups: &Groups) -> Self {
        Targets {
            args,
            registered: groups.names().into_iter().map(str::to_owned).collect(),
            groups: groups.clone(),
            pools: tokio::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// The groups the program registers.
    pub fn registered_groups(&self) -> &Groups {
        &self.groups
    }

    /// The outbox's database.
    pub async fn outbox(&self) -> anyhow::Result<PgPool> {
        let url = self.args.database_url.clone();
        self.pool_of(&url).await
    }

    /// The database of `group` (a name without the prefix).
    pub async fn group(&self, group: &str) -> anyhow::Result<PgPool> {
        self.in_scope(group)?;
        let url = self.group_url(group).to_owned();
        self.pool_of(&url).await
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

    /// The one group `--group` names, for the commands that act on one; it must be known.
    pub async fn one_group(&self, known_by: KnownBy) -> anyhow::Result<String> {
        let group = match self.args.groups.as_slice() {
            [group] => group.clone(),
            [] => return Err(BadInput::Refused("name the group: --group G".to_owned()).into()),
            many => {
                return Err(BadInput::Refused(format!(
                    "name one group, not {}: --group G",
                    many.join(", ")
                ))
                .into())
            }
        };
        self.check_known(&group, known_by).await?;
        Ok(group)
    }

    /// The groups to show: those given, each known, else every group owning a partition in one
    /// of the databases (read from `partition_owner`, one row per group and partition).
    pub async fn groups(&self, known_by: KnownBy) -> anyhow::Result<Vec<String>> {
        if !self.args.groups.is_empty() {
            for group in &self.args.groups {
                self.check_known(group, known_by).await?;
            }
            return Ok(self.args.groups.clone());
        }
        let mut urls: Vec<String> = vec![self.args.database_url.clone()];
        urls.extend(self.args.group_databases.iter().map(|(_, u)| u.clone()));
        urls.sort();
        urls.dedup();
        let mut found = BTreeSet::new();
        for url in urls {
            let pool = self.pool_of(&url).await?;
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT group_name FROM partition_owner WHERE starts_with(group_name, $1)",
            )
            .bind(&self.args.group_prefix)
            .fetch_all(&pool)
            .await
            .or_else(no_rows_without_tables)?;
            for name in names {
                let _ = found.insert(name[self.args.group_prefix.len()..].to_owned());
            }
        }
        Ok(found.into_iter().collect())
    }

    /// Refuses a group outside those `--group` names, when it names any: they are the scope of
    /// everything read and done (the console's included).
    pub fn in_scope(&self, group: &str) -> Result<(), BadInput> {
        if self.args.groups.is_empty() || self.args.groups.iter().any(|g| g == group) {
            return Ok(());
        }
        Err(BadInput::OutOfScope(group.to_owned()))
    }

    /// Refuses a group name that is not known (see the module's documentation).
    pub async fn check_known(&self, group: &str, known_by: KnownBy) -> anyhow::Result<()> {
        self.in_scope(group)?;
        if self.registered.contains(group) || self.in_database(group).await? {
            return Ok(());
        }
        let name = self.qualified(group);
        let kafka = match known_by {
            KnownBy::Database => None,
            KnownBy::DatabaseOrKafka => Some(self.kafka_knows(&name).await),
        };
        if let Some(Ok(true)) = kafka {
            return Ok(());
        }
        let registered = if self.registered.is_empty() {
            "this program registers no group".to_owned()
        } else {
            format!(
                "this program registers {}",
                self.registered
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let mut why = format!(
            "{registered}, and {} holds no processed event, dead letter or partition owner of \
             {name}",
            redact_url(self.group_url(group))
        );
        match kafka {
            Some(Ok(_)) => why.push_str(&format!(", and Kafka knows no group {name}")),
            Some(Err(e)) => why.push_str(&format!(", and Kafka did not say: {e:#}")),
            None => {}
        }
        Err(BadInput::UnknownGroup(group.to_owned(), why).into())
    }

    /// The topics `group` consumes: those given (`--topic`), else those it has owned partitions
    /// of in its database.
    pub async fn topics(&self, group: &str) -> anyhow::Result<Vec<String>> {
        if !self.args.topics.is_empty() {
            return Ok(self.args.topics.clone());
        }
        let pool = self.group(group).await?;
        Ok(sqlx::query_scalar(
            "SELECT DISTINCT topic FROM partition_owner WHERE group_name = $1 ORDER BY topic",
        )
        .bind(self.qualified(group))
        .fetch_all(&pool)
        .await
        .or_else(no_rows_without_tables)?)
    }

    /// Whether `group`'s database holds rows of it: processed events, dead letters or
    /// partition owners (each read by index).
    async fn in_database(&self, group: &str) -> anyhow::Result<bool> {
        let pool = self.group(group).await?;
        let found: Vec<bool> = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM processed_message WHERE group_name = $1)
                 OR EXISTS (SELECT 1 FROM dead_letter WHERE group_name = $1)
                 OR EXISTS (SELECT 1 FROM partition_owner WHERE group_name = $1)",
        )
        .bind(self.qualified(group))
        .fetch_all(&pool)
        .await
        .or_else(no_rows_without_tables)?;
        Ok(found.first().copied().unwrap_or(false))
    }

    /// Whether Kafka knows the group id `name`: a group in any state but dead, or committed
    /// offsets on the topics given.
    async fn kafka_knows(&self, name: &str) -> anyhow::Result<bool> {
        let (kafka, topics, name) = (
            self.args.kafka.clone(),
            self.args.topics.clone(),
            name.to_owned(),
        );
        tokio::task::spawn_blocking(move || -> anyhow::Result<bool> {
            let reader = offsets_reader(&kafka, &name)?;
            let described = reader
                .fetch_group_list(Some(&name), KAFKA_TIMEOUT)
                .map(|list| {
                    list.groups()
                        .iter()
                        .any(|g| g.name() == name && !["", "Dead"].contains(&g.state()))
                });
            if let Ok(true) = described {
                return Ok(true);
            }
            if topics.is_empty() {
                return described.context("describing the group");
            }
            let offsets = partition_lags(&reader, &topics, KAFKA_TIMEOUT)?;
            Ok(offsets.iter().any(|p| p.committed.is_some()))
        })
        .await
        .context("asking Kafka about the group")?
    }

    /// The database at `url` (one pool per URL, opened on first use; a database that could not
    /// be reached is tried again two seconds later, and the requests meanwhile are refused
    /// with the same error at once).
    pub async fn pool_of(&self, url: &str) -> anyhow::Result<PgPool> {
        let mut pools = self.pools.lock().await;
        match pools.get(url) {
            Some(Opened::Pool(pool)) => return Ok(pool.clone()),
            Some(Opened::Failed(at, error)) if at.elapsed() < RETRY_AFTER => {
                anyhow::bail!("{error}")
            }
            _ => {}
        }
        let options: PgConnectOptions = url
            .parse()
            .with_context(|| format!("invalid database URL {}", redact_url(url)))?;
        let opened = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options.application_name("pipeline-operator"))
            .await
            .with_context(|| format!("connecting to {}", redact_url(url)));
        match opened {
            Ok(pool) => {
                let _ = pools.insert(url.to_owned(), Opened::Pool(pool.clone()));
                Ok(pool)
            }
            Err(e) => {
                let error = format!("{e:#}");
                let _ = pools.insert(url.to_owned(), Opened::Failed(Instant::now(), error));
                Err(e)
            }
        }
    }
}

/// A database without the consumer library's tables has no group rows.
fn no_rows_without_tables<T>(e: sqlx::Error) -> Result<Vec<T>, sqlx::Error> {
    match &e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("42P01") => Ok(Vec::new()),
        _ => Err(e),
    }
}
