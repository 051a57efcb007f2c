//! Shared transactions: batches of several partitions, of one group or of several groups of the
//! process (they share its database), waiting at the same time, are applied in one database
//! transaction.
//!
//! At low rates every partition batch holds an event or two, and the cost of an event is the
//! cost of a commit. The process runs at most `--shared-transactions` transactions at once for
//! each of its groups; batches that arrive while those run wait and go together into the next
//! one, up to `--max-batch` messages. Every group of the process consumes the same events, so a
//! batch taken alone waits up to `--shared-transaction-gather` for another group's batch to
//! share its transaction: one commit for the groups instead of one each. Nothing else changes: each partition's task still hands over one batch at a time
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

use super::apply::{process_groups_on, PartitionBatch, TransactionContext};
use super::dead_letter::DeadLetterSink;
use super::error::ProcessError;
use super::message::{BatchReport, Fence, InboundMessage};
use crate::handlers::Handler;
use crate::metrics::ConsumerMetrics;

/// What a shared transaction's runner needs.
pub struct SharedTransactionSettings {
    /// The groups' database.
    pub pool: PgPool,
    /// The groups whose batches the runners take: a batch taken alone waits for one of another.
    pub groups: usize,
    /// When set, dead letters are also published to the dead-letter topic before commit.
    pub dead_letters: Option<Arc<DeadLetterSink>>,
    /// Where partitions per transaction and failed shared transactions are counted.
    pub metrics: ConsumerMetrics,
    /// Transactions run at once.
    pub transactions: usize,
    /// How long a batch taken while no other group's is waiting waits for one (zero: not at
    /// all).
    pub gather: Duration,
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
    handler: Arc<dyn Handler>,
    fence: Fence,
    messages: Arc<Vec<InboundMessage>>,
    reply: oneshot::Sender<SharedResult>,
}

struct Queue {
    rx: mpsc::UnboundedReceiver<Job>,
    /// A job taken that did not fit in the previous transaction.
    held: Option<Job>,
}

/// The entry to the shared transactions of a process's groups.
pub struct SharedTransactions {
    tx: mpsc::UnboundedSender<Job>,
}

impl SharedTransactions {
    /// Starts the runners; they stop with `stop`.
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

    /// Applies a partition's batch for `handler`'s group, possibly together with other
    /// partitions' batches, of this group or another, and returns once its transaction has
    /// committed or failed. `None`: the batch was not applied (a shared transaction failed, or
    /// the process is stopping); the caller may run it alone.
    pub async fn process(
        &self,
        handler: &Arc<dyn Handler>,
        fence: &Fence,
        messages: Arc<Vec<InboundMessage>>,
    ) -> SharedResult {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            handler: handler.clone(),
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
            let mut taken = Taken {
                size: first.messages.len(),
                jobs: vec![first],
            };
            while taken.size < settings.max_messages {
                let Ok(job) = q.rx.try_recv() else { break };
                if !taken.add(job, settings.max_messages, &mut q.held) {
                    break;
                }
            }
            // Another group's batch of the same events is usually on its way: it shares this
            // transaction if it comes within the gather.
            let deadline = tokio::time::Instant::now() + settings.gather;
            while taken.groups() < settings.groups && taken.size < settings.max_messages {
                let Ok(Some(job)) = tokio::time::timeout_at(deadline, q.rx.recv()).await else {
                    break;
                };
                if !taken.add(job, settings.max_messages, &mut q.held) {
                    break;
                }
            }
            (taken.jobs, overlap.start())
        };
        apply(settings, &mut session, jobs).await;
    }
}

/// The batches a runner took for its next transaction.
struct Taken {
    jobs: Vec<Job>,
    size: usize,
}

impl Taken {
    /// Takes `job` unless it would make the transaction larger than `max` messages; then it is
    /// `held` for the next one, and false returned.
    fn add(&mut self, job: Job, max: usize, held: &mut Option<Job>) -> bool {
        if self.size + job.messages.len() > max {
            *held = Some(job);
            return false;
        }
        self.size += job.messages.len();
        self.jobs.push(job);
        true
    }

    /// The groups whose batches were taken.
    fn groups(&self) -> usize {
        group_names(self.jobs.iter()).len()
    }
}

/// The groups of `jobs`, each once, in name order.
fn group_names<'a>(jobs: impl Iterator<Item = &'a Job>) -> Vec<&'a str> {
    let mut groups: Vec<&str> = jobs.map(|j| j.handler.group()).collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// Applies `jobs` in one transaction on the runner's `session` (see [`HeldSession`]).
async fn apply(settings: &SharedTransactionSettings, session: &mut HeldSession, jobs: Vec<Job>) {
    // Each group's batches together, the groups in name order: every transaction writes the
    // groups' effects in one order, so two cannot deadlock on each other's.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| jobs[a].handler.group().cmp(jobs[b].handler.group()));
    let mut groups: Vec<(TransactionContext<'_>, Vec<PartitionBatch<'_>>, Vec<usize>)> = Vec::new();
    for i in order {
        let job = &jobs[i];
        let batch = PartitionBatch {
            fence: Some(&job.fence),
            messages: &job.messages,
        };
        match groups.last_mut() {
            Some((ctx, batches, indexes)) if ctx.handler.group() == job.handler.group() => {
                batches.push(batch);
                indexes.push(i);
            }
            _ => groups.push((
                TransactionContext {
                    pool: &settings.pool,
                    handler: job.handler.as_ref(),
                    fence: None,
                    dead_letters: settings.dead_letters.as_deref(),
                    custom_plans_up_to: settings.custom_plans_up_to,
                },
                vec![batch],
                vec![i],
            )),
        }
    }
    for (ctx, batches, _) in &groups {
        settings
            .metrics
            .transaction_partitions
            .with_label_values(&[ctx.handler.group()])
            .observe(batches.len() as f64);
    }
    let parts: Vec<(&TransactionContext<'_>, &[PartitionBatch<'_>])> = groups
        .iter()
        .map(|(ctx, batches, _)| (ctx, batches.as_slice()))
        .collect();
    let result = match session.get(&settings.pool).await {
        Ok(conn) => process_groups_on(conn, &parts).await,
        Err(e) => Err(e.into()),
    };
    if result.is_err() {
        session.failed();
    }
    // Each job's report, in the order the jobs were taken.
    let reports: Result<Vec<(usize, BatchReport)>, ProcessError> = result.map(|reports| {
        groups
            .iter()
            .zip(reports)
            .flat_map(|((_, _, indexes), reports)| indexes.iter().copied().zip(reports))
            .collect()
    });
    drop(parts);
    drop(groups);
    let mut jobs: Vec<Option<Job>> = jobs.into_iter().map(Some).collect();
    match reports {
        Ok(reports) => {
            for (i, report) in reports {
                if let Some(job) = jobs[i].take() {
                    let _ = job.reply.send(Some(Ok(report)));
                }
            }
        }
        // Alone, the batch's own error is its answer.
        Err(e) if jobs.len() == 1 => {
            if let Some(job) = jobs.pop().flatten() {
                let _ = job.reply.send(Some(Err(e)));
            }
        }
        Err(e) => {
            let jobs: Vec<Job> = jobs.into_iter().flatten().collect();
            let groups = group_names(jobs.iter());
            tracing::debug!(?groups, batches = jobs.len(), error = %e,
                "shared transaction failed; each batch is retried alone");
            for group in &groups {
                settings
                    .metrics
                    .shared_transaction_failures
                    .with_label_values(&[group])
                    .inc();
            }
            drop(groups);
            for job in jobs {
                let _ = job.reply.send(None);
            }
        }
    }
}
