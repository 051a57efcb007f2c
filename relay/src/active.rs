//! What the relay does while it holds the lease: claim a batch, publish it, record the outcome;
//! wait for work when idle. Up to `pipeline_depth` batches are out at once, each aggregate in one
//! of them, so its events keep their order. Each batch takes the two steps of [`Batch`].

use std::collections::HashSet;
use std::future::Future;
use std::time::Instant;

use chrono::Utc;
use futures::stream::{FuturesUnordered, StreamExt};
use pipeline_core::retention::Backlog;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::batch::{Batch, BatchOutcome};
use crate::claim::ClaimSessions;
use crate::error::RelayError;
use crate::lease::Lease;
use crate::mark::MarkError;
use crate::metrics::RelayMetrics;
use crate::publish::ProducerHandle;
use crate::settings::RelaySettings;
use crate::wakeup::{Next, Wakeup};

/// What one turn of the relay, from taking the lease to losing it, works with: the same for the
/// queue's loop and the write-ahead log's stream.
#[derive(Clone, Copy)]
pub struct Turn<'a> {
    /// The relay's settings.
    pub settings: &'a RelaySettings,
    /// The outbox's database.
    pub pool: &'a PgPool,
    /// The relay's metrics.
    pub metrics: &'a RelayMetrics,
    /// The lease this turn holds; the turn ends when it is lost.
    pub lease: &'a Lease,
    /// Raised by a claim that comes back full, or slow; retention waits while it is.
    pub backlog: &'a Backlog,
}

/// Publishes under the turn's lease until it is lost (`Ok`), `shutdown` (`Ok`), or the producer
/// cannot be replaced after a fatal error (`Err`). The batches still out when it stops record
/// their outcome first, unless the lease was lost. A claim that comes back full, or slow, raises
/// the turn's backlog.
pub async fn run_active(
    turn: Turn<'_>,
    producer: &mut ProducerHandle,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let Turn {
        settings,
        pool,
        metrics,
        lease,
        backlog,
    } = turn;
    let retry = settings.retry_policy();
    let claims = ClaimSessions::new(pool);
    let mut wakeup = Wakeup::start(
        pool,
        settings.lock_key,
        settings.listen,
        settings.poll_interval,
        settings.listen_poll_interval,
    )
    .await
    .map_err(RelayError::Listen)?;
    let depth = usize::try_from(settings.pipeline_depth).unwrap_or(1).max(1);
    let mut error_streak: u32 = 0;
    // Batches on their way to Kafka, and the aggregates they hold: the next claim leaves those
    // out, so an aggregate is in one batch at a time and its events keep their order.
    let mut in_flight = FuturesUnordered::new();
    let mut busy: HashSet<String> = HashSet::new();
    let lost = lease.lost();
    // Whether the next turn claims; and whether a claim since the last one left out the
    // aggregates of batches still out (their later events wait for those batches' outcome, so
    // the loop claims again when one ends).
    let mut claim_now = true;
    let mut left_out = false;
    // What to wait for when a turn does not claim again at once (kept while it does not claim).
    let mut next = Next::Claim;
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
        if claim_now && in_flight.len() < depth {
            let exclude: Vec<&str> = busy.iter().map(String::as_str).collect();
            left_out = !exclude.is_empty();
            let claiming = Instant::now();
            let claimed = tokio::select! {
                claimed = Batch::claim(&claims, settings.batch_size, &exclude) => claimed,
                _ = lost.cancelled() => continue,
            };
            backlog.took(claiming.elapsed());
            match claimed {
                Ok(batch) if !batch.is_empty() => {
                    let full =
                        batch.events().len() >= usize::try_from(settings.batch_size).unwrap_or(0);
                    if full {
                        backlog.behind();
                    }
                    next = match wakeup.after_claim(pool, batch.events().len(), full).await {
                        Ok(next) => next,
                        Err(e) => {
                            // Writers go on notifying: only a cost. Said again at the next change.
                            tracing::warn!(error = %e, "cannot tell writers whether to notify");
                            Next::Claim
                        }
                    };
                    let aggregates = batch.aggregates();
                    busy.extend(aggregates.iter().cloned());
                    // Its own task: it is produced and marked while this loop claims the next.
                    let (p, k, l, r, m) = (
                        pool.clone(),
                        producer.producer().clone(),
                        lease.clone(),
                        retry.clone(),
                        metrics.clone(),
                    );
                    let task = tokio::spawn(async move { batch.publish(&p, &k, &l, &r, &m).await });
                    in_flight.push(async move {
                        let outcome = task.await.unwrap_or_else(|e| {
                            Err(MarkError::Database(sqlx::Error::Protocol(format!(
                                "relay batch task failed: {e}"
                            ))))
                        });
                        (aggregates, outcome)
                    });
                    if next == Next::Claim {
                        // More may be due already: claim again at once.
                        continue;
                    }
                }
                Ok(_) => {
                    if in_flight.is_empty() {
                        error_streak = 0;
                        record_success(metrics);
                    }
                    match wakeup.after_claim(pool, 0, false).await {
                        Ok(n) => next = n,
                        Err(e) => failed = Some(e.into()),
                    }
                }
                Err(e) => failed = Some(e.into()),
            }
        } else if claim_now {
            // No room for another batch: claim as soon as one ends.
            next = Next::Claim;
        }
        if failed.is_none() {
            // Wait for a batch out to end, or for the pause, the writers' wake-up or (at the
            // limit of batches out) nothing else.
            let pause = async {
                match next {
                    Next::Claim => std::future::pending::<()>().await,
                    Next::ClaimAfter(pause) => tokio::time::sleep(pause).await,
                    Next::Wait => wakeup.wait(shutdown).await,
                }
            };
            tokio::select! {
                done = in_flight.next(), if !in_flight.is_empty() => {
                    if let Some((aggregates, outcome)) = done {
                        free(&mut busy, &aggregates);
                        match outcome {
                            Ok(_) => {
                                error_streak = 0;
                                record_success(metrics);
                            }
                            Err(MarkError::LeaseLost(_)) => lease.give_up(),
                            Err(e) => failed = Some(e),
                        }
                    }
                    // Claim again when this batch's aggregates were left out of a claim, or
                    // when the turn was waiting for room to claim.
                    claim_now = left_out || next == Next::Claim;
                }
                () = pause => claim_now = true,
                _ = shutdown.cancelled() => {}
                _ = lost.cancelled() => {}
            }
        }
        if let Some(e) = failed {
            claim_now = true;
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
        free(busy, &aggregates);
        if let Err(e) = outcome {
            tracing::error!(error = %e, "recording a batch's outcome failed; its events stay queued");
        }
    }
}

/// The aggregates of a batch whose outcome is recorded may be claimed again.
fn free(busy: &mut HashSet<String>, aggregates: &HashSet<String>) {
    for a in aggregates {
        let _ = busy.remove(a);
    }
}

fn record_success(metrics: &RelayMetrics) {
    metrics
        .last_success
        .set(Utc::now().timestamp_millis() as f64 / 1000.0);
}
