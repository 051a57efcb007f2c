//! One batch's way through the relay: claimed from the outbox ([`Batch::claim`]), then produced
//! to Kafka and its outcome recorded ([`Batch::publish`]). The relay loop ([`crate::active`])
//! runs these two steps for up to `pipeline_depth` batches at once; tests drive the same two
//! steps one batch at a time.

use std::collections::HashSet;
use std::time::Instant;

use chrono::Utc;
use sqlx::PgPool;

use crate::backoff::RetryPolicy;
use crate::claim::{claim_batch_excluding, ClaimSessions, OutboxEvent};
use crate::lease::Lease;
use crate::mark::{mark_published, record_failures, FailedAttempt, MarkError};
use crate::metrics::RelayMetrics;
use crate::publish::{count_delivery, publish_batch, published_ahead_of_failures, RelayProducer};

/// Counts of one batch.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events claimed.
    pub claimed: usize,
    /// Events Kafka acknowledged.
    pub published: usize,
    /// Events whose attempt failed (retried later, or given up for good).
    pub failed: usize,
    /// Events not sent because an earlier event of their aggregate failed.
    pub held: usize,
}

/// Claimed events on their way to Kafka.
#[derive(Debug)]
pub struct Batch {
    events: Vec<OutboxEvent>,
    /// When the claim was sent: the batch's stages are timed from here.
    claimed_from: Instant,
}

impl Batch {
    /// Claims up to `limit` due events, none of an aggregate in `busy` (those with a batch still
    /// on its way to Kafka): see [`claim_batch_excluding`].
    pub async fn claim(
        sessions: &ClaimSessions,
        limit: i64,
        busy: &[&str],
    ) -> Result<Batch, sqlx::Error> {
        let claimed_from = Instant::now();
        let events = claim_batch_excluding(sessions, limit, busy).await?;
        Ok(Batch {
            events,
            claimed_from,
        })
    }

    /// The claimed events, in claim order.
    pub fn events(&self) -> &[OutboxEvent] {
        &self.events
    }

    /// Whether the claim found nothing due.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The aggregates the batch holds events of.
    pub fn aggregates(&self) -> HashSet<String> {
        self.events.iter().map(|e| e.aggregate_id.clone()).collect()
    }

    /// Produces the events under `lease`, waits for every delivery report and records the
    /// outcome: the published leave the queue, failed attempts get their backoff from `retry`.
    /// Nothing is produced once the lease may have expired, and nothing is recorded once another
    /// relay took it over ([`MarkError::LeaseLost`]): the events stay queued for the lease's new
    /// holder.
    pub async fn publish(
        &self,
        pool: &PgPool,
        producer: &RelayProducer,
        lease: &Lease,
        retry: &RetryPolicy,
        metrics: &RelayMetrics,
    ) -> Result<BatchOutcome, MarkError> {
        let events = self.events.as_slice();
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
        stage("claim", self.claimed_from);
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
                "event published ahead of an earlier event of its aggregate that the broker \
                 refused; consumer groups park it until that one is published"
            );
        }
        let given_up = failures.iter().filter(|f| f.give_up).count();
        count_delivery(metrics, events, &delivery, given_up, acked_at);
        metrics.batch_size.observe(events.len() as f64);
        metrics
            .batch_duration
            .observe(self.claimed_from.elapsed().as_secs_f64());
        Ok(BatchOutcome {
            claimed: events.len(),
            published: delivery.published.len(),
            failed: delivery.failed.len(),
            held: delivery.held.len(),
        })
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
