//! The consumer runtime: consumer groups that apply events exactly once and in order per
//! aggregate, each a [`Handler`](handler::Handler) a program registers by name.
//!
//! ```no_run
//! use consumer::config::RunArgs;
//! use consumer::handler::{Event, Handler, HandlerBatch, HandlerError};
//! use futures::future::BoxFuture;
//! use sqlx::PgConnection;
//!
//! /// Counts events per aggregate: its effects commit in the transaction that records each
//! /// event processed, so each counts once.
//! struct Tally { group: String }
//! struct TallyBatch;
//!
//! impl Handler for Tally {
//!     fn group(&self) -> &str { &self.group }
//!     fn batch(&self) -> Box<dyn HandlerBatch + '_> { Box::new(TallyBatch) }
//! }
//!
//! impl HandlerBatch for TallyBatch {
//!     fn apply<'a>(&'a mut self, conn: &'a mut PgConnection, event: &'a Event)
//!         -> BoxFuture<'a, Result<(), HandlerError>> {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO tally (aggregate_id, events) VALUES ($1, 1)
//!                          ON CONFLICT (aggregate_id) DO UPDATE SET events = tally.events + 1")
//!                 .bind(&event.envelope.aggregate_id)
//!                 .execute(conn)
//!                 .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! # async fn start(args: RunArgs, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
//! // `args` as parsed from `--group tally --topic …`; the group's database gets the consumer
//! // library's tables from `consumer::MIGRATOR`.
//! let groups = consumer::Groups::new().register("tally", |group| Tally { group });
//! consumer::run(args, &groups, shutdown).await
//! # }
//! ```
//!
//! What every registered group gets: a batch's dedupe rows (`processed_message`) and its
//! effects commit in one transaction, and its Kafka offsets are committed only after it; one task
//! per partition; per-aggregate sequence checks, with events that arrive ahead of their
//! predecessor parked until it is applied; messages that cannot be applied dead-lettered with
//! their reason; a retry budget for batches that keep failing while the database answers; no
//! dead letter at all while the database or an outside dependency is down
//! ([`HandlerError::Unavailable`](handler::HandlerError::Unavailable)); ownership fencing, so a
//! member that lost its partitions (frozen, or cut off from its database) applies nothing;
//! rebalance-safe commits; shared transactions; metrics and lag.

#![warn(missing_docs)]

pub mod apply;
pub mod config;
pub mod dead_letter;
pub(crate) mod effects;
pub mod group;
pub mod groups;
pub mod handler;
pub mod inventory;
pub mod lag;
pub mod message;
pub mod metrics;
pub mod notification;
pub mod parking;
pub mod process_error;
pub mod reachability;
pub mod rebalance;
pub mod report;
pub mod resolve;
pub mod shared_tx;
pub mod store;
pub mod worker;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;
use pipeline_core::db::{Planner, CONSUMER_MIGRATOR, DEMO_GROUPS_MIGRATOR};
use pipeline_core::ops_http;
use pipeline_core::order_events::demo_product_id;
use prometheus::Registry;
use sqlx::migrate::Migrator;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::RunArgs;
pub use crate::groups::{demo_groups, Groups, UnknownGroup};
use crate::metrics::ConsumerMetrics;
use crate::shared_tx::{SharedTransactions, SharedTxSettings};
use crate::worker::{FatalSignal, WorkerShared};

/// The tables this program uses: the groups' bookkeeping and the demonstration groups' effects.
pub const SCHEMA: [&Migrator; 2] = [&CONSUMER_MIGRATOR, &DEMO_GROUPS_MIGRATOR];

/// The consumer library's migrations: what any group needs besides its own effect tables
/// (dedupe rows, progress, parked events, dead letters, effect history, partition ownership).
pub use pipeline_core::db::CONSUMER_MIGRATOR as MIGRATOR;

