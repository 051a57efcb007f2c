//! The relay loop: claim a batch, publish it, record the outcome; wait for work when idle.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use pipeline_core::db::OUTBOX_CHANNEL;
use rdkafka::producer::Producer;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::backoff::RetryPolicy;
use crate::claim::claim_batch;
use crate::config::RunArgs;
use crate::leader::Leadership;
use crate::mark::{mark_published, record_failures, FailedAttempt};
use crate::metrics::RelayMetrics;
use crate::publish::{create_producer, publish_batch, RelayProducer};

/// Counts of one relay step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    pub claimed: usize,
    pub published: usize,
    pub failed: usize,
    pub held: usize,
}

/// One step of the relay: claim up to `batch_size` events, publish them, record the results.
pub async fn relay_batch(
    pool: &PgPool,
    producer: &RelayProducer,
    batch_size: i64,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
) -> Result<BatchOutcome, sqlx::Error> {
    let started = Instant::now();
    let events = claim_batch(pool, batch_size).await?;
    if events.is_empty() {
        return Ok(BatchOutcome::default());
    }
    let delivery = publish_batch(producer, &events).await;
    let acked_at = Utc::now();
    pipeline_core::crash_point::crash_point(pipeline_core::crash_point::RELAY_AFTER_DELIVERY);
    mark_published(pool, &delivery.published).await?;
    let failures: Vec<FailedAttempt> = delivery
        .failed
        .iter()
        .map(|f| {
            let attempts = f.attempts_before + 1;
            FailedAttempt {
                id: f.id,
                error: f.error.clone(),
                retry_in: retry.delay(attempts),
                give_up: retry.gives_up(attempts, f.permanent),
            }
        })
        .collect();
    record_failures(pool, &failures).await?;

    for f in &delivery.failed {
        metrics.publish_errors.with_label_values(&[f.reason]).inc();
        tracing::warn!(outbox_id = f.id, error = %f.error, permanent = f.permanent, "publish attempt failed");
    }
    let given_up = failures.iter().filter(|f| f.give_up).count();
    metrics
        .published
        .with_label_values(&["published"])
        .inc_by(delivery.published.len() as u64);
    metrics
        .published
        .with_label_values(&["retry"])
        .inc_by((failures.len() - given_up) as u64);
    metrics
        .published
        .with_label_values(&["failed"])
        .inc_by(given_up as u64);
    let by_id: std::collections::HashMap<i64, chrono::DateTime<Utc>> =
        events.iter().map(|e| (e.id, e.created_at)).collect();
    for p in &delivery.published {
        if let Some(created) = by_id.get(&p.id) {
            let delay = (acked_at - *created).num_microseconds().unwrap_or(0).max(0);
            metrics.publish_delay.observe(delay as f64 / 1e6);
        }
    }
    metrics.batch_size.observe(events.len() as f64);
    metrics
        .batch_duration
        .observe(started.elapsed().as_secs_f64());
    Ok(BatchOutcome {
        claimed: events.len(),
        published: delivery.published.len(),
        failed: delivery.failed.len(),
        held: delivery.held,
    })
}

/// Runs the relay until `shutdown`: stands by until it holds the lock, then publishes.
pub async fn run(
    args: &RunArgs,
    pool: PgPool,
    metrics: RelayMetrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let retry = args.retry_policy();
    while !shutdown.is_cancelled() {
        let Some(mut leadership) = Leadership::acquire(
            &args.db.database_url,
            args.lock_key,
            Duration::from_millis(args.standby_retry_ms),
            &shutdown,
        )
        .await
        else {
            break;
        };
        tracing::info!("relay is active");
        metrics.active.set(1);
        let producer = create_producer(&args.kafka, &args.producer_settings(), metrics.clone())?;
        let result = run_active(
            args,
            &pool,
            &producer,
            &retry,
            &metrics,
            &mut leadership,
            &shutdown,
        )
        .await;
        metrics.active.set(0);
        // Whatever is still queued was already waited for by its batch; flush anyway.
        let _ = producer.flush(Duration::from_secs(5));
        result?;
    }
    tracing::info!("relay stopped");
    Ok(())
}

async fn run_active(
    args: &RunArgs,
    pool: &PgPool,
    producer: &RelayProducer,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
    leadership: &mut Leadership,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut listener = if args.listen {
        let mut l = PgListener::connect_with(pool)
            .await
            .context("LISTEN connection")?;
        l.listen(OUTBOX_CHANNEL).await.context("LISTEN")?;
        Some(l)
    } else {
        None
    };
    let poll = Duration::from_millis(args.poll_interval_ms);
    let mut last_lock_check = Instant::now();
    let mut error_streak: u32 = 0;
    while !shutdown.is_cancelled() {
        if last_lock_check.elapsed() >= Duration::from_secs(1) {
            if !leadership.still_held().await {
                tracing::warn!("lost the relay lock; standing by");
                return Ok(());
            }
            last_lock_check = Instant::now();
        }
        match relay_batch(pool, producer, args.batch_size, retry, metrics).await {
            Ok(outcome) => {
                error_streak = 0;
                metrics
                    .last_success
                    .set(Utc::now().timestamp_millis() as f64 / 1000.0);
                // Events that committed while this batch was out are due now: claim again at
                // once, and pause only when a claim found nothing.
                if outcome.claimed > 0 {
                    continue;
                }
                wait_for_work(listener.as_mut(), poll, shutdown).await;
            }
            Err(e) => {
                error_streak = error_streak.saturating_add(1);
                let pause = retry.delay(error_streak.min(10) as i32);
                tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "relay step failed; retrying");
                metrics
                    .publish_errors
                    .with_label_values(&["database"])
                    .inc();
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
    Ok(())
}

async fn wait_for_work(
    listener: Option<&mut PgListener>,
    poll: Duration,
    shutdown: &CancellationToken,
) {
    match listener {
        Some(l) => {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(poll) => {}
                n = l.recv() => {
                    if let Err(e) = n {
                        tracing::warn!(error = %e, "LISTEN connection failed; polling");
                        tokio::time::sleep(poll).await;
                    }
                }
            }
        }
        None => {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }
}

/// Refreshes the backlog gauges from the database clock every `every`, until `shutdown`.
pub async fn watch_backlog(
    pool: PgPool,
    metrics: RelayMetrics,
    every: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let row: Result<(i64, f64), _> = sqlx::query_as(
            "SELECT count(*),
                    COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8
             FROM outbox_unpublished",
        )
        .fetch_one(&pool)
        .await;
        match row {
            Ok((count, age)) => {
                metrics.unpublished.set(count);
                metrics.oldest_unpublished_age.set(age.max(0.0));
            }
            Err(e) => tracing::warn!(error = %e, "cannot read outbox backlog"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
