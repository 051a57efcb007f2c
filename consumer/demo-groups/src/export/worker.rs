//! The worker beside the `export` group: claims one processing job at a time under a lease,
//! writes its file ([`file::write_export`]) and records the outcome; retries transient failures
//! with backoff up to `--export-max-attempts`; and every `--export-sweep-interval` removes
//! the files of expired exports and temporary files left by dead workers and reads the jobs still
//! waiting. Each attempt's outcome and each sweep go into [`ExportMetrics`].

use std::time::{Duration, Instant};

use anyhow::Context;
use consumer::backoff;
use demo_events::export_events::export_file_name;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::file::{self, WriteError};
use super::jobs;
use super::metrics::ExportMetrics;
use super::ExportSettings;

/// First wait after a failed attempt; doubles with each further one, up to [`RETRY_MAX`].
pub const RETRY_BASE: Duration = Duration::from_secs(1);
/// Longest wait between two attempts.
pub const RETRY_MAX: Duration = Duration::from_secs(60);
/// Most expired jobs removed by one statement of a sweep.
const SWEEP_BATCH: i64 = 100;

/// What one step of the worker did, to job `id` (the claimed job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No job was free to claim.
    Idle,
    /// The job's file is complete and recorded, with `rows` data rows.
    Succeeded {
        /// The job.
        id: Uuid,
        /// Data rows in its file.
        rows: i64,
    },
    /// The attempt failed for `reason`; the job is tried again later.
    RetryLater {
        /// The job.
        id: Uuid,
        /// Why the attempt failed.
        reason: String,
    },
    /// The job is failed for good.
    Failed {
        /// The job.
        id: Uuid,
        /// Why.
        reason: String,
        /// Whether submitting the same export again may succeed.
        retryable: bool,
    },
    /// Another worker took the job over; this one recorded nothing.
    LeaseLost {
        /// The job.
        id: Uuid,
    },
    /// The worker is stopping; the job was given back.
    Stopped {
        /// The job.
        id: Uuid,
    },
}

