//! The relay's claim with many delayed events waiting (`--phases delayed`): the claim of a
//! batch of pending events, timed with no delayed event and with `--delayed-events`
//! (1,000,000 by default) waiting a day ahead, and the release step that moves due delayed
//! events into the outbox, timed with nothing due and with a full batch due.

use std::time::{Duration, Instant};

use anyhow::Context;
use relay::claim::{claim_batch, ClaimSessions};
use relay::lease::{Elector, LeaseSettings};
use relay::release::release_due;
use serde::Serialize;
use sqlx::PgPool;

use super::config::Settings;
use super::envs::EnvRegistry;
use super::procstat::round1;

/// Pending events the claim chooses from, and the batch size it claims (the relay's default).
const PENDING: i64 = 20_000;
const BATCH: i64 = 5_000;
/// Timed repetitions of each statement.
const REPEAT: usize = 30;
/// Full batches released one after the other.
const RELEASES: usize = 5;

/// Statement times, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct DelayedResult {
    pub pending_events: i64,
    pub delayed_events: i64,
    pub claim_batch: i64,
    /// Claim of `claim_batch` pending events with no delayed event waiting: median, p95.
    pub claim_without_delayed_ms: (f64, f64),
    /// The same claim with `delayed_events` waiting a day ahead.
    pub claim_with_delayed_ms: (f64, f64),
    /// The release step when nothing is due, with `delayed_events` waiting.
    pub release_nothing_due_ms: (f64, f64),
    /// Releases moving `claim_batch` due events into the outbox each, in the order run.
    pub release_full_batch_ms: Vec<f64>,
}

/// Runs the measurement in a database of its own.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<DelayedResult> {
    let env = envs.create("bench_sched", 1).await?;
    let result = measure(settings.delayed_events, &env.pool).await;
    notes.extend(envs.release(env).await);
    result
}

async fn measure(delayed: i64, pool: &PgPool) -> anyhow::Result<DelayedResult> {
    sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload)
         SELECT gen_random_uuid(), 'order-' || n, 'order.placed', 'order-' || n, 1, 'bench',
                jsonb_build_object('n', n)
         FROM generate_series(1, $1) AS n",
    )
    .bind(PENDING)
    .execute(pool)
    .await
    .context("pending events")?;
    // As `outbox::enqueue` leaves it: each aggregate's last sequence number.
    sqlx::query(
        "INSERT INTO outbox_sequence (aggregate_id, last_sequence)
         SELECT 'order-' || n, 1 FROM generate_series(1, $1) AS n",
    )
    .bind(PENDING)
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox_unpublished")
        .execute(pool)
        .await?;
    // The relay's claim sessions, connected before the timing starts.
    let claims = ClaimSessions::new(pool);
    let _ = claim_batch(&claims, BATCH).await?;
    let claim_without = time(REPEAT, || async {
        claim_batch(&claims, BATCH).await.map(|_| ())
    })
    .await?;

    sqlx::query(
        "INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
                                       payload, publish_at)
         SELECT gen_random_uuid(), 'order-' || n, 'order.payment_reminder', 'order-' || n,
                'bench', jsonb_build_object('n', n),
                now() + interval '1 day' + n * interval '1 millisecond'
         FROM generate_series(1, $1) AS n",
    )
    .bind(delayed)
    .execute(pool)
    .await
    .context("delayed events")?;
    sqlx::query("VACUUM ANALYZE outbox_delayed")
        .execute(pool)
        .await?;
    let claim_with = time(REPEAT, || async {
        claim_batch(&claims, BATCH).await.map(|_| ())
    })
    .await?;

    let mut elector = Elector::new(
        LeaseSettings {
            lock_key: 1,
            lease_ttl: Duration::from_secs(600),
            standby_retry: Duration::from_millis(100),
        },
        (*pool.connect_options()).clone(),
    );
    let (lease, _) = elector
        .try_acquire()
        .await?
        .context("the relay lease of a fresh database is vacant")?;
    let release_idle = time(REPEAT, || async {
        release_due(pool, lease.fence(), BATCH)
            .await
            .map(|_| ())
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))
    })
    .await?;
    // A full batch falls due (the earliest ones) and is moved in one statement; five times.
    let mut full_ms = Vec::with_capacity(RELEASES);
    for _ in 0..RELEASES {
        sqlx::query(
            "UPDATE outbox_delayed SET publish_at = now() - interval '1 second'
             WHERE event_id IN (SELECT event_id FROM outbox_delayed
                                ORDER BY publish_at LIMIT $1)",
        )
        .bind(BATCH)
        .execute(pool)
        .await?;
        let started = Instant::now();
        let moved = release_due(pool, lease.fence(), BATCH).await?.events;
        full_ms.push(round1(started.elapsed().as_secs_f64() * 1000.0));
        anyhow::ensure!(
            moved == BATCH as u64,
            "released {moved} of {BATCH} due events"
        );
    }
    Ok(DelayedResult {
        pending_events: PENDING,
        delayed_events: delayed,
        claim_batch: BATCH,
        claim_without_delayed_ms: claim_without,
        claim_with_delayed_ms: claim_with,
        release_nothing_due_ms: release_idle,
        release_full_batch_ms: full_ms,
    })
}

/// Median and 95th percentile of `n` runs of `step`, in milliseconds, after one warm-up run.
async fn time<F, Fut>(n: usize, mut step: F) -> anyhow::Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>>,
{
    step().await?;
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        step().await?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Ok((round1(at(0.5)), round1(at(0.95))))
}
