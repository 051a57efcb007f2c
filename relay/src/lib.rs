//! The outbox relay: tails the outbox table and publishes its events to Kafka with `acks=all`,
//! the idempotent producer and the aggregate id as key.

pub mod backoff;
pub mod claim;
pub mod config;
pub mod lease;
pub mod mark;
pub mod metrics;
pub mod publish;
pub mod relay;
pub mod schedule;
pub mod vacuum;

use std::time::Duration;

use anyhow::Context;
use outbox::MIGRATOR as OUTBOX_MIGRATOR;
use pipeline_core::ops_http;
use prometheus::Registry;
use tokio_util::sync::CancellationToken;

use crate::config::RunArgs;
use crate::metrics::RelayMetrics;

/// Connects, serves the ops endpoint and runs the relay until `shutdown`.
pub async fn run(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    args.validate()?;
    // A relay frozen inside a transaction (one holding its lease row FOR SHARE) must not keep a
    // standby from taking the lease over: the server ends such a transaction, as it ends the
    // lease sessions' own, after one lease operation's timeout.
    let idle = args.lease_settings().op_timeout().as_millis().to_string();
    let options = args
        .db
        .connect_options()?
        .options([("idle_in_transaction_session_timeout", idle.as_str())]);
    let pool = args.db.connect_pool(options, &[&OUTBOX_MIGRATOR]).await?;
    let registry = Registry::new();
    let metrics = RelayMetrics::register(&registry).context("registering metrics")?;
    ops_http::serve_worker(
        "relay",
        args.metrics_listen,
        registry,
        &pool,
        &args.kafka,
        shutdown.clone(),
    )
    .await?;
    let backlog = tokio::spawn(relay::watch_backlog(
        pool.clone(),
        args.lock_key,
        metrics.clone(),
        Duration::from_secs(1),
        shutdown.clone(),
    ));
    let vacuum = (args.queue_vacuum_interval_ms > 0).then(|| {
        tokio::spawn(vacuum::vacuum_queue(
            pool.clone(),
            Duration::from_millis(args.queue_vacuum_interval_ms),
            shutdown.clone(),
        ))
    });
    let result = relay::run(&args, pool, metrics, shutdown.clone()).await;
    shutdown.cancel();
    let _ = backlog.await;
    if let Some(vacuum) = vacuum {
        let _ = vacuum.await;
    }
    result
}
