//! The composition root: one type whose start-up is a sequence of named steps, in the order of
//! the data's path (the groups' rate limits recorded, dead-letter topics, metrics on the caller's
//! registry, the database probe and lag collector and retention beside the groups, the watch of
//! each group's pause, then each group's poll thread), and whose [`Runtime::wait`]
//! joins everything it started. It serves no HTTP endpoint: the program serves the registry
//! (e.g. with `pipeline_core::ops_http`).

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use pipeline_core::retention::{Backlog, RetentionMetrics, Runner};
use prometheus::Registry;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::ConsumerError;
use crate::handlers::Groups;
use crate::kafka::{probe, run_collector, run_member, LagCollector, MemberSignals, Reachability};
use crate::metrics::ConsumerMetrics;
use crate::partition::{FatalSignal, TaskContext};
use crate::pause::{self, PauseSignal, PauseWatch};
use crate::rate_limit::{self, GroupRateLimiter};
use crate::settings::ConsumerSettings;
use crate::transaction::{DeadLetterSink, SharedTransactionSettings, SharedTransactions};

/// How often the database probe runs (see [`Reachability`]).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often a consumer makes sure the effect history has partitions for the time to come.
const PARTITIONS_EVERY: Duration = Duration::from_secs(10);

/// A running consumer process: its groups' poll threads and what runs beside them.
pub struct Runtime {
    stop: CancellationToken,
    fatal: FatalSignal,
    threads: Vec<(String, JoinHandle<anyhow::Result<()>>)>,
    background: Vec<tokio::task::JoinHandle<()>>,
    lag_thread: Option<JoinHandle<()>>,
}

/// What the steps of start-up hand to one another.
struct Parts {
    pool: PgPool,
    options: PgConnectOptions,
    dead_letters: Option<Arc<DeadLetterSink>>,
    metrics: ConsumerMetrics,
    lag_collector: LagCollector,
    /// Raised by a partition task that finds more messages waiting than a batch takes;
    /// retention yields to it.
    backlog: Backlog,
}

impl Runtime {
    /// Starts the groups `settings.groups` names (each looked up in `groups`; every registered
    /// group when it names none) on `pool`, with their metrics registered on `registry`; stops
    /// on `shutdown` or on a fatal error of any part. `pool` should have the sessions
    /// [`crate::session_options`] describes (see [`crate::connect`]); its database needs the
    /// library's tables ([`crate::MIGRATOR`]) and the groups' own.
    pub async fn start(
        mut settings: ConsumerSettings,
        pool: PgPool,
        registry: &Registry,
        groups: &Groups,
        shutdown: CancellationToken,
    ) -> Result<Runtime, ConsumerError> {
        settings.validate()?;
        if settings.groups.is_empty() {
            settings.groups = groups.names().into_iter().map(str::to_owned).collect();
        }
        let args = &settings;
        check_groups(args, groups)?;
        args.check_rate_limits()?;
        check_sessions(&pool)
            .await
            .map_err(ConsumerError::Database)?;
        record_rate_limits(args, &pool)
            .await
            .map_err(ConsumerError::Database)?;
        let options = (*pool.connect_options()).clone();
        let dead_letters = dead_letter_sink(args).await.map_err(ConsumerError::Kafka)?;
        let metrics = ConsumerMetrics::register(registry)?;
        for group in &args.groups {
            groups
                .register_metrics(group, registry)
                .map_err(ConsumerError::GroupMetrics)?;
        }
        let retention = RetentionMetrics::register(registry, "consumer")?;
        let lag_collector = LagCollector::new()?;
        registry.register(Box::new(lag_collector.clone()))?;
        let mut runtime = Runtime {
            stop: CancellationToken::new(),
            fatal: FatalSignal::default(),
            threads: Vec::new(),
            background: Vec::new(),
            lag_thread: None,
        };
        runtime.stop_on(shutdown);
        let parts = Parts {
            pool,
            options,
            dead_letters,
            metrics,
            lag_collector,
            backlog: Backlog::new(),
        };
        runtime
            .start_lag_collector(args, &parts)
            .map_err(ConsumerError::Kafka)?;
        runtime.keep_partitions(args, &parts).await;
        runtime.start_retention(args, &parts, retention);
        let reachability = runtime.probe_database(&parts);
        let pauses = runtime
            .watch_pauses(args, &parts)
            .await
            .map_err(ConsumerError::Database)?;
        runtime
            .start_groups(args, groups, &parts, &reachability, &pauses)
            .map_err(ConsumerError::Kafka)?;
        Ok(runtime)
    }

