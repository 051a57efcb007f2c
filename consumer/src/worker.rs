//! One task per assigned partition: takes the partition's messages in order, processes them in
//! batches, and reports the next offset to commit only after each batch's transaction commits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rand::Rng;
use sqlx::PgPool;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::apply::{process_batch, InboundMessage, ProcessError};
use crate::handler::Handler;
use crate::metrics::ConsumerMetrics;

/// A batch committed: the group may commit `next_offset` for this partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub topic: String,
    pub partition: i32,
    pub next_offset: i64,
}

/// Stops the whole process with a reason, for errors no retry can fix.
#[derive(Clone, Default)]
pub struct FatalSignal {
    pub token: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
}

impl FatalSignal {
    pub fn raise(&self, reason: String) {
        if let Ok(mut slot) = self.reason.lock() {
            slot.get_or_insert(reason);
        }
        self.token.cancel();
    }

    pub fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

/// What every partition task of a group shares.
#[derive(Clone)]
pub struct WorkerShared {
    pub pool: PgPool,
    pub handler: Arc<dyn Handler>,
    pub metrics: ConsumerMetrics,
    pub progress: mpsc::Sender<Progress>,
    pub fatal: FatalSignal,
    pub max_batch: usize,
    pub retry_base: Duration,
    pub retry_max: Duration,
}

/// Runs until `stop` is cancelled or the channel closes. Messages left in the channel are
/// abandoned uncommitted: the partition's next owner reads them again.
pub async fn run_partition(
    shared: WorkerShared,
    topic: String,
    partition: i32,
    mut rx: UnboundedReceiver<InboundMessage>,
    queued: Arc<AtomicUsize>,
    stop: CancellationToken,
) {
    let group = shared.handler.group().to_owned();
    let mut batch: Vec<InboundMessage> = Vec::with_capacity(shared.max_batch);
    loop {
        let first = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            m = rx.recv() => match m { Some(m) => m, None => return },
        };
        batch.clear();
        batch.push(first);
        while batch.len() < shared.max_batch {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let mut attempt: u32 = 0;
        let started = Instant::now();
        loop {
            // Never start a transaction for a partition this process no longer owns.
            if stop.is_cancelled() {
                return;
            }
            match process_batch(&shared.pool, shared.handler.as_ref(), &batch).await {
                Ok(report) => {
                    let m = &shared.metrics;
                    m.processing_duration
                        .with_label_values(&[&group])
                        .observe(started.elapsed().as_secs_f64());
                    m.batch_size
                        .with_label_values(&[&group])
                        .observe(batch.len() as f64);
                    for o in &report.outcomes {
                        m.messages.with_label_values(&[&group, o.label()]).inc();
                    }
                    if report.released > 0 {
                        m.messages
                            .with_label_values(&[&group, "released"])
                            .inc_by(report.released as u64);
                    }
                    m.out_of_sequence
                        .with_label_values(&[&group])
                        .inc_by(report.out_of_sequence as u64);
                    let now = Utc::now();
                    let e2e = m.end_to_end.with_label_values(&[&group]);
                    for at in &report.applied_occurred_at {
                        let micros = (now - *at).num_microseconds().unwrap_or(0).max(0);
                        e2e.observe(micros as f64 / 1e6);
                    }
                    let last = batch.last().map(|m| m.offset).unwrap_or(0);
                    let _ = shared.progress.send(Progress {
                        topic: topic.clone(),
                        partition,
                        next_offset: last + 1,
                    });
                    break;
                }
                Err(ProcessError::Transient(e)) => {
                    attempt = attempt.saturating_add(1);
                    let delay = backoff(shared.retry_base, shared.retry_max, attempt);
                    shared
                        .metrics
                        .batch_retries
                        .with_label_values(&[&group])
                        .inc();
                    tracing::warn!(%group, %topic, partition, attempt, error = %e, delay_ms = delay.as_millis() as u64,
                        "batch failed; the partition waits and retries");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(ProcessError::Fatal(e)) => {
                    tracing::error!(%group, %topic, partition, error = %e, "fatal error; stopping");
                    shared.fatal.raise(format!("group {group}: {e}"));
                    return;
                }
            }
        }
        let _ = queued.fetch_sub(batch.len(), Ordering::AcqRel);
    }
}

fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    let nominal = base
        .saturating_mul(2u32.saturating_pow(attempt.min(20).saturating_sub(1)))
        .min(max);
    let half = nominal / 2;
    half + Duration::from_millis(rand::rng().random_range(0..=half.as_millis().max(1) as u64))
}