/// Runs the worker until `stop`, counting what it does in `metrics`.
pub async fn run(
    pool: PgPool,
    settings: ExportSettings,
    metrics: ExportMetrics,
    stop: CancellationToken,
) {
    if let Err(e) = tokio::fs::create_dir_all(&settings.dir).await {
        tracing::error!(dir = %settings.dir.display(), error = %e, "cannot create the export directory");
    }
    let sweep_every = settings.sweep_interval;
    let mut swept_at: Option<Instant> = None;
    while !stop.is_cancelled() {
        if swept_at.is_none_or(|t| t.elapsed() >= sweep_every) {
            sweep_and_measure(&pool, &settings, &metrics).await;
            swept_at = Some(Instant::now());
        }
        let started = Instant::now();
        let step = export_next(&pool, &settings, &stop).await;
        if let Ok(step) = &step {
            count(&metrics, step, started.elapsed());
        }
        let wait = match step {
            Ok(Step::Idle) => settings.poll,
            Ok(_) => Duration::ZERO,
            Err(e) => {
                tracing::warn!(error = %e, "export worker: database error; retrying");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// [`sweep`], then the jobs still waiting, into `metrics`; a failure of either is logged and
/// left for the next sweep.
async fn sweep_and_measure(pool: &PgPool, settings: &ExportSettings, metrics: &ExportMetrics) {
    match sweep(pool, settings).await {
        Ok(expired) => metrics.expired.inc_by(expired),
        Err(e) => tracing::warn!(error = format!("{e:#}"), "export sweep failed; retrying"),
    }
    match jobs::waiting(pool).await {
        Ok((jobs, oldest_seconds)) => {
            metrics.waiting.set(jobs);
            metrics.oldest_waiting.set(oldest_seconds);
        }
        Err(e) => tracing::warn!(error = %e, "reading the waiting export jobs failed"),
    }
}

/// Counts one step of the worker, which took `took` from its claim.
fn count(metrics: &ExportMetrics, step: &Step, took: Duration) {
    match step {
        Step::Idle | Step::Stopped { .. } => {}
        Step::Succeeded { rows, .. } => {
            metrics.attempt("succeeded");
            metrics.duration.observe(took.as_secs_f64());
            metrics.rows.inc_by(u64::try_from(*rows).unwrap_or(0));
        }
        Step::RetryLater { .. } => metrics.attempt("retried"),
        Step::Failed { .. } => metrics.attempt("failed"),
        Step::LeaseLost { .. } => metrics.attempt("lease_lost"),
    }
}

/// Claims the next free job, if any, writes its file and records the outcome.
pub async fn export_next(
    pool: &PgPool,
    settings: &ExportSettings,
    stop: &CancellationToken,
) -> Result<Step, sqlx::Error> {
    let Some(mut job) = jobs::claim(pool, settings.lease).await? else {
        return Ok(Step::Idle);
    };
    let id = job.id;
    let started = Instant::now();
    tracing::info!(export_id = %id, attempt = job.attempts, "export claimed");
    let step = match file::write_export(pool, &mut job, settings, stop).await {
        Ok(written) => {
            if jobs::record_succeeded(pool, &job, &written, settings.ttl).await? {
                tracing::info!(
                    export_id = %id,
                    rows = written.row_count,
                    checksum = %written.checksum,
                    seconds = started.elapsed().as_secs_f64(),
                    outcome = "succeeded",
                    "export finished"
                );
                Step::Succeeded {
                    id,
                    rows: written.row_count,
                }
            } else {
                Step::LeaseLost { id }
            }
        }
        Err(WriteError::Permanent(reason)) => fail(pool, &job, settings, reason, false).await?,
        Err(WriteError::Transient(reason)) if job.attempts >= settings.max_attempts => {
            fail(pool, &job, settings, reason, true).await?
        }
        Err(WriteError::Transient(reason)) => {
            let after = backoff(
                RETRY_BASE,
                RETRY_MAX,
                u32::try_from(job.attempts).unwrap_or(1),
            );
            tracing::warn!(export_id = %id, attempt = job.attempts, %reason, ?after, "export attempt failed; retrying");
            if jobs::retry_later(pool, &job, &reason, after).await? {
                Step::RetryLater { id, reason }
            } else {
                Step::LeaseLost { id }
            }
        }
        Err(WriteError::LeaseLost) => Step::LeaseLost { id },
        Err(WriteError::Stopped) => {
            let _ = jobs::release(pool, &job).await?;
            Step::Stopped { id }
        }
    };
    if step == (Step::LeaseLost { id }) {
        tracing::warn!(export_id = %id, "export lease taken over; this worker recorded nothing");
    }
    Ok(step)
}

async fn fail(
    pool: &PgPool,
    job: &jobs::Claimed,
    settings: &ExportSettings,
    reason: String,
    retryable: bool,
) -> Result<Step, sqlx::Error> {
    if !jobs::record_failed(pool, job, &reason, retryable, settings.ttl).await? {
        return Ok(Step::LeaseLost { id: job.id });
    }
    tracing::warn!(export_id = %job.id, %reason, retryable, attempts = job.attempts, outcome = "failed", "export failed");
    Ok(Step::Failed {
        id: job.id,
        reason,
        retryable,
    })
}

/// Removes the files of jobs whose time is up and marks them expired (file first, so a crash in
/// between leaves a job the next sweep finishes), then the rows of jobs expired for longer than
/// `--export-retain`, then temporary files untouched for longer than a lease. Returns how
/// many jobs expired.
pub async fn sweep(pool: &PgPool, settings: &ExportSettings) -> anyhow::Result<u64> {
    let mut expired = 0;
    loop {
        let due = jobs::expiring(pool, SWEEP_BATCH)
            .await
            .context("listing expired exports")?;
        if due.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(due.len());
        for (id, _) in due {
            let path = settings.dir.join(export_file_name(id));
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("removing {}", path.display()));
                }
            }
            ids.push(id);
        }
        let marked = jobs::mark_expired(pool, &ids)
            .await
            .context("marking exports expired")?;
        tracing::info!(exports = marked, "expired exports removed");
        expired += marked;
        if ids.len() < usize::try_from(SWEEP_BATCH).unwrap_or(usize::MAX) {
            break;
        }
    }
    loop {
        let removed = jobs::remove_expired(pool, settings.retain, SWEEP_BATCH)
            .await
            .context("removing expired export jobs")?;
        if removed > 0 {
            tracing::info!(
                jobs = removed,
                "expired export jobs past their retention removed"
            );
        }
        if removed < u64::try_from(SWEEP_BATCH).unwrap_or(u64::MAX) {
            break;
        }
    }
    let stray = file::remove_stray_temp_files(&settings.dir, settings.lease)
        .await
        .context("removing stray temporary export files")?;
    if stray > 0 {
        tracing::info!(files = stray, "stray temporary export files removed");
    }
    Ok(expired)
}
