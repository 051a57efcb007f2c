//! When a further shared transaction may start while another is being written.
//!
//! Shared transactions (a service's requests committed together, a consumer group's batches of
//! several partitions applied together) have several runners; each takes all the work waiting
//! when it starts a transaction. Without a rule, work that arrives while one transaction is
//! written starts a second at once, holding just itself, so at moderate rates nearly every
//! change gets a transaction of its own, each with its round trips and a WAL flush. With an
//! [`Overlap`], a runner holding new work first waits, up to its patience, for the transactions
//! already running to finish, so what arrives meanwhile shares the next one. Under load
//! transactions last longer than the patience and run side by side; on an idle service nothing
//! is running and nothing waits.

use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Counts the transactions running and lets a runner wait for them, up to a patience.
#[derive(Debug)]
pub struct Overlap {
    running: AtomicUsize,
    finished: Notify,
    patience: Duration,
}

/// A running transaction: counted until dropped.
#[derive(Debug)]
#[must_use = "the transaction counts as running only while this is held"]
pub struct Running<'a>(&'a Overlap);

impl Overlap {
    /// A zero `patience` never waits: every runner starts at once.
    pub fn new(patience: Duration) -> Self {
        Overlap {
            running: AtomicUsize::new(0),
            finished: Notify::new(),
            patience,
        }
    }

    /// Returns once no transaction is running, or when the patience has passed since the call.
    pub async fn wait_turn(&self) {
        if self.patience.is_zero() {
            return;
        }
        let deadline = Instant::now() + self.patience;
        loop {
            // Registered before the count is read, so a transaction ending in between wakes it.
            let mut finished = pin!(self.finished.notified());
            finished.as_mut().enable();
            if self.running.load(Ordering::Acquire) == 0 {
                return;
            }
            tokio::select! {
                _ = finished => {}
                _ = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Counts a transaction as running until the returned guard is dropped. Take it before
    /// another runner can look (while still holding the work queue).
    pub fn start(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::AcqRel);
        Running(self)
    }

    /// Transactions running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
        self.0.finished.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Far longer than anything here takes on a loaded machine: a runner that waited for it
    /// (or for a transaction that never ends) shows.
    const LONG: Duration = Duration::from_secs(10);

    /// `wait_turn`, and how long it took (real time: the tests share the workspace's build of
    /// tokio, which has no paused clock).
    async fn timed_turn(overlap: &Overlap) -> Duration {
        let started = std::time::Instant::now();
        tokio::time::timeout(LONG * 2, overlap.wait_turn())
            .await
            .expect("wait_turn returns within its patience");
        started.elapsed()
    }

    #[tokio::test]
    async fn idle_runner_does_not_wait() {
        let overlap = Overlap::new(LONG);
        assert!(timed_turn(&overlap).await < LONG / 10);
    }

    #[tokio::test]
    async fn waits_for_the_running_transaction_to_finish() {
        let overlap = std::sync::Arc::new(Overlap::new(LONG));
        let writing = Duration::from_millis(100);
        let started = std::time::Instant::now();
        let other = overlap.clone();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let writer = tokio::spawn(async move {
            let _running = other.start();
            let _ = started_tx.send(());
            tokio::time::sleep(writing).await;
        });
        started_rx.await.expect("the writer started");
        assert_eq!(overlap.running(), 1);
        timed_turn(&overlap).await;
        // Woken by the end of the transaction: not before it, and not at the patience.
        let waited = started.elapsed();
        assert!(waited >= writing, "{waited:?}");
        assert!(waited < LONG / 2, "{waited:?}");
        assert_eq!(overlap.running(), 0);
        writer.await.expect("writer task");
    }

    #[tokio::test]
    async fn gives_up_waiting_after_the_patience() {
        let patience = Duration::from_millis(100);
        let overlap = Overlap::new(patience);
        let _running = overlap.start();
        let waited = timed_turn(&overlap).await;
        assert!(waited >= patience, "{waited:?}");
        assert!(waited < LONG / 2, "{waited:?}");
        assert_eq!(overlap.running(), 1);
    }

    #[tokio::test]
    async fn zero_patience_never_waits() {
        let overlap = Overlap::new(Duration::ZERO);
        let _running = overlap.start();
        assert!(timed_turn(&overlap).await < LONG / 10);
    }
}
