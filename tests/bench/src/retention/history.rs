//! The history the retention phase starts with: events published and applied by every group
//! three days ago, written in bulk with plain SQL, as a pipeline that has run for a while holds
//! them.
//!
//! Event `n` (0-based) of `total` happened at `t0 + n × span / total`; every five events are one
//! order's, sequences 1 to 5. Event and order ids are UUIDv7 of those times, as the order service
//! makes them, so they sort in time order as live ids do. The outbox side (outbox, delivery,
//! sequence rows) and the groups' side (dedupe rows, effect history, progress) are written by two
//! sessions at once, in chunks.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection};

use super::disk::{Room, BYTES_PER_EVENT};
use crate::broker::round3;
use crate::run::say;

/// Events per chunk: a multiple of five, so no order straddles two chunks.
const CHUNK: i64 = 1_000_000;
/// Events per order.
const PER_ORDER: i64 = 5;
/// How long ago the history starts, and how long it lasts.
const AGE: Duration = Duration::from_secs(3 * 24 * 3600 + 3600);
const SPAN: Duration = Duration::from_secs(3600);

/// What was loaded.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryLoad {
    pub events: i64,
    pub orders: i64,
    pub oldest: DateTime<Utc>,
    pub newest: DateTime<Utc>,
    /// Wall seconds of the inserts (both sessions), then of VACUUM ANALYZE and a checkpoint.
    pub insert_seconds: f64,
    pub vacuum_seconds: f64,
    /// Average bytes of an outbox payload.
    pub payload_bytes: f64,
}

/// The session's helper: a UUIDv7 of time `at`, its random bits taken from `seed`.
const UUID_V7_FN: &str = "
CREATE FUNCTION pg_temp.bench_uuid_v7(at timestamptz, seed text) RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$
    SELECT (lpad(to_hex((extract(epoch FROM at) * 1000)::bigint), 12, '0')
            || '7' || substr(md5(seed), 1, 3) || '8' || substr(md5(seed), 4, 15))::uuid
$$";

/// One chunk's events, computed once per session and read by each insert.
const CHUNK_TABLE: &str = "
CREATE TEMP TABLE history_chunk (
    n bigint, event_id uuid, order_id text, sequence bigint, event_type text, at timestamptz)";

/// `$1` first event, `$2` past the last, `$3` t0, `$4` seconds between events.
const FILL_CHUNK: &str = "
INSERT INTO history_chunk
SELECT n, pg_temp.bench_uuid_v7($3 + n * $4 * interval '1 second', 'event-' || n),
       pg_temp.bench_uuid_v7($3 + (n / 5 * 5) * $4 * interval '1 second', 'order-' || n / 5)::text,
       n % 5 + 1,
       (ARRAY['order.placed', 'order.paid', 'order.packed', 'order.shipped',
              'order.delivered'])[n % 5 + 1],
       $3 + n * $4 * interval '1 second'
FROM generate_series($1::bigint, $2 - 1) AS n";

/// The outbox side: the events, where Kafka stored them, each order's last sequence. The
/// session runs with `session_replication_role = replica`, so the outbox's trigger does not
/// queue these events for the relay: they are published already. `$1` topic, `$2` partitions.
const INSERT_OUTBOX: &str = "
INSERT INTO outbox (id, event_id, business_key, event_type, aggregate_id, sequence, topic, payload,
                    created_at)
OVERRIDING SYSTEM VALUE
SELECT n + 1, event_id, order_id, event_type, order_id, sequence, $1,
       jsonb_build_object(
           'order_id', order_id, 'customer_id', 'customer-' || (n / 5 % 1000 + 1),
           'status', split_part(event_type, '.', 2),
           'lines', jsonb_build_array(jsonb_build_object(
               'product_id', 'sku-' || lpad((n / 5 % 100 + 1)::text, 5, '0'),
               'quantity', 1 + n / 5 % 3))),
       at
FROM history_chunk";
const INSERT_DELIVERY: &str = "
INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts, published_at)
SELECT n + 1, n % $1, n / $1, 1, at + interval '5 milliseconds' FROM history_chunk";
const INSERT_SEQUENCE: &str = "
INSERT INTO outbox_sequence (aggregate_id, last_sequence)
SELECT order_id, max(sequence) FROM history_chunk GROUP BY order_id";

/// The groups' side, for group `$1`: dedupe rows (`$2` topic, `$3` partitions), the effect
/// history, each order's progress. Applied 20 ms after the event.
const INSERT_PROCESSED: &str = "
INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset, outcome,
                               processed_at)
SELECT $1, event_id, $2, n % $3, n / $3, 'applied', at + interval '20 milliseconds'
FROM history_chunk";
const INSERT_APPLIED: &str = "
INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type, occurred_at,
                            applied_at)
SELECT $1, event_id, aggregate_id, sequence, event_type, at, at + interval '20 milliseconds'
FROM history_chunk";
const INSERT_PROGRESS: &str = "
INSERT INTO aggregate_progress (group_name, aggregate_id, last_sequence, updated_at)
SELECT $1, aggregate_id, max(sequence), max(at) + interval '20 milliseconds'
FROM history_chunk GROUP BY aggregate_id";

