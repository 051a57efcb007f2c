//! The sizes of the tables retention keeps small: on disk (heap and indexes) and in rows (the
//! statistics collector's estimates, which need no scan), at named moments and every 30 s in
//! between. A table in time partitions counts its partitions and the rows kept past them
//! (`<table>_held`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The pipeline's tables that grow with every event.
pub const TABLES: [&str; 9] = [
    "outbox",
    "outbox_delivery",
    "outbox_unpublished",
    "outbox_attempt",
    "processed_message",
    "applied_effect",
    "group_transition",
    "aggregate_progress",
    "dead_letter",
];

const SAMPLE_EVERY: Duration = Duration::from_secs(30);

/// One table's size.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TableSize {
    /// `pg_table_size`: heap, free space map, visibility map, TOAST.
    pub table_bytes: i64,
    /// `pg_indexes_size`.
    pub index_bytes: i64,
    /// `n_live_tup`, `n_dead_tup`: estimates.
    pub live_rows: i64,
    pub dead_rows: i64,
}

impl TableSize {
    pub fn bytes(&self) -> i64 {
        self.table_bytes + self.index_bytes
    }
}

/// Every table's size at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Sizes {
    /// Seconds since the phase began.
    pub t: f64,
    pub tables: BTreeMap<String, TableSize>,
}

impl Sizes {
    /// Bytes of every table and its indexes.
    pub fn total_bytes(&self) -> i64 {
        self.tables.values().map(TableSize::bytes).sum()
    }
}

type Row = (String, i64, i64, i64, i64);

/// Reads the sizes; `t` is the phase's clock.
pub async fn read(pool: &PgPool, t: f64) -> anyhow::Result<Sizes> {
    let rows: Vec<Row> = sqlx::query_as(
        "/* bench */ SELECT t, sum(pg_table_size(p.relid))::bigint,
                sum(pg_indexes_size(p.relid))::bigint,
                sum(coalesce(s.n_live_tup, 0))::bigint, sum(coalesce(s.n_dead_tup, 0))::bigint
         FROM unnest($1::text[]) AS t
         CROSS JOIN LATERAL (
             SELECT oid AS relid FROM pg_class WHERE oid = to_regclass(t) AND relkind = 'r'
             UNION ALL
             SELECT relid FROM pg_partition_tree(to_regclass(t))
             WHERE isleaf AND (SELECT relkind FROM pg_class WHERE oid = to_regclass(t)) = 'p'
             UNION ALL
             SELECT to_regclass(t || '_held') WHERE to_regclass(t || '_held') IS NOT NULL) p
         LEFT JOIN pg_stat_user_tables s ON s.relid = p.relid
         GROUP BY t",
    )
    .bind(TABLES)
    .fetch_all(pool)
    .await?;
    Ok(Sizes {
        t: crate::procstat::round1(t),
        tables: rows
            .into_iter()
            .map(|(name, table_bytes, index_bytes, live_rows, dead_rows)| {
                (
                    name,
                    TableSize {
                        table_bytes,
                        index_bytes,
                        live_rows,
                        dead_rows,
                    },
                )
            })
            .collect(),
    })
}

/// A background reading of the sizes every 30 s.
pub struct SizeSampler {
    stop: CancellationToken,
    task: JoinHandle<Vec<Sizes>>,
}

impl SizeSampler {
    /// Starts sampling; `started` is the phase's clock.
    pub fn start(pool: PgPool, started: Instant) -> SizeSampler {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                if let Ok(s) = read(&pool, started.elapsed().as_secs_f64()).await {
                    samples.push(s);
                }
            }
            samples
        });
        SizeSampler { stop, task }
    }

    /// Stops and returns the samples.
    pub async fn finish(self) -> Vec<Sizes> {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}
