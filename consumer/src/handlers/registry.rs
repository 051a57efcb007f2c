//! The consumer groups a program runs: each a [`Handler`] registered under its name, with the
//! tasks that run beside it and the metrics they bring.

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
