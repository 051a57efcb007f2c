//! One task per assigned partition: takes the partition's messages in order, processes them in
//! batches, and reports the next offset to commit only after each batch's transaction commits.
//!
//! Failures: while a dependency is down the partition waits and retries, for as long as it takes,
//! keeping its order. When the database answers but a batch keeps failing past the retry budget,
//! the batch is retried one message at a time, and a message that still fails alone past the
//! budget is dead-lettered, so one bad message never blocks its partition for longer than that.
//!
//! With a rate limit, each batch first takes a token per message it has not paid for yet (a
//! retried batch pays once), waiting for them unless the task is stopped meanwhile.
//!
//! While its group is paused (see [`crate::pause`]) the task starts no batch, a retry included:
//! the one in flight finishes and reports its offset, the messages it holds wait in order, and
//! it goes on with them once the group is resumed (or ends when stopped meanwhile).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::context::{FinishedOffset, TaskContext};
use crate::backoff::backoff;
use crate::pause::PauseSignal;
use crate::transaction::{
    claim_partition, dead_letter_alone, process_batch_with, BatchReport, Fence, InboundMessage,
    ProcessError, TransactionContext,
};

/// One partition's task.
pub struct PartitionTask {
    context: TaskContext,
    group: String,
    fence: Fence,
    rx: UnboundedReceiver<InboundMessage>,
    queued: Arc<AtomicUsize>,
    stop: CancellationToken,
    pending: VecDeque<InboundMessage>,
    /// Offsets up to this one are processed one message at a time.
    isolate_through: Option<i64>,
    failing_since: Option<(Instant, DateTime<Utc>)>,
    attempts: u32,
    /// Offsets up to this one have taken their tokens from the group's rate limit.
    paid_through: Option<i64>,
    /// Whether the group is paused: no batch starts while it is.
    group_pause: PauseSignal,
}

impl PartitionTask {
    /// The task of `topic`/`partition` with a fresh ownership token, claimed when it runs. `rx`
    /// delivers the partition's messages in offset order, `queued` counts those not done yet
    /// (for backpressure), and `stop` ends the task.
    pub fn new(
        context: TaskContext,
        topic: String,
        partition: i32,
        rx: UnboundedReceiver<InboundMessage>,
        queued: Arc<AtomicUsize>,
        stop: CancellationToken,
    ) -> Self {
        let group = context.handler.group().to_owned();
        PartitionTask {
            context,
            group,
            fence: Fence {
                topic,
                partition,
                owner: Uuid::new_v4(),
            },
            rx,
            queued,
            stop,
            pending: VecDeque::new(),
            isolate_through: None,
            failing_since: None,
            attempts: 0,
            paid_through: None,
            group_pause: PauseSignal::never(),
        }
    }

    /// The task follows `pause`: it starts no batch while its group is paused (a task made with
    /// [`PartitionTask::new`] alone is never paused).
    pub fn with_pause(mut self, pause: PauseSignal) -> Self {
        self.group_pause = pause;
        self
    }

