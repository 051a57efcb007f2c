//! Which aggregates the relay's queue holds events of, as the stream needs to know it: a streamed
//! event of such an aggregate joins the queue behind them, or it would be published ahead of an
//! earlier event of its aggregate.
//!
//! While it streams, the relay alone adds to the queue (writers queue nothing), so it keeps those
//! aggregates in memory: it adds the ones it queues, and reads the queue again at most once a
//! second while any are kept, since the queue's claim publishes and removes them. A read of the
//! log then costs no statement, however long a failed event stays queued. Until then it asks
//! the database about each read's aggregates: while a writer that began before the stream may
//! still queue an event, and while the queue holds more events than it keeps the aggregates of.

use std::collections::HashSet;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::source;

/// Most events the queue may hold for their aggregates to be kept in memory; while it holds more,
/// each read's aggregates are asked about.
const MOST_KEPT: usize = 10_000;

/// How often the kept aggregates are read again while there are any.
const READ_AGAIN_EVERY: Duration = Duration::from_secs(1);

/// What the stream knows of the queue's aggregates.
pub(crate) struct QueuedAggregates {
    state: State,
}

enum State {
    /// Each read's aggregates are asked about. `writers_before`: a transaction whose id is below
    /// it may have queued events before the stream began; once none is open, and the queue holds
    /// at most [`MOST_KEPT`] events (tried at most once a second), their aggregates are kept.
    Asking {
        writers_before: i64,
        settled: bool,
        tried: Option<Instant>,
    },
    /// The aggregates as read at `read_at`, with those queued since.
    Kept {
        aggregates: HashSet<String>,
        read_at: Instant,
    },
}

impl QueuedAggregates {
    /// Once writers have been told the stream began: from here on, only the transactions open
    /// before this call may still queue events of their own.
    pub(crate) async fn start(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(QueuedAggregates {
            state: State::Asking {
                writers_before: source::next_transaction_id(pool).await?,
                settled: false,
                tried: None,
            },
        })
    }

    /// Of `aggregates` (sorted, each once), those the queue may hold events of: every one it
    /// holds events of, and perhaps some whose events it has published since it was last read.
    pub(crate) async fn among(
        &mut self,
        pool: &PgPool,
        aggregates: &[&str],
    ) -> Result<HashSet<String>, sqlx::Error> {
        if let State::Kept {
            aggregates: kept,
            read_at,
        } = &mut self.state
        {
            if !kept.is_empty() && read_at.elapsed() >= READ_AGAIN_EVERY {
                match source::all_queued_aggregates(pool, MOST_KEPT).await? {
                    Some(read) => {
                        *kept = read;
                        *read_at = Instant::now();
                    }
                    None => {
                        self.state = State::Asking {
                            writers_before: 0,
                            settled: true,
                            tried: Some(Instant::now()),
                        };
                    }
                }
            }
        }
        match &mut self.state {
            State::Kept {
                aggregates: kept, ..
            } => Ok(aggregates
                .iter()
                .filter(|a| kept.contains(**a))
                .map(|a| (*a).to_owned())
                .collect()),
            State::Asking {
                writers_before,
                settled,
                tried,
            } => {
                let asked = source::queued_aggregates(pool, aggregates, *writers_before).await?;
                *settled |= asked.writers_done;
                if *settled && !asked.any {
                    self.keep(HashSet::new());
                } else if *settled && tried.is_none_or(|t| t.elapsed() >= READ_AGAIN_EVERY) {
                    *tried = Some(Instant::now());
                    if let Some(read) = source::all_queued_aggregates(pool, MOST_KEPT).await? {
                        self.keep(read);
                    }
                }
                Ok(asked.queued)
            }
        }
    }

    /// Notes aggregates whose events the stream has just queued.
    pub(crate) fn add<'a>(&mut self, aggregates: impl IntoIterator<Item = &'a str>) {
        if let State::Kept {
            aggregates: kept, ..
        } = &mut self.state
        {
            kept.extend(aggregates.into_iter().map(str::to_owned));
        }
    }

    fn keep(&mut self, aggregates: HashSet<String>) {
        tracing::debug!(
            aggregates = aggregates.len(),
            "the queue's aggregates are kept in memory"
        );
        self.state = State::Kept {
            aggregates,
            read_at: Instant::now(),
        };
    }
}
