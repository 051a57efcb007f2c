//! How the active relay waits for new events without polling.
//!
//! Writers' inserts into the outbox NOTIFY `outbox_pending` (the outbox table's insert trigger)
//! while the relay says it listens (`outbox_relay_wakeup`); the relay waits on `LISTEN` with a
//! slow safety poll beside it. NOTIFY serialises the commits of the transactions that send it,
//! so the relay listens only once it has found nothing for [`IDLE_BEFORE_LISTENING`] (polling
//! meanwhile): under a steady load the gaps between events are shorter, and no writer notifies.
//! Then it says it listens, claims once more a moment later (a writer that read the old word
//! before it changed may commit just after), and waits; when it finds work two claims in a row
//! it says it is busy, and writers stop notifying until it waits again. A wake-up missed in that
//! change-over costs at most one safety poll.

use std::time::{Duration, Instant};

use outbox::OUTBOX_CHANNEL;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The statement that records whether the relay of `lock_key` listens.
const SAY_SQL: &str = "INSERT INTO outbox_relay_wakeup (lock_key, listening, since)
                       VALUES ($1, $2, now())
                       ON CONFLICT (lock_key) DO UPDATE SET listening = $2, since = now()";

/// How long the relay polls an empty queue before it waits on `LISTEN`: longer than the gaps
/// between events under a load where notifying writers would queue behind one another's
/// commits.
pub const IDLE_BEFORE_LISTENING: Duration = Duration::from_millis(50);

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

/// The active relay's wake-up: its `LISTEN` session, what it last told writers, and how many
/// claims in a row found work.
pub struct Wakeup {
    lock_key: i64,
    listener: Option<PgListener>,
    listening: Option<bool>,
    busy_claims: u32,
    /// When the claims started coming back empty.
    idle_since: Option<Instant>,
    /// The pause before the change-over's second claim, and the poll without `LISTEN`.
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
            busy_claims: 0,
            idle_since: None,
            poll,
            safety_poll,
        };
        // A polling relay never needs a wake-up: writers need not notify.
        if !listen {
            wakeup.say(pool, false).await?;
        }
        Ok(wakeup)
    }

    /// After a claim that found `found` events (with nothing else in flight when `found` is 0):
    /// what to do next, telling writers first when that changes whether they should notify.
    pub async fn after_claim(&mut self, pool: &PgPool, found: usize) -> Result<Next, sqlx::Error> {
        if self.listener.is_none() {
            return Ok(if found > 0 {
                Next::Claim
            } else {
                Next::ClaimAfter(self.poll)
            });
        }
        if found > 0 {
            self.idle_since = None;
            self.busy_claims = self.busy_claims.saturating_add(1);
            if self.busy_claims >= 2 && self.listening != Some(false) {
                self.say(pool, false).await?;
            }
            return Ok(Next::Claim);
        }
        self.busy_claims = 0;
        if self.listening == Some(true) {
            return Ok(Next::Wait);
        }
        let idle_since = *self.idle_since.get_or_insert_with(Instant::now);
        if idle_since.elapsed() >= IDLE_BEFORE_LISTENING {
            self.say(pool, true).await?;
        }
        Ok(Next::ClaimAfter(self.poll))
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
