//! The consumer groups a program runs: each a [`Handler`] registered under its name, with the
//! tasks that run beside it, the metrics they bring and what they have waiting.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use futures::future::BoxFuture;
use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::handler::Handler;

type MakeHandler = Arc<dyn Fn(String) -> Arc<dyn Handler> + Send + Sync>;
type BesideTask = Arc<dyn Fn(PgPool, CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;
type RegisterMetrics = Arc<dyn Fn(&Registry) -> prometheus::Result<()> + Send + Sync>;
type ReadWaiting = Arc<dyn Fn(PgPool) -> BoxFuture<'static, anyhow::Result<Waiting>> + Send + Sync>;

/// Work the task beside a group has waiting (jobs not finished, say), as operators see it in
/// `pipeline status` and the console.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Waiting {
    /// What waits, in the plural (`export jobs`).
    pub what: String,
    /// How many wait (read at a bounded cost).
    pub count: i64,
    /// Age of the oldest, in seconds; `None` when none waits.
    pub oldest_seconds: Option<f64>,
}

/// The groups a program can run, by name.
#[derive(Clone, Default)]
pub struct Groups {
    entries: BTreeMap<String, Entry>,
}

#[derive(Clone)]
struct Entry {
    make: MakeHandler,
    beside: Option<BesideTask>,
    metrics: Option<RegisterMetrics>,
    waiting: Option<ReadWaiting>,
}

/// A group name nothing is registered under.
#[derive(Debug, thiserror::Error)]
#[error("unknown consumer group `{name}`: this program runs {known}")]
pub struct UnknownGroup {
    /// The name asked for.
    pub name: String,
    /// The registered names, comma-separated.
    pub known: String,
}

impl Groups {
    /// No groups yet; add them with [`Groups::register`].
    pub fn new() -> Groups {
        Groups::default()
    }

    /// Registers the group `name`. `make` builds its handler from the group's id (the Kafka
    /// group id and dedupe scope: `name` behind the run's `--group-prefix`). The group gets
    /// every guarantee of the runtime: a dedupe row in the effects' transaction, offsets
    /// committed after it, one task per partition, per-aggregate sequence with parking, dead
    /// letters with reasons, the retry budget, ownership fencing, shared transactions, metrics
    /// and lag.
    pub fn register<H: Handler>(
        mut self,
        name: &str,
        make: impl Fn(String) -> H + Send + Sync + 'static,
    ) -> Groups {
        let make: MakeHandler = Arc::new(move |id| Arc::new(make(id)) as Arc<dyn Handler>);
        let _ = self.entries.insert(
            name.to_owned(),
            Entry {
                make,
                beside: None,
                metrics: None,
                waiting: None,
            },
        );
        self
    }

    /// Runs `task` beside the group `name` (registered before) for as long as the group runs,
    /// with the group's database pool: e.g. a dispatcher that sends what the group recorded.
    pub fn beside<F>(
        mut self,
        name: &str,
        task: impl Fn(PgPool, CancellationToken) -> F + Send + Sync + 'static,
    ) -> Groups
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if let Some(entry) = self.entries.get_mut(name) {
            entry.beside = Some(Arc::new(move |pool, stop| Box::pin(task(pool, stop))));
        }
        self
    }

    /// Registers, with `register`, the metrics of what runs beside the group `name` (registered
    /// before) on the process's registry, served with the runtime's own: called once when the
    /// group starts, not at all when the process does not run it.
    pub fn metrics(
        mut self,
        name: &str,
        register: impl Fn(&Registry) -> prometheus::Result<()> + Send + Sync + 'static,
    ) -> Groups {
        if let Some(entry) = self.entries.get_mut(name) {
            entry.metrics = Some(Arc::new(register));
        }
        self
    }

    /// Registers how to read what the task beside the group `name` (registered before) has
    /// waiting, from the group's database: `pipeline status` and the console show it beside the
    /// group's lag. The read must be bounded in cost, whatever the size of its tables.
    pub fn waiting<F>(
        mut self,
        name: &str,
        read: impl Fn(PgPool) -> F + Send + Sync + 'static,
    ) -> Groups
    where
        F: Future<Output = anyhow::Result<Waiting>> + Send + 'static,
    {
        if let Some(entry) = self.entries.get_mut(name) {
            entry.waiting = Some(Arc::new(move |pool| Box::pin(read(pool))));
        }
        self
    }

    /// Reads what the task beside group `name` has waiting, from `pool`; `None` when the group
    /// registered no such read (or is not registered).
    pub fn read_waiting(
        &self,
        name: &str,
        pool: PgPool,
    ) -> Option<BoxFuture<'static, anyhow::Result<Waiting>>> {
        self.entries
            .get(name)
            .and_then(|e| e.waiting.as_ref())
            .map(|read| read(pool))
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// The handler of group `name`, for the group id `id`.
    pub fn handler(&self, name: &str, id: String) -> Result<Arc<dyn Handler>, UnknownGroup> {
        Ok((self.entry(name)?.make)(id))
    }

    /// The task that runs beside group `name`, if any.
    pub fn beside_task(
        &self,
        name: &str,
        pool: PgPool,
        stop: CancellationToken,
    ) -> Result<Option<BoxFuture<'static, ()>>, UnknownGroup> {
        Ok(self.entry(name)?.beside.as_ref().map(|t| t(pool, stop)))
    }

    /// Registers the metrics group `name` brought (see [`Groups::metrics`]) on `registry`.
    pub fn register_metrics(&self, name: &str, registry: &Registry) -> anyhow::Result<()> {
        if let Some(register) = &self.entry(name)?.metrics {
            register(registry)
                .with_context(|| format!("registering the metrics of group {name}"))?;
        }
        Ok(())
    }

    fn entry(&self, name: &str) -> Result<&Entry, UnknownGroup> {
        self.entries.get(name).ok_or_else(|| UnknownGroup {
            name: name.to_owned(),
            known: self.names().join(", "),
        })
    }
}