/// How often the database probe runs (see [`reachability`]).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Runs the groups `args` names, each looked up in `groups`, until `shutdown` (or a fatal
/// error, which is returned).
pub async fn run(
    args: RunArgs,
    groups: &Groups,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    args.validate()?;
    for name in &args.groups {
        let _ = groups.handler(name, name.clone())?;
    }
    let options = args
        .db
        .session_options(
            Some(Duration::from_millis(args.statement_timeout_ms)),
            Planner::KeyLookups,
        )?
        .options([(
            "idle_in_transaction_session_timeout",
            args.idle_in_transaction_timeout_ms.to_string(),
        )]);
    let pool = args.db.connect_pool(options.clone(), &SCHEMA).await?;
    let dead_letters = if args.dead_letter_topic.is_empty() {
        None
    } else {
        let sink = dead_letter::DeadLetterSink::new(&args.kafka, &args.dead_letter_topic)?;
        let topics: Vec<String> = args.topics.iter().map(|t| sink.topic_for(t)).collect();
        args.kafka
            .ensure_topics(&topics, args.dead_letter_partitions)
            .await
            .context("creating dead-letter topics")?;
        Some(Arc::new(sink))
    };
    let registry = Registry::new();
    let metrics = ConsumerMetrics::register(&registry).context("registering metrics")?;
    let lag_collector = lag::LagCollector::new().context("lag metrics")?;
    registry
        .register(Box::new(lag_collector.clone()))
        .context("registering lag metrics")?;
    let addr = ops_http::serve(
        args.metrics_listen,
        ops_http::router(
            registry,
            ops_http::all_ready(vec![
                ops_http::database_ready(pool.clone()),
                ops_http::kafka_ready(&args.kafka)?,
            ]),
        ),
        shutdown.clone(),
    )
    .await?;
    tracing::info!(%addr, "consumer metrics listening on {addr}");

    let mut background = Vec::new();
    let fatal = FatalSignal::default();
    let stop = CancellationToken::new();
    {
        let (stop, shutdown, fatal) = (stop.clone(), shutdown.clone(), fatal.token.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = fatal.cancelled() => {}
            }
            stop.cancel();
        });
    }

    let lag_thread = if args.lag_interval_ms > 0 {
        let mut expected: Vec<String> = args
            .groups
            .iter()
            .map(|g| format!("{}{}", args.group_prefix, g))
            .collect();
        expected.extend(args.lag_groups.iter().cloned());
        expected.sort();
        expected.dedup();
        let (kafka, topics, interval, stop) = (
            args.kafka.clone(),
            args.topics.clone(),
            Duration::from_millis(args.lag_interval_ms),
            stop.clone(),
        );
        Some(
            std::thread::Builder::new()
                .name("lag-collector".into())
                .spawn(move || {
                    if let Err(e) = lag::run_collector(
                        &kafka,
                        &expected,
                        &topics,
                        interval,
                        &lag_collector,
                        &stop,
                    ) {
                        tracing::error!(error = %e, "lag collector stopped");
                    }
                })
                .context("starting lag collector")?,
        )
    } else {
        None
    };

    let reachability = reachability::Reachability::default();
    background.push(tokio::spawn(reachability::probe(
        options,
        PROBE_EVERY,
        reachability.clone(),
        metrics.clone(),
        stop.clone(),
    )));
    let settings = args.group_settings();
    let mut threads = Vec::new();
    for group in &args.groups {
        let name = format!("{}{group}", args.group_prefix);
        let handler = groups.handler(group, name.clone())?;
        metrics.init_group(&name);
        let (progress_tx, progress_rx) = mpsc::channel();
        let shared_transactions = (args.group_transactions > 0 && args.max_batch > 1).then(|| {
            Arc::new(SharedTransactions::start(
                SharedTxSettings {
                    pool: pool.clone(),
                    handler: handler.clone(),
                    dead_letters: dead_letters.clone(),
                    metrics: metrics.clone(),
                    transactions: args.group_transactions,
                    patience: std::time::Duration::from_millis(args.group_transaction_patience_ms),
                    max_messages: args.max_batch,
                    custom_plans_up_to: args.custom_plans_up_to,
                },
                stop.clone(),
            ))
        });
        let shared = WorkerShared {
            pool: pool.clone(),
            handler,
            dead_letters: dead_letters.clone(),
            metrics: metrics.clone(),
            progress: progress_tx,
            fatal: fatal.clone(),
            max_batch: args.max_batch,
            custom_plans_up_to: args.custom_plans_up_to,
            retry_base: Duration::from_millis(args.retry_base_ms),
            retry_max: Duration::from_millis(args.retry_max_ms),
            retry_budget: Duration::from_millis(args.retry_budget_ms),
            shared_transactions,
        };
        if let Some(task) = groups.beside_task(group, pool.clone(), stop.clone())? {
            background.push(tokio::spawn(task));
        }
        let (kafka, settings, reachability, stop, runtime) = (
            args.kafka.clone(),
            settings.clone(),
            reachability.clone(),
            stop.clone(),
            tokio::runtime::Handle::current(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("poll-{name}"))
            .spawn(move || {
                group::run_group(
                    &kafka,
                    &settings,
                    shared,
                    progress_rx,
                    &reachability,
                    runtime,
                    stop,
                )
            })
            .context("starting poll thread")?;
        threads.push((name, thread));
    }

    let mut first_error = None;
    for (name, thread) in threads {
        let result = tokio::task::spawn_blocking(move || thread.join())
            .await
            .context("joining poll thread")?;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(group = %name, error = %e, "group failed");
                stop.cancel();
                first_error.get_or_insert(e);
            }
            Err(_) => {
                stop.cancel();
                first_error.get_or_insert(anyhow::anyhow!("poll thread of {name} panicked"));
            }
        }
    }
    for task in background {
        let _ = task.await;
    }
    if let Some(t) = lag_thread {
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
    }
    if let Some(reason) = fatal.reason() {
        anyhow::bail!("stopped on a fatal error: {reason}");
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Sets the available stock of products 1..=`products` of the demonstration catalogue.
pub async fn seed_stock(pool: &PgPool, products: u32, quantity: i32) -> anyhow::Result<()> {
    let ids: Vec<String> = (1..=products).map(demo_product_id).collect();
    sqlx::query(
        "INSERT INTO inventory_stock (product_id, available)
         SELECT p, $2 FROM unnest($1::text[]) AS p
         ON CONFLICT (product_id) DO UPDATE SET available = EXCLUDED.available",
    )
    .bind(&ids)
    .bind(quantity)
    .execute(pool)
    .await
    .context("seeding stock")?;
    Ok(())
}

/// Runs a `dead-letters` subcommand; replaying or discarding needs the group's handler from
/// `groups`, listing works for any group name.
pub async fn resolve_cli(args: config::DeadLetterArgs, groups: &Groups) -> anyhow::Result<()> {
    use config::DeadLetterAction;
    let pool = args.db.connect(&SCHEMA).await?;
    let group = format!("{}{}", args.group_prefix, args.group);
    let (id, how, note) = match &args.action {
        DeadLetterAction::List { status } => {
            for row in resolve::list(&pool, &group, status.as_deref()).await? {
                println!("{}", serde_json::to_string(&row)?);
            }
            return Ok(());
        }
        DeadLetterAction::Replay { id, note } => (*id, resolve::Resolution::Replay, note),
        DeadLetterAction::Discard { id, note } => (*id, resolve::Resolution::Discard, note),
    };
    let handler = groups.handler(&args.group, group.clone())?;
    let sink = if args.dead_letter_topic.is_empty() {
        None
    } else {
        Some(dead_letter::DeadLetterSink::new(
            &args.kafka,
            &args.dead_letter_topic,
        )?)
    };
    let resolved = resolve::resolve(&pool, handler.as_ref(), sink.as_ref(), id, how, note).await?;
    println!("{}", serde_json::to_string(&resolved)?);
    Ok(())
}
