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
//! And what a transaction costs the server when transactions come one at a time, as the
//! pipeline's do at low rates (`paced`): from one connection, 100 transactions a second of three
//! shapes, one statement, twenty round trips (BEGIN, 18 × `SELECT 1`, COMMIT) and a one-row
//! commit, and the server's CPU per transaction of each.
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
use super::procstat::{round1, shared_processes, CpuMeter, CpuUse, POSTGRES};

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
    pub paced: PacedCost,
}

/// The server's CPU per transaction when transactions come one at a time.
#[derive(Debug, Clone, Serialize)]
pub struct PacedCost {
    /// Transactions a second, from one connection.
    pub rate: f64,
    /// Seconds each shape ran.
    pub seconds: f64,
    /// PostgreSQL's CPU µs per transaction of one statement (`SELECT 1`).
    pub one_statement_us: f64,
    /// … of twenty round trips: BEGIN, eighteen `SELECT 1`, COMMIT.
    pub twenty_round_trips_us: f64,
    /// … of BEGIN, a one-row INSERT (the ceiling's row) and COMMIT.
    pub one_row_commit_us: f64,
    /// Each round trip after a transaction's first: the difference of the first two shapes over
    /// nineteen.
    pub round_trip_us: f64,
}

/// The shapes of [`PacedCost`].
#[derive(Clone, Copy)]
enum Shape {
    OneStatement,
    TwentyRoundTrips,
    OneRowCommit,
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
    let paced = paced_cost(&pool, settings, &payload).await?;
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
        paced,
    })
}

/// Runs each [`Shape`] at 100 transactions a second and measures the server's CPU.
async fn paced_cost(
    pool: &PgPool,
    settings: &Settings,
    payload: &str,
) -> anyhow::Result<PacedCost> {
    const RATE: f64 = 100.0;
    let seconds = if settings.quick { 5.0 } else { 15.0 };
    let mut conn = pool.acquire().await?;
    let mut per_transaction = Vec::new();
    for shape in [
        Shape::OneStatement,
        Shape::TwentyRoundTrips,
        Shape::OneRowCommit,
    ] {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / RATE));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        let meter = CpuMeter::start(shared_processes());
        let mut transactions: u64 = 0;
        while Instant::now() < until {
            let _ = tick.tick().await;
            run_shape(&mut conn, shape, payload).await?;
            transactions += 1;
        }
        let used = meter.finish();
        let server = used.cpu_seconds.get(POSTGRES).copied().unwrap_or(0.0);
        per_transaction.push(round1(server * 1e6 / transactions.max(1) as f64));
    }
    let [one, twenty, commit] = per_transaction[..] else {
        anyhow::bail!("three shapes measured");
    };
    Ok(PacedCost {
        rate: RATE,
        seconds,
        one_statement_us: one,
        twenty_round_trips_us: twenty,
        one_row_commit_us: commit,
        round_trip_us: round1((twenty - one) / 19.0),
    })
}

async fn run_shape(
    conn: &mut sqlx::PgConnection,
    shape: Shape,
    payload: &str,
) -> Result<(), sqlx::Error> {
    use sqlx::Connection;
    match shape {
        Shape::OneStatement => {
            let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
        }
        Shape::TwentyRoundTrips => {
            let mut tx = conn.begin().await?;
            for _ in 0..18 {
                let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *tx).await?;
            }
            tx.commit().await?;
        }
        Shape::OneRowCommit => {
            let mut tx = conn.begin().await?;
            sqlx::query(
                "INSERT INTO bench_ceiling (event_id, payload) VALUES ($1, $2::text::jsonb)",
            )
            .bind(Uuid::now_v7())
            .bind(payload)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
    }
    Ok(())
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