    /// Waits until every group has stopped and everything beside them has finished; the first
    /// group's error, or the fatal error that stopped the process, is returned.
    pub async fn wait(self) -> Result<(), ConsumerError> {
        let mut first_error = None;
        for (name, thread) in self.threads {
            let result = tokio::task::spawn_blocking(move || thread.join())
                .await
                .context("joining poll thread")
                .map_err(ConsumerError::Stopped)?;
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!(group = %name, error = %e, "group failed");
                    self.stop.cancel();
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    self.stop.cancel();
                    first_error.get_or_insert(anyhow::anyhow!("poll thread of {name} panicked"));
                }
            }
        }
        tracing::info!("every group stopped; waiting for the tasks beside them");
        for task in self.background {
            let _ = task.await;
        }
        if let Some(t) = self.lag_thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        tracing::info!("every part stopped");
        if let Some(reason) = self.fatal.reason() {
            return Err(ConsumerError::Stopped(anyhow::anyhow!(
                "stopped on a fatal error: {reason}"
            )));
        }
        match first_error {
            Some(e) => Err(ConsumerError::Stopped(e)),
            None => Ok(()),
        }
    }

    /// Retention on the database beside the groups, every `--retention-interval` (one consumer
    /// of a database at a time works; the others find it busy and wait for their next turn),
    /// waiting while this process's groups catch up on a backlog.
    fn start_retention(
        &mut self,
        args: &ConsumerSettings,
        parts: &Parts,
        metrics: RetentionMetrics,
    ) {
        if !args.retention.enabled() {
            return;
        }
        let runner = Runner::new(crate::retention::rules(&args.retention), "consumer")
            .batch_size(args.retention.batch_size)
            .pause_ratio(args.retention.pause_ratio)
            .catch_up(args.retention.catch_up)
            .yield_to(parts.backlog.clone())
            .with_metrics(metrics);
        self.background.push(tokio::spawn(runner.run_every(
            parts.pool.clone(),
            args.retention.interval,
            self.stop.clone(),
        )));
    }

    /// The effect history's partitions for the time to come: made now, before any batch needs
    /// them, and every few seconds after, whether or not this process runs retention.
    async fn keep_partitions(&mut self, args: &ConsumerSettings, parts: &Parts) {
        let (pool, settings, stop) = (
            parts.pool.clone(),
            args.retention.clone(),
            self.stop.clone(),
        );
        if let Err(e) = crate::retention::ensure_partitions(&pool, &settings).await {
            tracing::warn!(error = %e, "could not create the effect history's partitions yet; trying again");
        }
        self.background.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(PARTITIONS_EVERY) => {}
                }
                if let Err(e) = crate::retention::ensure_partitions(&pool, &settings).await {
                    tracing::warn!(error = %e, "could not create the effect history's partitions; trying again");
                }
            }
        }));
    }

    /// Every part stops when the process is asked to, or when one of them raises a fatal error.
    fn stop_on(&self, shutdown: CancellationToken) {
        let (stop, fatal) = (self.stop.clone(), self.fatal.token.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = fatal.cancelled() => {}
            }
            stop.cancel();
        });
    }

    /// The lag collector's thread, reporting every group this process runs and those of
    /// `--lag-group`.
    fn start_lag_collector(
        &mut self,
        args: &ConsumerSettings,
        parts: &Parts,
    ) -> anyhow::Result<()> {
        if args.lag_interval.is_zero() {
            return Ok(());
        }
        let mut expected: Vec<String> = args
            .groups
            .iter()
            .map(|g| format!("{}{g}", args.group_prefix))
            .collect();
        expected.extend(args.lag_groups.iter().cloned());
        expected.sort();
        expected.dedup();
        let (kafka, topics, interval, collector, stop) = (
            args.kafka.clone(),
            args.topics.clone(),
            args.lag_interval,
            parts.lag_collector.clone(),
            self.stop.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("lag-collector".into())
            .spawn(move || {
                if let Err(e) =
                    run_collector(&kafka, &expected, &topics, interval, &collector, &stop)
                {
                    tracing::error!(error = %e, "lag collector stopped");
                }
            })
            .context("starting lag collector")?;
        self.lag_thread = Some(thread);
        Ok(())
    }

    /// The probe that tells the poll loops how long the database has been out of reach.
    fn probe_database(&mut self, parts: &Parts) -> Reachability {
        let reachability = Reachability::default();
        self.background.push(tokio::spawn(probe(
            parts.options.clone(),
            PROBE_EVERY,
            reachability.clone(),
            parts.metrics.clone(),
            self.stop.clone(),
        )));
        reachability
    }

    /// Each group's pause, read once now (so a group paused before the process started starts
    /// paused) and then every [`pause::CHECK_EVERY`] beside the groups; the signals by group id.
    async fn watch_pauses(
        &mut self,
        args: &ConsumerSettings,
        parts: &Parts,
    ) -> anyhow::Result<HashMap<String, PauseSignal>> {
        let mut signals = HashMap::new();
        for group in &args.groups {
            let name = format!("{}{group}", args.group_prefix);
            let (watch, signal) =
                PauseWatch::start(parts.pool.clone(), name.clone(), parts.metrics.clone())
                    .await
                    .with_context(|| {
                        format!(
                            "reading whether group {group} is paused (table group_pause of \
                             consumer::MIGRATOR)"
                        )
                    })?;
            self.background.push(tokio::spawn(
                watch.run(pause::CHECK_EVERY, self.stop.clone()),
            ));
            let _ = signals.insert(name, signal);
        }
        Ok(signals)
    }

    /// One member (a poll thread) per group, with what its partition tasks run with, and the
    /// tasks the group registered to run beside it.
    fn start_groups(
        &mut self,
        args: &ConsumerSettings,
        groups: &Groups,
        parts: &Parts,
        reachability: &Reachability,
        pauses: &HashMap<String, PauseSignal>,
    ) -> anyhow::Result<()> {
        let settings = args.member_settings();
        // One set of runners for every group: the groups' batches of the same events share
        // transactions.
        let shared_transactions = (args.shared_transactions > 0 && args.max_batch > 1).then(|| {
            Arc::new(SharedTransactions::start(
                SharedTransactionSettings {
                    pool: parts.pool.clone(),
                    groups: args.groups.len(),
                    dead_letters: parts.dead_letters.clone(),
                    metrics: parts.metrics.clone(),
                    transactions: args.shared_transactions * args.groups.len(),
                    gather: args.shared_transaction_gather,
                    patience: args.shared_transaction_patience,
                    max_messages: args.max_batch,
                    custom_plans_up_to: args.custom_plans_up_to,
                },
                self.stop.clone(),
            ))
        });
        for group in &args.groups {
            let name = format!("{}{group}", args.group_prefix);
            let handler = groups.handler(group, name.clone())?;
            parts.metrics.init_group(&name);
            let (finished_tx, finished_rx) = mpsc::channel();
            let shared_transactions = shared_transactions.clone();
            let rate_limit = args
                .rate_limit(group)
                .and_then(|limit| GroupRateLimiter::new(limit, &parts.metrics, &name))
                .map(Arc::new);
            let max_batch = match &rate_limit {
                Some(limit) => args.max_batch.min(limit.max_batch()),
                None => args.max_batch,
            };
            let context = TaskContext {
                pool: parts.pool.clone(),
                handler,
                dead_letters: parts.dead_letters.clone(),
                metrics: parts.metrics.clone(),
                finished: finished_tx,
                fatal: self.fatal.clone(),
                max_batch,
                custom_plans_up_to: args.custom_plans_up_to,
                retry_base: args.retry_base,
                retry_max: args.retry_max,
                retry_budget: args.retry_budget,
                shared_transactions,
                rate_limit,
                backlog: parts.backlog.clone(),
            };
            if let Some(task) = groups.beside_task(group, parts.pool.clone(), self.stop.clone())? {
                self.background.push(tokio::spawn(task));
            }
            let signals = MemberSignals {
                reachability: reachability.clone(),
                pause: pauses
                    .get(&name)
                    .cloned()
                    .unwrap_or_else(PauseSignal::never),
                shutdown: self.stop.clone(),
            };
            let (kafka, settings, runtime) = (
                args.kafka.clone(),
                settings.clone(),
                tokio::runtime::Handle::current(),
            );
            let thread = std::thread::Builder::new()
                .name(format!("poll-{name}"))
                .spawn(move || {
                    run_member(&kafka, &settings, context, finished_rx, signals, runtime)
                })
                .context("starting poll thread")?;
            self.threads.push((name, thread));
        }
        Ok(())
    }
}