    /// Runs until stopped, fenced or the channel closes. Messages not yet committed are left to
    /// the partition's next owner.
    pub async fn run(mut self) {
        if !self.claim().await {
            return;
        }
        loop {
            if self.pending.is_empty() {
                let first = tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => return,
                    m = self.rx.recv() => match m { Some(m) => m, None => return },
                };
                self.pending.push_back(first);
            }
            // A paused group starts no batch; a stop while it waits ends the task.
            if !self.group_pause.wait_until_running(&self.stop).await {
                return;
            }
            while self.pending.len() < self.context.max_batch {
                match self.rx.try_recv() {
                    Ok(m) => self.pending.push_back(m),
                    Err(_) => break,
                }
            }
            // Never start a transaction for a partition this process no longer owns.
            if self.stop.is_cancelled() || !self.step().await {
                return;
            }
        }
    }

    async fn claim(&mut self) -> bool {
        let mut attempt = 0;
        loop {
            match claim_partition(&self.context.pool, &self.group, &self.fence).await {
                Ok(()) => return true,
                Err(e) => {
                    attempt += 1;
                    tracing::warn!(group = %self.group, partition = self.fence.partition, error = %e,
                        "cannot record partition ownership; retrying");
                    if !self.back_off(attempt).await {
                        return false;
                    }
                }
            }
        }
    }

    /// Processes the next batch once; false when the task must end.
    async fn step(&mut self) -> bool {
        let isolating = match (self.isolate_through, self.pending.front()) {
            (Some(through), Some(front)) => front.offset <= through,
            _ => false,
        };
        if !isolating {
            self.isolate_through = None;
        }
        let limit = if isolating { 1 } else { self.context.max_batch };
        let batch: Arc<Vec<InboundMessage>> =
            Arc::new(self.pending.iter().take(limit).cloned().collect());
        if !isolating && batch.len() >= limit && self.context.rate_limit.is_none() {
            self.context.backlog.behind();
        }
        if self.context.rate_limit.is_some() && !self.pay(&batch).await {
            return false;
        }
        let ctx = TransactionContext {
            pool: &self.context.pool,
            handler: self.context.handler.as_ref(),
            fence: Some(&self.fence),
            dead_letters: self.context.dead_letters.as_deref(),
            custom_plans_up_to: self.context.custom_plans_up_to,
        };
        let started = Instant::now();
        // A batch being retried runs alone: what fails it does not fail the batches of others.
        let from_shared = match (&self.context.shared_transactions, isolating) {
            (Some(shared), false) if self.attempts == 0 => {
                shared
                    .process(&self.context.handler, &self.fence, batch.clone())
                    .await
            }
            _ => None,
        };
        let result = match from_shared {
            Some(result) => result,
            // Never start a transaction for a partition this process no longer owns.
            None if self.stop.is_cancelled() => return false,
            None => process_batch_with(&ctx, &batch).await,
        };
        // A batch that waited long for the database: retention steps aside until it is quick.
        self.context.backlog.took(started.elapsed());
        match result {
            Ok(report) => {
                pipeline_core::crash_point::crash_point(
                    pipeline_core::crash_point::CONSUMER_AFTER_DB_COMMIT,
                );
                self.record(&report, batch.len(), started);
                self.done(&batch);
                true
            }
            Err(ProcessError::Unavailable(e)) => {
                self.attempts += 1;
                self.retry_metric(batch.len());
                tracing::warn!(group = %self.group, partition = self.fence.partition, attempt = self.attempts,
                    error = %e, "dependency unavailable; the partition waits and retries");
                self.back_off(self.attempts).await
            }
            Err(ProcessError::Transient(e)) => {
                self.attempts += 1;
                self.retry_metric(batch.len());
                let (since, first_at) = *self
                    .failing_since
                    .get_or_insert((Instant::now(), Utc::now()));
                if since.elapsed() < self.context.retry_budget {
                    tracing::warn!(group = %self.group, partition = self.fence.partition, attempt = self.attempts,
                        error = %e, "batch failed; retrying");
                    return self.back_off(self.attempts).await;
                }
                if batch.len() > 1 {
                    tracing::warn!(group = %self.group, partition = self.fence.partition, messages = batch.len(),
                        error = %e, "batch kept failing past the retry budget; retrying its messages one by one");
                    self.isolate_through = batch.last().map(|m| m.offset);
                    self.failing_since = None;
                    self.attempts = 0;
                    return true;
                }
                let reason = format!(
                    "retry budget exhausted after {} attempts: {e}",
                    self.attempts
                );
                let attempts = i32::try_from(self.attempts).unwrap_or(i32::MAX);
                match dead_letter_alone(&ctx, &batch[0], &reason, attempts, first_at).await {
                    Ok(outcome) => {
                        self.context
                            .metrics
                            .messages
                            .with_label_values(&[&self.group, outcome.label()])
                            .inc();
                        self.done(&batch);
                        true
                    }
                    Err(ProcessError::Fenced) => false,
                    Err(ProcessError::Fatal(e)) => self.fatal(e),
                    Err(e) => {
                        tracing::warn!(group = %self.group, error = %e, "cannot dead-letter yet; retrying");
                        self.back_off(self.attempts).await
                    }
                }
            }
            Err(ProcessError::Fatal(e)) => self.fatal(e),
            Err(ProcessError::Fenced) => {
                tracing::info!(group = %self.group, partition = self.fence.partition,
                    "partition now owned by another consumer; this task stops");
                false
            }
        }
    }

    /// Takes the group's rate-limit tokens for the messages of `batch` not paid for yet; false
    /// when the task was stopped while it waited.
    async fn pay(&mut self, batch: &[InboundMessage]) -> bool {
        let Some(limit) = &self.context.rate_limit else {
            return true;
        };
        let paid = self.paid_through;
        let unpaid = batch
            .iter()
            .filter(|m| paid.is_none_or(|through| m.offset > through))
            .count();
        if unpaid == 0 {
            return true;
        }
        if !limit.acquire(unpaid, &self.stop).await {
            return false;
        }
        self.paid_through = batch.last().map(|m| m.offset);
        true
    }

    fn fatal(&self, e: sqlx::Error) -> bool {
        tracing::error!(group = %self.group, partition = self.fence.partition, error = %e, "fatal error; stopping");
        self.context
            .fatal
            .raise(format!("group {}: {e}", self.group));
        false
    }

    /// Sleeps with backoff; false when stopped meanwhile.
    async fn back_off(&self, attempt: u32) -> bool {
        let delay = backoff(self.context.retry_base, self.context.retry_max, attempt);
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }

    fn retry_metric(&self, messages: usize) {
        let m = &self.context.metrics;
        m.batch_retries.with_label_values(&[&self.group]).inc();
        m.messages
            .with_label_values(&[&self.group, "retried"])
            .inc_by(messages as u64);
    }

    /// Drops a committed batch from the queue and reports its offset.
    fn done(&mut self, batch: &[InboundMessage]) {
        self.pending.drain(..batch.len());
        let _ = self.queued.fetch_sub(batch.len(), Ordering::AcqRel);
        self.failing_since = None;
        self.attempts = 0;
        if let Some(last) = batch.last() {
            let _ = self.context.finished.send(FinishedOffset {
                topic: self.fence.topic.clone(),
                partition: self.fence.partition,
                next_offset: last.offset + 1,
            });
        }
    }

    fn record(&self, report: &BatchReport, size: usize, started: Instant) {
        let (m, group) = (&self.context.metrics, self.group.as_str());
        m.processing_duration
            .with_label_values(&[group])
            .observe(started.elapsed().as_secs_f64());
        m.transaction_duration
            .with_label_values(&[group])
            .observe(report.transaction_duration.as_secs_f64());
        m.batch_size
            .with_label_values(&[group])
            .observe(size as f64);
        for o in &report.outcomes {
            m.messages.with_label_values(&[group, o.label()]).inc();
        }
        if report.unparked > 0 {
            m.messages
                .with_label_values(&[group, "unparked"])
                .inc_by(report.unparked as u64);
        }
        m.out_of_sequence
            .with_label_values(&[group])
            .inc_by(report.out_of_sequence as u64);
        let now = Utc::now();
        let e2e = m.end_to_end.with_label_values(&[group]);
        for at in &report.applied_occurred_at {
            let micros = (now - *at).num_microseconds().unwrap_or(0).max(0);
            e2e.observe(micros as f64 / 1e6);
        }
    }
}
