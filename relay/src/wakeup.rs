//! How the active relay waits for new events without polling.
//!
//! Writers' inserts into the outbox NOTIFY `outbox_pending` (the outbox table's insert trigger)
//! while the relay says it listens (`outbox_relay_wakeup`); the relay then waits on `LISTEN`,
//! with a slow safety poll beside it, instead of claiming again. NOTIFY serialises the commits
//! of the transactions that send it (PostgreSQL holds a database-wide lock from just before such
//! a commit until after it), so the relay listens only while events come slowly: while the
//! events it claimed over the last second stay under [`BUSY_RATE`] it says it listens, and above
//! that it says it is busy and claims again at once (pausing a poll interval after a claim that
//! found nothing), and no writer notifies. Just after it said it listens it claims once more a
//! moment later (a writer that read the old word before it changed may commit just after); a
//! wake-up missed in a change-over costs at most one safety poll.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use outbox::OUTBOX_CHANNEL;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The statement that records whether the relay of `lock_key` listens.
const SAY_SQL: &str = "INSERT INTO outbox_relay_wakeup (lock_key, listening, since)
                       VALUES ($1, $2, now())
                       ON CONFLICT (lock_key) DO UPDATE SET listening = $2, since = now()";

/// Events claimed per second (over the last [`RATE_WINDOW`]) from which the relay says it is
/// busy: writers stop notifying, and it claims without waiting for them.
pub const BUSY_RATE: usize = 200;
/// Below this rate a busy relay listens again (between the two the word stays as it is).
pub const QUIET_RATE: usize = 100;
/// How far back the claimed events are counted.
pub const RATE_WINDOW: Duration = Duration::from_secs(1);

/// What the relay does after a claim, as far as waking it is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Claim again at once.
    Claim,
    /// Claim again after this pause (the change-over's second look).
    ClaimAfter(Duration),
    /// Wait for a notification, or the safety poll.
    Wait,
}

/// The active relay's wake-up: its `LISTEN` session, what it last told writers, and the
/// events it claimed over the last [`RATE_WINDOW`].
pub struct Wakeup {
    lock_key: i64,
    listener: Option<PgListener>,
    listening: Option<bool>,
    claimed: VecDeque<(Instant, usize)>,
    claimed_sum: usize,
    /// The pause after an empty claim while busy or polling, and before the change-over's
    /// second claim.
    poll: Duration,
    /// The safety poll while waiting on `LISTEN`.
    safety_poll: Duration,
}

impl Wakeup {
    /// Listens on `outbox_pending` when `listen` is set; otherwise the relay polls every `poll`.
    pub async fn start(
        pool: &PgPool,
        lock_key: i64,
        listen: bool,
        poll: Duration,
        safety_poll: Duration,
    ) -> Result<Wakeup, sqlx::Error> {
        let listener = if listen {
            let mut l = PgListener::connect_with(pool).await?;
            l.listen(OUTBOX_CHANNEL).await?;
            Some(l)
        } else {
            None
        };
        let mut wakeup = Wakeup {
            lock_key,
            listener,
            listening: None,
            claimed: VecDeque::new(),
            claimed_sum: 0,
            poll,
            safety_poll,
        };
        // A polling relay never needs a wake-up: writers need not notify.
        if !listen {
            wakeup.say(pool, false).await?;
        }
        Ok(wakeup)
    }

    /// After a claim that found `found` events (`full`: as many as a batch holds): what to do
    /// next, telling writers first when that changes whether they should notify.
    pub async fn after_claim(
        &mut self,
        pool: &PgPool,
        found: usize,
        full: bool,
    ) -> Result<Next, sqlx::Error> {
        let again = if found > 0 {
            Next::Claim
        } else {
            Next::ClaimAfter(self.poll)
        };
        if self.listener.is_none() {
            return Ok(again);
        }
        let rate = self.count(found);
        let busy = match self.listening {
            Some(false) => rate >= QUIET_RATE,
            _ => rate >= BUSY_RATE,
        };
        if busy {
            if self.listening != Some(false) {
                self.say(pool, false).await?;
            }
            return Ok(again);
        }
        if full {
            // A backlog, coming in slowly: claim the rest at once.
            return Ok(Next::Claim);
        }
        if self.listening != Some(true) {
            self.say(pool, true).await?;
            return Ok(Next::ClaimAfter(self.poll));
        }
        Ok(Next::Wait)
    }

    /// Adds a claim's events; the events claimed over the last [`RATE_WINDOW`].
    fn count(&mut self, found: usize) -> usize {
        let now = Instant::now();
        if found > 0 {
            self.claimed.push_back((now, found));
            self.claimed_sum += found;
        }
        while let Some(&(at, n)) = self.claimed.front() {
            if now.duration_since(at) < RATE_WINDOW {
                break;
            }
            self.claimed_sum -= n;
            let _ = self.claimed.pop_front();
        }
        self.claimed_sum
    }

    /// Waits for a notification, the safety poll, or `shutdown`; then drops the notifications
    /// already buffered, which the next claim covers too.
    pub async fn wait(&mut self, shutdown: &CancellationToken) {
        let Some(listener) = self.listener.as_mut() else {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(self.poll) => {}
            }
            return;
        };
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(self.safety_poll) => {}
            received = listener.recv() => {
                if let Err(e) = received {
                    tracing::warn!(error = %e, "LISTEN connection failed; polling until it is back");
                    // Writers' notifications may have been lost with it.
                    self.listening = None;
                    tokio::time::sleep(self.poll).await;
                }
            }
        }
        while listener.next_buffered().is_some() {}
    }

    /// Tells writers whether to notify (the session's own change; the word is not durable).
    async fn say(&mut self, pool: &PgPool, listening: bool) -> Result<(), sqlx::Error> {
        sqlx::query(SAY_SQL)
            .bind(self.lock_key)
            .bind(listening)
            .execute(pool)
            .await?;
        self.listening = Some(listening);
        Ok(())
    }
}
