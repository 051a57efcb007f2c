//! Shared transactions: batches of several partitions of one group, waiting at the same time,
//! are applied in one database transaction.
//!
//! At low rates every partition batch holds an event or two, and the cost of an event is the
//! cost of a commit. A group runs at most `--shared-transactions` transactions at once; batches
//! that arrive while those run wait and go together into the next one, up to `--max-batch`
//! messages. Nothing else changes: each partition's task still hands over one batch at a time
//! and learns its outcome only after the commit, so its offset is committed after the database
//! commit, in order; each batch keeps its own ownership fence. When a shared transaction fails,
//! every batch in it is handed back to its partition's task, which retries it in a transaction
//! of its own (where retries, isolation and dead-lettering work as for any batch).

use std::sync::Arc;
use std::time::Duration;

use pipeline_core::overlap::Overlap;

use pipeline_core::db::HeldSession;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::sync::CancellationToken;

use super::apply::{process_batches_on, PartitionBatch, TransactionContext};
use super::dead_letter::DeadLetterSink;
use super::error::ProcessError;
use super::message::{BatchReport, Fence, InboundMessage};
use crate::handlers::Handler;
use crate::metrics::ConsumerMetrics;

/// What a shared transaction's runner needs.
pub struct SharedTransactionSettings {
    /// The group's database.
    pub pool: PgPool,
    /// The group's handler; it prepares and flushes once per shared transaction.
    pub handler: Arc<dyn Handler>,
    /// When set, dead letters are also published to the dead-letter topic before commit.
    pub dead_letters: Option<Arc<DeadLetterSink>>,
    /// Where partitions per transaction and failed shared transactions are counted.
    pub metrics: ConsumerMetrics,
    /// Transactions run at once.
    pub transactions: usize,
    /// How long batches wait for the transactions running to finish before another starts beside
    /// them (see [`Overlap`]); zero starts it at once.
    pub patience: Duration,
    /// Most messages in one transaction.
    pub max_messages: usize,
    /// Transactions of at most this many messages plan with their values.
    pub custom_plans_up_to: usize,
}

/// A batch's result from a shared transaction; `None`: run it alone.
pub type SharedResult = Option<Result<BatchReport, ProcessError>>;

struct Job {
    fence: Fence,
    messages: Arc<Vec<InboundMessage>>,
    reply: oneshot::Sender<SharedResult>,
}

struct Queue {
    rx: mpsc::UnboundedReceiver<Job>,
    /// A job taken that did not fit in the previous transaction.
    held: Option<Job>,
}

/// The entry to a group's shared transactions.
pub struct SharedTransactions {
    tx: mpsc::UnboundedSender<Job>,
}

impl SharedTransactions {
    /// Starts the group's runners; they stop with `stop`.
    pub fn start(settings: SharedTransactionSettings, stop: CancellationToken) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Mutex::new(Queue { rx, held: None }));
        let overlap = Arc::new(Overlap::new(settings.patience));
        let settings = Arc::new(settings);
        for _ in 0..settings.transactions.max(1) {
            let (queue, overlap) = (queue.clone(), overlap.clone());
            let (settings, stop) = (settings.clone(), stop.clone());
            tokio::spawn(async move { run(&queue, &overlap, &settings, &stop).await });
        }
        SharedTransactions { tx }
    }

    /// Applies a partition's batch, possibly together with other partitions' batches, and
    /// returns once its transaction has committed or failed. `None`: the batch was not applied
    /// (a shared transaction failed, or the group is stopping); the caller may run it alone.
    pub async fn process(&self, fence: &Fence, messages: Arc<Vec<InboundMessage>>) -> SharedResult {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            fence: fence.clone(),
            messages,
            reply,
        };
        self.tx.send(job).ok()?;
        answer.await.ok().flatten()
    }
}

async fn run(
    queue: &Mutex<Queue>,
    overlap: &Overlap,
    settings: &SharedTransactionSettings,
    stop: &CancellationToken,
) {
    // The session this runner's transactions run on, kept between them.
    let mut session = HeldSession::default();
    loop {
        let (jobs, _running) = {
            let mut q = queue.lock().await;
            let first = match q.held.take() {
                Some(job) => job,
                None => tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    job = q.rx.recv() => match job { Some(job) => job, None => return },
                },
            };
            // Batches arriving while another transaction is written join the next one.
            overlap.wait_turn().await;
            let mut size = first.messages.len();
            let mut jobs = vec![first];
            while size < settings.max_messages {
                let Ok(job) = q.rx.try_recv() else { break };
                if size + job.messages.len() > settings.max_messages {
                    q.held = Some(job);
                    break;
                }
                size += job.messages.len();
                jobs.push(job);
            }
            (jobs, overlap.start())
        };
        apply(settings, &mut session, jobs).await;
    }
}

/// Applies `jobs` in one transaction on the runner's `session` (see [`HeldSession`]).
async fn apply(settings: &SharedTransactionSettings, session: &mut HeldSession, jobs: Vec<Job>) {
    let ctx = TransactionContext {
        pool: &settings.pool,
        handler: settings.handler.as_ref(),
        fence: None,
        dead_letters: settings.dead_letters.as_deref(),
        custom_plans_up_to: settings.custom_plans_up_to,
    };
    let batches: Vec<PartitionBatch<'_>> = jobs
        .iter()
        .map(|j| PartitionBatch {
            fence: Some(&j.fence),
            messages: &j.messages,
        })
        .collect();
    let group = settings.handler.group();
    settings
        .metrics
        .transaction_partitions
        .with_label_values(&[group])
        .observe(jobs.len() as f64);
    let result = match session.get(&settings.pool).await {
        Ok(conn) => process_batches_on(conn, &ctx, &batches).await,
        Err(e) => Err(e.into()),
    };
    if result.is_err() {
        session.failed();
    }
    drop(batches);
    match result {
        Ok(reports) => {
            for (job, report) in jobs.into_iter().zip(reports) {
                let _ = job.reply.send(Some(Ok(report)));
            }
        }
        // Alone, the batch's own error is its answer.
        Err(e) if jobs.len() == 1 => {
            if let Some(job) = jobs.into_iter().next() {
                let _ = job.reply.send(Some(Err(e)));
            }
        }
        Err(e) => {
            tracing::debug!(group, batches = jobs.len(), error = %e,
                "shared transaction failed; each batch is retried alone");
            settings
                .metrics
                .shared_transaction_failures
                .with_label_values(&[group])
                .inc();
            for job in jobs {
                let _ = job.reply.send(None);
            }
        }
    }
}