/// Every group named must be registered, and at least one must be: an unknown one stops
/// start-up with the list of those that are.
fn check_groups(args: &ConsumerSettings, groups: &Groups) -> Result<(), ConsumerError> {
    if args.groups.is_empty() {
        return Err(ConsumerError::NoGroup);
    }
    for name in &args.groups {
        let _ = groups.handler(name, name.clone())?;
    }
    Ok(())
}

/// Records each group's rate limit in this process, or that it has none, for `pipeline status`
/// (see [`rate_limit::record`]).
async fn record_rate_limits(args: &ConsumerSettings, pool: &PgPool) -> anyhow::Result<()> {
    for group in &args.groups {
        let name = format!("{}{group}", args.group_prefix);
        rate_limit::record(pool, &name, args.rate_limit(group))
            .await
            .with_context(|| {
                format!(
                    "recording the rate limit of group {group} (table group_rate_limit of \
                     consumer::MIGRATOR)"
                )
            })?;
    }
    Ok(())
}

/// Warns when `pool`'s sessions have no `statement_timeout`: a revoke then waits for a stuck
/// statement however long it takes (see [`crate::session_options`]).
async fn check_sessions(pool: &PgPool) -> anyhow::Result<()> {
    let timeout: String = sqlx::query_scalar("SELECT current_setting('statement_timeout')")
        .fetch_one(pool)
        .await
        .context("reading the pool's statement_timeout")?;
    if timeout == "0" {
        tracing::warn!(
            "the consumer's pool has no statement_timeout: make it with consumer::connect or \
             consumer::session_options"
        );
    }
    Ok(())
}

