//! Claiming the next batch of outbox events to publish.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

/// The sessions claims run on: the relay's database with every statement planned with its
/// values (`plan_cache_mode = force_custom_plan`), one session.
///
/// A cached generic plan of the claim, made while the queue table was small, turns its
/// anti-join into a scan per row once the table has grown; with its values known to the
/// planner, `<> ALL` of a long list is a hash lookup. So the claim is planned on every
/// execution, but it is prepared once per session: one round trip a claim instead of two
/// (parse and describe, then execute), which a claim sent unprepared needs.
#[derive(Debug, Clone)]
pub struct ClaimSessions {
    pool: PgPool,
}

impl ClaimSessions {
    /// Sessions like `pool`'s (same server, credentials and settings), opened when first used.
    pub fn new(pool: &PgPool) -> ClaimSessions {
        let options = (*pool.connect_options())
            .clone()
            .options([("plan_cache_mode", "force_custom_plan")]);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(options);
        ClaimSessions { pool }
    }

    /// The sessions' pool (one session), for a look at what runs on it.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// One outbox row on its way to Kafka.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxEvent {
    pub id: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub topic: String,
    pub payload: String,
    pub headers: Value,
    pub attempts: i32,
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
    // Planned on every execution (see [`ClaimSessions`]), prepared once.
    sqlx::query_as::<_, OutboxEvent>(CLAIM_SQL)
        .bind(limit)
        .bind(busy)
        .fetch_all(&sessions.pool)
        .await
}

/// The claim query; `$1` is the batch size, `$2` the aggregates to leave out. The queue is read
/// first and limited, then the events are fetched by id through the outbox's primary key (`= ANY`
/// of the claimed ids, so the planner cannot choose to read the large outbox whole).
pub const CLAIM_SQL: &str = "WITH q AS MATERIALIZED (
     SELECT u.id, u.attempts
     FROM outbox_unpublished u
     WHERE u.state = 'pending'
       AND u.next_attempt_at <= now()
       AND u.aggregate_id <> ALL ($2::text[])
       AND NOT EXISTS (
           SELECT 1 FROM outbox_unpublished p
           WHERE p.aggregate_id = u.aggregate_id
             AND p.sequence < u.sequence
             AND p.attempts > 0
             AND (p.state = 'failed' OR p.next_attempt_at > now()))
     ORDER BY u.id
     LIMIT $1)
 SELECT o.id, o.event_id, o.event_type, o.aggregate_id, o.sequence, o.topic,
        o.payload::text AS payload, o.headers, q.attempts, o.created_at
 FROM outbox o JOIN q ON q.id = o.id
 WHERE o.id = ANY (ARRAY(SELECT id FROM q))
 ORDER BY o.id";
