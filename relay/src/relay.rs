//! The relay loop: claim a batch, publish it, record the outcome; wait for work when idle. Up to
//! `--pipeline-depth` batches are out at once, each aggregate in one of them. Beside the loop,
//! while the lease is held, delayed events that fell due are moved into the outbox
//! ([`crate::schedule`]).

use std::collections::HashSet;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox::OUTBOX_CHANNEL;
use rdkafka::producer::Producer;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::backoff::RetryPolicy;
use crate::claim::{claim_batch, claim_batch_excluding, OutboxEvent};
use crate::config::RunArgs;
use crate::lease::{Elector, Lease};
use crate::mark::{mark_published, record_failures, FailedAttempt, MarkError};
use crate::metrics::RelayMetrics;
use crate::publish::{publish_batch, published_ahead_of_failures, ProducerHandle, RelayProducer};
use crate::schedule::release_while_active;

/// Counts of one relay step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    pub claimed: usize,
    pub published: usize,
    pub failed: usize,
    pub held: usize,
}

/// One step of the relay under `lease`: claim up to `batch_size` events, publish them, record
/// the results.
pub async fn relay_batch(
    pool: &PgPool,
    producer: &RelayProducer,
    lease: &Lease,
    batch_size: i64,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
) -> Result<BatchOutcome, MarkError> {
    let started = Instant::now();
    let events = claim_batch(pool, batch_size).await?;
    publish_claimed(pool, producer, lease, &events, started, retry, metrics).await
}

