//! Claiming the next batch of outbox events to publish.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use pipeline_core::db::HeldSession;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use uuid::Uuid;

/// The sessions claims run on: the relay's database with its statements planned once and
/// never with a nested loop or a sequential scan (`plan_cache_mode = force_generic_plan`,
/// `enable_nestloop = off`, `enable_seqscan = off`), one session.
///
/// The claim is prepared once per session (one round trip a claim: parse and describe are not
/// sent again) and planned once, not on every execution: at 1,000 events a second its planning
/// alone took a tenth of a core. A plan made once, perhaps while the queue and the outbox were
/// nearly empty, must hold however both grow until it is made again (after the relay's next
/// vacuum of the queue, whose new statistics invalidate it). Without nested loops and sequential
/// scans, every plan of [`CLAIM_SQL`] reads the queue in id order up to the batch's size and the
/// outbox by the claimed ids, through their indexes. Measured on a 100,000-event queue with the
/// plan made while it held three: 7 ms for a batch of 5,000 (9 ms with 3,000 aggregates left
/// out), 0.07 ms for 10; a plan of the same statement with nested loops looked each claimed id
/// up again with all of them, 0.7 s for 5,000.
///
/// The session is kept between claims (see [`HeldSession`]): a claim on a session taken from the
/// pool and handed back would cost the pool's checks of it, a round trip each, every time.
#[derive(Debug, Clone)]
pub struct ClaimSessions {
    pool: PgPool,
    session: Arc<Mutex<HeldSession>>,
}

impl ClaimSessions {
    /// Sessions like `pool`'s (same server, credentials and settings), opened when first used.
    pub fn new(pool: &PgPool) -> ClaimSessions {
        let options = (*pool.connect_options()).clone().options([
            ("plan_cache_mode", "force_generic_plan"),
            ("enable_nestloop", "off"),
            ("enable_seqscan", "off"),
        ]);
        let pool = pipeline_core::db::pool_options(1, pool.options().get_acquire_timeout())
            .connect_lazy_with(options);
        ClaimSessions {
            pool,
            session: Arc::default(),
        }
    }

    /// The claims' session (opened if there is none), held while the guard lives: for a look at
    /// what runs on it.
    pub async fn session(&self) -> Result<MappedMutexGuard<'_, PgConnection>, sqlx::Error> {
        let mut held = self.session.lock().await;
        let _ = held.get(&self.pool).await?;
        MutexGuard::try_map(held, HeldSession::session)
            .map_err(|_| sqlx::Error::Protocol("the claims' session went away".into()))
    }
}

/// One outbox row on its way to Kafka.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct OutboxEvent {
    /// The outbox row's id (its commit order within a writer).
    pub id: i64,
    /// The event's id (the consumers' dedupe key).
    pub event_id: Uuid,
    /// What happened.
    pub event_type: String,
    /// The aggregate: the record's key.
    pub aggregate_id: String,
    /// The event's place among its aggregate's events.
    pub sequence: i64,
    /// Where it is published.
    pub topic: String,
    /// The JSON payload, as text.
    pub payload: String,
    /// Extra headers the writer set (a JSON object).
    pub headers: Value,
    /// Attempts so far that failed.
    pub attempts: i32,
    /// When the event was committed to the outbox.
    pub created_at: DateTime<Utc>,
}

impl OutboxEvent {
    /// Extra headers stored on the row, as (name, value) pairs.
    pub fn extra_headers(&self) -> Vec<(String, String)> {
        match &self.headers {
            Value::Object(map) => map
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), v)
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// Reads up to `limit` pending events that are due, in commit-safe order.
///
/// Rows are chosen from the relay's queue (`outbox_unpublished`), never by a high-water mark, so an
/// event whose transaction commits after a later id was read is picked up by the next claim
/// instead of being skipped. An event is held while an earlier event of its aggregate is queued
/// and not itself in this batch (failed, or waiting for its next attempt): events of one
/// aggregate leave in sequence order. Events of one aggregate are ordered by id as well as by
/// sequence, because the sequence row lock makes their inserts happen one after the other. Only a
/// row that already failed an attempt can be failed or waiting for a retry, so the check reads a
/// partial index of such rows.
pub async fn claim_batch(
    sessions: &ClaimSessions,
    limit: i64,
) -> Result<Vec<OutboxEvent>, sqlx::Error> {
    claim_batch_excluding(sessions, limit, &[]).await
}

/// [`claim_batch`], leaving out every event of the aggregates in `busy`: those with a batch
/// still on its way to Kafka. A later event of such an aggregate waits until that batch's outcome
/// is recorded, so it can never overtake an earlier event that ends up failing.
pub async fn claim_batch_excluding(
    sessions: &ClaimSessions,
    limit: i64,
    busy: &[&str],
) -> Result<Vec<OutboxEvent>, sqlx::Error> {
    let mut held = sessions.session.lock().await;
    let session = held.get(&sessions.pool).await?;
    // Prepared and planned once per session (see [`ClaimSessions`]).
    let claimed = sqlx::query_as::<_, OutboxEvent>(CLAIM_SQL)
        .bind(limit)
        .bind(busy)
        .fetch_all(session)
        .await;
    if claimed.is_err() {
        held.failed();
    }
    claimed
}

/// The claim query; `$1` is the batch size, `$2` the aggregates to leave out. The queue is read
/// in id order and limited; whether an earlier event of a row's aggregate failed or waits for a
/// retry is a lookup in the partial index of retried rows for that row (`OFFSET 0` keeps it a
/// lookup: as a join it would read the queue whole before the limit); the aggregates left out
/// are a hashed set (`NOT IN` of the unnested list; `<> ALL` of a parameter would compare each row
/// with every one of them). Then the events are fetched by id through the outbox's primary key
/// (`= ANY` of the claimed ids, so the planner cannot choose to read the large outbox whole).
pub const CLAIM_SQL: &str = "WITH q AS MATERIALIZED (
     SELECT u.id, u.attempts
     FROM outbox_unpublished u
     WHERE u.state = 'pending'
       AND u.next_attempt_at <= now()
       AND u.aggregate_id NOT IN (SELECT unnest($2::text[]))
       AND NOT EXISTS (
           SELECT 1 FROM outbox_unpublished p
           WHERE p.aggregate_id = u.aggregate_id
             AND p.sequence < u.sequence
             AND p.attempts > 0
             AND (p.state = 'failed' OR p.next_attempt_at > now())
           OFFSET 0)
     ORDER BY u.id
     LIMIT $1)
 SELECT o.id, o.event_id, o.event_type, o.aggregate_id, o.sequence, o.topic,
        o.payload::text AS payload, o.headers, q.attempts, o.created_at
 FROM outbox o JOIN q ON q.id = o.id
 WHERE o.id = ANY (ARRAY(SELECT id FROM q))
 ORDER BY o.id";