/// The dead-letter producer and its topics (created when missing); `None` when dead letters are
/// only recorded in the database.
async fn dead_letter_sink(args: &ConsumerSettings) -> anyhow::Result<Option<Arc<DeadLetterSink>>> {
    if args.dead_letter_topic.is_empty() {
        return Ok(None);
    }
    let sink = DeadLetterSink::new(&args.kafka, &args.dead_letter_topic)?;
    let topics: Vec<String> = args.topics.iter().map(|t| sink.topic_for(t)).collect();
    args.kafka
        .ensure_topics(&topics, args.dead_letter_partitions)
        .await
        .context("creating dead-letter topics")?;
    Ok(Some(Arc::new(sink)))
}

#[cfg(test)]
mod tests {
    use futures::future::BoxFuture;
    use sqlx::PgConnection;

    use super::*;
    use crate::handlers::{Event, Handler, HandlerError, HandlerTransaction};

    struct Nothing(String);

    impl Handler for Nothing {
        fn group(&self) -> &str {
            &self.0
        }

        fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
            Box::new(NothingApplied)
        }
    }

    struct NothingApplied;

    impl HandlerTransaction for NothingApplied {
        fn apply<'a>(
            &'a mut self,
            _: &'a mut PgConnection,
            _: &'a Event,
        ) -> BoxFuture<'a, Result<(), HandlerError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// A pool that is never connected: these refusals come before any statement.
    fn pool() -> PgPool {
        PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/nothing").expect("a lazy pool")
    }

    async fn start(settings: ConsumerSettings, groups: &Groups) -> Result<Runtime, ConsumerError> {
        Runtime::start(
            settings,
            pool(),
            &Registry::new(),
            groups,
            CancellationToken::new(),
        )
        .await
    }

    #[tokio::test]
    async fn a_host_can_tell_why_the_runtime_cannot_start() {
        let settings = ConsumerSettings {
            topics: vec!["t".to_owned()],
            ..ConsumerSettings::default()
        };
        assert!(matches!(
            start(settings.clone(), &Groups::new()).await,
            Err(ConsumerError::NoGroup)
        ));
        let groups = Groups::new().register("shipping", Nothing);
        let unknown = ConsumerSettings {
            groups: vec!["billing".to_owned()],
            ..settings.clone()
        };
        match start(unknown, &groups).await {
            Err(ConsumerError::UnknownGroup(e)) => assert_eq!(e.name, "billing"),
            other => panic!("{:?}", other.err()),
        }
        let invalid = ConsumerSettings {
            topics: Vec::new(),
            ..settings
        };
        assert!(matches!(
            start(invalid, &groups).await,
            Err(ConsumerError::InvalidSettings(_))
        ));
    }
}