/// Publishes claimed `events`, waits for every delivery report and records the outcome: the
/// published leave the queue, failed attempts get their backoff. Nothing is produced once the
/// lease may have expired, and nothing is recorded once another relay took it over
/// ([`MarkError::LeaseLost`]): the events stay queued for the lease's new holder.
pub async fn publish_claimed(
    pool: &PgPool,
    producer: &RelayProducer,
    lease: &Lease,
    events: &[OutboxEvent],
    started: Instant,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
) -> Result<BatchOutcome, MarkError> {
    if events.is_empty() {
        return Ok(BatchOutcome::default());
    }
    let fence = lease.fence();
    if !lease.is_live() {
        return Err(MarkError::LeaseLost(fence.epoch));
    }
    let stage = |name: &str, since: Instant| {
        metrics
            .stage_duration
            .with_label_values(&[name])
            .observe(since.elapsed().as_secs_f64());
    };
    stage("claim", started);
    let producing = Instant::now();
    let delivery = publish_batch(producer, events).await;
    let acked_at = Utc::now();
    stage("produce", producing);
    pipeline_core::crash_point::crash_point(pipeline_core::crash_point::RELAY_AFTER_DELIVERY);
    let marking = Instant::now();
    mark_published(pool, fence, &delivery.published)
        .await
        .inspect_err(|e| count_fenced(e, metrics))?;
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
    record_failures(pool, fence, &failures)
        .await
        .inspect_err(|e| count_fenced(e, metrics))?;
    stage("mark", marking);

    for f in &delivery.failed {
        metrics.publish_errors.with_label_values(&[f.reason]).inc();
        tracing::warn!(outbox_id = f.id, error = %f.error, permanent = f.permanent, "publish attempt failed");
    }
    for (published, failed) in published_ahead_of_failures(events, &delivery) {
        tracing::warn!(
            outbox_id = published,
            failed_outbox_id = failed,
            "event published ahead of an earlier event of its aggregate that the broker refused; \
             consumer groups park it until that one is published"
        );
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

/// Runs the relay until `shutdown`: stands by until it holds the lease, then publishes while it
/// keeps it. The producer is made first and kept across activations, so a standby that takes
/// over is warm.
pub async fn run(
    args: &RunArgs,
    pool: PgPool,
    metrics: RelayMetrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let retry = args.retry_policy();
    let mut producer =
        ProducerHandle::create(&args.kafka, &args.producer_settings(), metrics.clone())?;
    let mut elector = Elector::new(args.lease_settings(), args.db.connect_options()?);
    let mut result = Ok(());
    while !shutdown.is_cancelled() {
        let Some((lease, acquired)) = elector.acquire(&shutdown).await else {
            break;
        };
        tracing::info!(
            epoch = lease.fence().epoch,
            how = acquired.reason.label(),
            since_previous_renewal_s = acquired.since_previous_renewal,
            "relay is active"
        );
        metrics.record_takeover(lease.fence().epoch, &acquired);
        metrics.active.set(1);
        // The lease is renewed beside the loop, and released only once the loop has recorded
        // what its batches did (a release first would refuse those writes).
        let stop_renewing = CancellationToken::new();
        let releasing = tokio::spawn(release_while_active(
            pool.clone(),
            lease.clone(),
            args.schedule_batch_size,
            Duration::from_millis(args.schedule_interval_ms),
            metrics.clone(),
            stop_renewing.clone(),
        ));
        let (outcome, ()) = tokio::join!(
            async {
                let outcome = run_active(
                    args,
                    &pool,
                    &mut producer,
                    &retry,
                    &metrics,
                    &lease,
                    &shutdown,
                )
                .await;
                stop_renewing.cancel();
                outcome
            },
            elector.keep(&lease, &metrics, &stop_renewing),
        );
        let _ = releasing.await;
        metrics.active.set(0);
        result = outcome;
        if result.is_err() {
            break;
        }
    }
    // Whatever is still queued was already waited for by its batch; flush anyway.
    let _ = producer.producer().flush(Duration::from_secs(5));
    tracing::info!("relay stopped");
    result
}

async fn run_active(
    args: &RunArgs,
    pool: &PgPool,
    producer: &mut ProducerHandle,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
    lease: &Lease,
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
    let depth = usize::try_from(args.pipeline_depth).unwrap_or(1).max(1);
    let mut error_streak: u32 = 0;
    // Batches on their way to Kafka, and the aggregates they hold: the next claim leaves those
    // out, so an aggregate is in one batch at a time and its events keep their order.
    let mut in_flight = FuturesUnordered::new();
    let mut busy: HashSet<String> = HashSet::new();
    let lost = lease.lost();
    let result = loop {
        if shutdown.is_cancelled() {
            break Ok(());
        }
        if !lease.is_live() {
            // Batches still out are left to finish on their own: whatever they try to record is
            // refused, and their events stay queued for the lease's next holder. Waiting for
            // them could take as long as the path to PostgreSQL stays cut.
            tracing::warn!(
                epoch = lease.fence().epoch,
                abandoned_batches = in_flight.len(),
                "relay lease lost; standing by"
            );
            lease.give_up();
            return Ok(());
        }
        if producer.fatal_error().is_some() {
            // The batches out with the broken producer fail and record their backoff first.
            settle(&mut in_flight, &mut busy).await;
            producer.renew_if_fatal()?;
        }
        let mut failed: Option<MarkError> = None;
        if in_flight.len() < depth {
            let started = Instant::now();
            let exclude: Vec<&str> = busy.iter().map(String::as_str).collect();
            let claimed = tokio::select! {
                claimed = claim_batch_excluding(pool, args.batch_size, &exclude) => claimed,
                _ = lost.cancelled() => continue,
            };
            match claimed {
                Ok(events) if !events.is_empty() => {
                    let aggregates: HashSet<String> =
                        events.iter().map(|e| e.aggregate_id.clone()).collect();
                    busy.extend(aggregates.iter().cloned());
                    // Its own task: it is produced and marked while this loop claims the next.
                    let (p, k, l, r, m) = (
                        pool.clone(),
                        producer.producer().clone(),
                        lease.clone(),
                        retry.clone(),
                        metrics.clone(),
                    );
                    let batch = tokio::spawn(async move {
                        publish_claimed(&p, &k, &l, &events, started, &r, &m).await
                    });
                    in_flight.push(async move {
                        let outcome = batch.await.unwrap_or_else(|e| {
                            Err(MarkError::Database(sqlx::Error::Protocol(format!(
                                "relay batch task failed: {e}"
                            ))))
                        });
                        (aggregates, outcome)
                    });
                    // Events that committed while earlier batches were out may be due: claim
                    // again at once, and pause only when a claim finds nothing.
                    continue;
                }
                Ok(_) if in_flight.is_empty() => {
                    error_streak = 0;
                    record_success(metrics);
                    tokio::select! {
                        () = wait_for_work(listener.as_mut(), poll, shutdown) => {}
                        _ = lost.cancelled() => {}
                    }
                    continue;
                }
                Ok(_) => {}
                Err(e) => failed = Some(e.into()),
            }
        }
        if failed.is_none() {
            let next = tokio::select! {
                next = in_flight.next() => next,
                _ = lost.cancelled() => continue,
            };
            if let Some((aggregates, outcome)) = next {
                release(&mut busy, &aggregates);
                match outcome {
                    Ok(_) => {
                        error_streak = 0;
                        record_success(metrics);
                    }
                    Err(MarkError::LeaseLost(_)) => lease.give_up(),
                    Err(e) => failed = Some(e),
                }
            }
        }
        if let Some(e) = failed {
            // Let the batches already out record their outcome before pausing.
            settle(&mut in_flight, &mut busy).await;
            error_streak = error_streak.saturating_add(1);
            let pause = retry.delay(error_streak.min(10) as i32);
            tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "relay step failed; retrying");
            metrics
                .publish_errors
                .with_label_values(&["database"])
                .inc();
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = lost.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
    };
    // Stopping: the batches already out still record what Kafka did.
    settle(&mut in_flight, &mut busy).await;
    result
}

type InFlight = (HashSet<String>, Result<BatchOutcome, MarkError>);

/// Waits for every batch in flight and records each outcome.
async fn settle<F: Future<Output = InFlight>>(
    in_flight: &mut FuturesUnordered<F>,
    busy: &mut HashSet<String>,
) {
    while let Some((aggregates, outcome)) = in_flight.next().await {
        release(busy, &aggregates);
        if let Err(e) = outcome {
            tracing::error!(error = %e, "recording a batch's outcome failed; its events stay queued");
        }
    }
}

fn release(busy: &mut HashSet<String>, aggregates: &HashSet<String>) {
    for a in aggregates {
        let _ = busy.remove(a);
    }
}

/// A batch whose outcome the database refused because another relay holds the lease.
fn count_fenced(e: &MarkError, metrics: &RelayMetrics) {
    if let MarkError::LeaseLost(epoch) = e {
        metrics.fenced.inc();
        tracing::warn!(
            epoch,
            "a batch's outcome was refused: another relay holds the lease"
        );
    }
}

fn record_success(metrics: &RelayMetrics) {
    metrics
        .last_success
        .set(Utc::now().timestamp_millis() as f64 / 1000.0);
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
/// Also reads how long the relay lease `lease_key` has had no holder.
pub async fn watch_backlog(
    pool: PgPool,
    lease_key: i64,
    metrics: RelayMetrics,
    every: Duration,
    shutdown: CancellationToken,
) {
    loop {
        if let Err(e) = refresh_backlog(&pool, lease_key, &metrics).await {
            tracing::warn!(error = %e, "cannot read outbox backlog");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// One reading of [`watch_backlog`]: the relay's queue (events waiting, failed, and held behind
/// a failed event of their aggregate; the oldest's age), the lease's vacancy and the delayed
/// events that are due.
pub async fn refresh_backlog(
    pool: &PgPool,
    lease_key: i64,
    metrics: &RelayMetrics,
) -> Result<(), sqlx::Error> {
    // Scheduled events: only the due head of the due-time index is read, however many wait
    // further ahead. Held events: from each failed event (a handful), its aggregate's later
    // events through the outbox's (aggregate, sequence) index.
    let (count, age, vacant, due, overdue, failed, held): (i64, f64, f64, i64, f64, i64, i64) =
        sqlx::query_as(
            "SELECT count(*),
                    COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8,
                    (SELECT COALESCE(max(EXTRACT(EPOCH FROM clock_timestamp() - expires_at)), 0)::float8
                     FROM relay_lease
                     WHERE lease_key = $1 AND expires_at < clock_timestamp()
                       AND expires_at > '-infinity'),
                    (SELECT count(*) FROM outbox_scheduled WHERE publish_at <= clock_timestamp()),
                    (SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(publish_at)), 0)::float8
                     FROM outbox_scheduled WHERE publish_at <= clock_timestamp()),
                    count(*) FILTER (WHERE state = 'failed'),
                    (SELECT count(DISTINCT h.id)
                     FROM outbox_unpublished f
                     JOIN outbox o ON o.aggregate_id = f.aggregate_id AND o.sequence > f.sequence
                     JOIN outbox_unpublished h ON h.id = o.id AND h.state = 'pending'
                     WHERE f.state = 'failed' AND f.attempts > 0)
             FROM outbox_unpublished",
        )
        .bind(lease_key)
        .fetch_one(pool)
        .await?;
    metrics.unpublished.set(count);
    metrics.oldest_unpublished_age.set(age.max(0.0));
    metrics.lease_vacant.set(vacant.max(0.0));
    metrics.scheduled_due.set(due);
    metrics.scheduled_overdue.set(overdue.max(0.0));
    metrics.failed.set(failed);
    metrics.held.set(held);
    Ok(())
}