/// Which tables a session writes.
#[derive(Clone, Copy)]
enum Side<'a> {
    Outbox,
    /// The group ids.
    Groups(&'a [String]),
}

impl Side<'_> {
    fn name(self) -> &'static str {
        match self {
            Side::Outbox => "outbox",
            Side::Groups(_) => "groups",
        }
    }

    /// Writes the chunk in `history_chunk` to this side's tables.
    async fn insert(
        self,
        conn: &mut PgConnection,
        topic: &str,
        partitions: i32,
    ) -> sqlx::Result<()> {
        match self {
            Side::Outbox => {
                sqlx::query(INSERT_OUTBOX)
                    .bind(topic)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(INSERT_DELIVERY)
                    .bind(partitions)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(INSERT_SEQUENCE).execute(&mut *conn).await?;
            }
            Side::Groups(groups) => {
                for group in groups {
                    sqlx::query(INSERT_PROCESSED)
                        .bind(group)
                        .bind(topic)
                        .bind(partitions)
                        .execute(&mut *conn)
                        .await?;
                    for sql in [INSERT_APPLIED, INSERT_PROGRESS] {
                        sqlx::query(sql).bind(group).execute(&mut *conn).await?;
                    }
                }
            }
        }
        Ok(())
    }
}

const TABLES: [&str; 6] = [
    "outbox",
    "outbox_delivery",
    "outbox_sequence",
    "processed_message",
    "applied_effect",
    "aggregate_progress",
];

/// Loads `total` events for `groups` (their group ids) on `topic`, then vacuums and analyses.
pub async fn load(
    database_url: &str,
    total: i64,
    topic: &str,
    partitions: i32,
    groups: &[String],
    room: &Room,
) -> anyhow::Result<HistoryLoad> {
    room.ensure(
        u64::try_from(total)? * BYTES_PER_EVENT,
        &format!("loading {total} history events"),
    )?;
    let t0 = Utc::now() - chrono::Duration::from_std(AGE)?;
    let step = SPAN.as_secs_f64() / total as f64;
    let started = Instant::now();
    let chunks = Chunks {
        database_url,
        total,
        t0,
        step,
        topic,
        partitions,
        room,
    };
    let outbox_side = chunks.load(Side::Outbox);
    let group_side = chunks.load(Side::Groups(groups));
    let (o, g) = tokio::join!(outbox_side, group_side);
    o?;
    g?;
    let insert_seconds = started.elapsed().as_secs_f64();

    let started = Instant::now();
    let mut conn = PgConnection::connect(database_url).await?;
    conn.execute(
        "SELECT setval(pg_get_serial_sequence('outbox', 'id'), (SELECT max(id) FROM outbox))",
    )
    .await?;
    for table in TABLES {
        say(&format!("history: VACUUM ANALYZE {table}"));
        conn.execute(format!("VACUUM ANALYZE {table}").as_str())
            .await?;
    }
    conn.execute("CHECKPOINT").await?;
    let vacuum_seconds = started.elapsed().as_secs_f64();
    let payload_bytes: f64 = sqlx::query_scalar(
        "SELECT avg(octet_length(payload::text))::float8 FROM outbox TABLESAMPLE SYSTEM (1)",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    Ok(HistoryLoad {
        events: total,
        orders: (total + PER_ORDER - 1) / PER_ORDER,
        oldest: t0,
        newest: t0 + chrono::Duration::from_std(SPAN)?,
        insert_seconds: round3(insert_seconds),
        vacuum_seconds: round3(vacuum_seconds),
        payload_bytes: crate::procstat::round1(payload_bytes),
    })
}

/// The chunks both sessions write.
struct Chunks<'a> {
    database_url: &'a str,
    total: i64,
    t0: DateTime<Utc>,
    /// Seconds between events.
    step: f64,
    topic: &'a str,
    partitions: i32,
    room: &'a Room,
}

impl Chunks<'_> {
    /// One session writing `side`, chunk by chunk, each chunk in one transaction.
    async fn load(&self, side: Side<'_>) -> anyhow::Result<()> {
        let mut conn = PgConnection::connect(self.database_url).await?;
        conn.execute("SET session_replication_role = replica")
            .await?;
        conn.execute("SET synchronous_commit = off").await?;
        conn.execute(UUID_V7_FN).await?;
        conn.execute(CHUNK_TABLE).await?;
        let started = Instant::now();
        let mut lo = 0;
        while lo < self.total {
            self.room.ensure(0, "the next chunk")?;
            let hi = (lo + CHUNK).min(self.total);
            let mut tx = conn.begin().await?;
            tx.execute("TRUNCATE history_chunk").await?;
            sqlx::query(FILL_CHUNK)
                .bind(lo)
                .bind(hi)
                .bind(self.t0)
                .bind(self.step)
                .execute(&mut *tx)
                .await?;
            side.insert(&mut tx, self.topic, self.partitions).await?;
            tx.commit().await?;
            say(&format!(
                "history ({}): {hi} of {} events ({:.0} s)",
                side.name(),
                self.total,
                started.elapsed().as_secs_f64()
            ));
            lo = hi;
        }
        conn.close().await?;
        Ok(())
    }
}
