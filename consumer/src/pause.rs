//! Pausing a group: an operator pauses a group (`pipeline group pause`), which writes the group's
//! row of `group_pause` in its database, and resumes it (`pipeline group resume`), which removes
//! it. Every process running the group reads that row every [`CHECK_EVERY`], so all members of the
//! group, on every machine, follow within about a second.
//!
//! While the group is paused each member keeps its partitions and its place in the group: its
//! poll thread keeps polling and heartbeating, commits what its tasks finished, and pauses the
//! fetch of every assigned partition (librdkafka fetches nothing more; see `kafka::tasks`); its
//! partition tasks finish the batch in flight and start no new one (see `partition::task`). A
//! partition assigned during the pause starts paused. On resume the fetch continues from the
//! first message not yet handed to a task, and the tasks go on with what they hold, in offset
//! order: nothing is skipped, and nothing is applied twice (the dedupe rows and the ownership
//! fence are untouched). The lag collector keeps measuring, so the group's lag grows while it is
//! paused.
//!
//! The row is read on its own short query; while the database does not answer, a process keeps
//! the state it last read. `consumer_group_paused{group}` is 1 while this process holds the group
//! paused.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::ConsumerMetrics;

/// How often each process reads whether its groups are paused.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// A paused group's pause: since when, by whom and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct PausedSince {
    /// When it was paused (the database's clock).
    pub since: DateTime<Utc>,
    /// Who paused it.
    pub actor: String,
    /// Why (the operator's note).
    pub note: String,
}

/// The pause of the group whose id (prefix included) is `group_id`, or `None` while it runs.
pub async fn read(pool: &PgPool, group_id: &str) -> sqlx::Result<Option<PausedSince>> {
    sqlx::query_as("SELECT paused_at AS since, actor, note FROM group_pause WHERE group_name = $1")
        .bind(group_id)
        .fetch_optional(pool)
        .await
}

/// Whether a group is paused, as this process last read it: what its partition tasks and poll
/// thread follow.
#[derive(Debug, Clone)]
pub struct PauseSignal {
    paused: watch::Receiver<bool>,
}

impl PauseSignal {
    /// A signal that never pauses: for partition tasks run outside the runtime.
    pub fn never() -> Self {
        let (_, paused) = watch::channel(false);
        PauseSignal { paused }
    }

    /// True while the group is paused.
    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Returns at once while the group runs; otherwise waits until it is resumed (true) or
    /// `stop` is cancelled (false).
    pub async fn wait_until_running(&mut self, stop: &CancellationToken) -> bool {
        loop {
            if !*self.paused.borrow_and_update() {
                return true;
            }
            tokio::select! {
                _ = stop.cancelled() => return false,
                changed = self.paused.changed() => {
                    if changed.is_err() {
                        // The watch ended (the process is stopping): paused until stopped.
                        stop.cancelled().await;
                        return false;
                    }
                }
            }
        }
    }
}

/// Reads one group's pause for this process and tells its members.
pub struct PauseWatch {
    pool: PgPool,
    group_id: String,
    metrics: ConsumerMetrics,
    paused: watch::Sender<bool>,
}

impl PauseWatch {
    /// Reads the pause of the group whose id is `group_id` once (an error stops start-up: the
    /// table is missing or the database does not answer) and returns the watch with the signal
    /// its members follow.
    pub async fn start(
        pool: PgPool,
        group_id: String,
        metrics: ConsumerMetrics,
    ) -> sqlx::Result<(PauseWatch, PauseSignal)> {
        let initial = read(&pool, &group_id).await?;
        if let Some(p) = &initial {
            tracing::warn!(group = %group_id, since = %p.since, actor = %p.actor, note = %p.note,
                "group is paused: its members take no batch until it is resumed");
        }
        let (paused, rx) = watch::channel(initial.is_some());
        metrics
            .group_paused
            .with_label_values(&[&group_id])
            .set(i64::from(initial.is_some()));
        let watch = PauseWatch {
            pool,
            group_id,
            metrics,
            paused,
        };
        Ok((watch, PauseSignal { paused: rx }))
    }

    /// Reads the pause once and passes on a change; while the database does not answer, the
    /// state last read stays.
    pub async fn check(&self) -> sqlx::Result<bool> {
        let pause = read(&self.pool, &self.group_id).await?;
        let paused = pause.is_some();
        if *self.paused.borrow() != paused {
            match &pause {
                Some(p) => tracing::warn!(group = %self.group_id, actor = %p.actor, note = %p.note,
                    "group paused: no new batch, partitions' fetch paused, partitions kept"),
                None => tracing::info!(group = %self.group_id, "group resumed"),
            }
            let _ = self.paused.send_replace(paused);
            self.metrics
                .group_paused
                .with_label_values(&[&self.group_id])
                .set(i64::from(paused));
        }
        Ok(paused)
    }

    /// Checks every `every` until `stop`.
    pub async fn run(self, every: Duration, stop: CancellationToken) {
        let mut failing = false;
        loop {
            match tokio::time::timeout(every.max(Duration::from_secs(1)), self.check()).await {
                Ok(Ok(_)) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::warn!(group = %self.group_id, error = %e,
                        "cannot read whether the group is paused; keeping the state last read");
                }
                Err(_) if !failing => {
                    failing = true;
                    tracing::warn!(group = %self.group_id,
                        "reading whether the group is paused timed out; keeping the state last read");
                }
                _ => {}
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}
