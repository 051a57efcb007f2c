//! PostgreSQL's own ceiling: the pipeline's server, on the same machine, with nothing of the
//! pipeline running. Two shapes bound the pipeline's two kinds of database work:
//!
//! - `commit_tps`: transactions of one event-sized row each (BEGIN, INSERT, COMMIT) from as many
//!   connections as the order service pools: the most a writer committing one event per
//!   transaction could reach, as the order service does per request;
//! - `batch_rows_per_s`: rows inserted by transactions of `--consumer-max-batch` rows each (one
//!   multi-row INSERT), from one connection per partition: the shape of the relay's and the
//!   consumers' batches.
//!
//! The table has what the outbox has per row: an identity key, a unique uuid and a jsonb payload.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

use super::config::Settings;
use super::envs::EnvRegistry;
use super::orders::EventMessage;
use super::procstat::{round1, shared_processes, CpuMeter, CpuUse};

/// The order service's default pool size (`DATABASE_MAX_CONNECTIONS`).
pub(crate) const WRITER_CONNECTIONS: u32 = 16;

/// What PostgreSQL alone achieved.
#[derive(Debug, Clone, Serialize)]
pub struct DatabaseCeiling {
    pub payload_bytes: usize,
    pub commit_connections: u32,
    pub commit_seconds: f64,
    pub commit_tps: f64,
    pub cpu_commit: CpuUse,
    pub batch_rows: u32,
    pub batch_connections: u32,
    pub batch_seconds: f64,
    pub batch_rows_per_s: f64,
    pub cpu_batch: CpuUse,
}

/// Measures both shapes in a database of their own.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<DatabaseCeiling> {
    let env = envs.create("bench_pg", 1).await?;
    let result = measure(settings, &env.database_url).await;
    notes.extend(envs.release(env).await);
    result
}

async fn measure(settings: &Settings, database_url: &str) -> anyhow::Result<DatabaseCeiling> {
    let duration = if settings.quick {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(15)
    };
    let batch_connections = u32::try_from(settings.partitions.max(1))?;
    let pool = PgPoolOptions::new()
        .max_connections(WRITER_CONNECTIONS.max(batch_connections))
        .connect(database_url)
        .await
        .context("connecting for the database ceiling")?;
    create_row_table(&pool).await?;
    let payload = EventMessage::new(Uuid::new_v4(), 1, 1, settings.products).payload;

    let meter = CpuMeter::start(shared_processes());
    let (commits, commit_seconds) =
        run_for(&pool, WRITER_CONNECTIONS, duration, &payload, 1).await?;
    let cpu_commit = meter.finish();

    let meter = CpuMeter::start(shared_processes());
    let (batches, batch_seconds) = run_for(
        &pool,
        batch_connections,
        duration,
        &payload,
        settings.consumer_max_batch,
    )
    .await?;
    let cpu_batch = meter.finish();
    pool.close().await;

    Ok(DatabaseCeiling {
        payload_bytes: payload.len(),
        commit_connections: WRITER_CONNECTIONS,
        commit_seconds: round1(commit_seconds),
        commit_tps: round1(commits as f64 / commit_seconds),
        cpu_commit,
        batch_rows: settings.consumer_max_batch,
        batch_connections,
        batch_seconds: round1(batch_seconds),
        batch_rows_per_s: round1(
            (batches * u64::from(settings.consumer_max_batch)) as f64 / batch_seconds,
        ),
        cpu_batch,
    })
}

/// Creates `bench_ceiling`: a table with what the outbox has per row (an identity key, a unique
/// uuid and a jsonb payload), outside the outbox.
pub(crate) async fn create_row_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE bench_ceiling (
             id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             event_id   uuid        NOT NULL UNIQUE,
             payload    jsonb       NOT NULL,
             created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// `connections` tasks commit transactions of `rows` rows each for `duration`; returns the
/// transactions committed and the seconds they took.
async fn run_for(
    pool: &PgPool,
    connections: u32,
    duration: Duration,
    payload: &str,
    rows: u32,
) -> anyhow::Result<(u64, f64)> {
    let committed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (pool, committed, stop) = (pool.clone(), committed.clone(), stop.clone());
        let payload = payload.to_owned();
        tasks.push(tokio::spawn(async move {
            let payloads = vec![payload; usize::try_from(rows)?];
            while !stop.load(Ordering::Relaxed) {
                let ids: Vec<Uuid> = (0..rows).map(|_| Uuid::now_v7()).collect();
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO bench_ceiling (event_id, payload)
                     SELECT * FROM unnest($1::uuid[], $2::text[]::jsonb[])",
                )
                .bind(&ids)
                .bind(&payloads)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                let _ = committed.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    Ok((
        committed.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
    ))
}
