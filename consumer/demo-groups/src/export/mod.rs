//! The `export` group: writes the orders an export job asks for to a CSV file.
//!
//! The order service records each job (`export_job`, state `pending`) and its `export.requested`
//! event in one transaction. This group's handler moves the job to `processing` in the event's
//! exactly-once transaction ([`Exports`]); a job that is no longer pending is left as it is, so a
//! redelivered event changes nothing. The file itself is written by a worker beside the group
//! ([`worker::run`]), because an export can take far longer than a batch transaction may stay
//! open: it claims a processing job under a lease, streams the matching orders from PostgreSQL to
//! `.export-<id>.csv.tmp`, renames it to `export-<id>.csv` once complete, and records the job
//! `succeeded` with its row count and SHA-256. Finished jobs expire after a configured time and
//! their files are removed.
//!
//! The group's database must be the order service's (it reads `orders` and updates
//! `export_job`), and its export directory the one the order service serves downloads from. Run
//! it in a consumer process of its own on the export topic, so the order groups never see export
//! events: `consumer run --group export --topic export-jobs --export-dir DIR`.
//!
//! - [`jobs`]: the statements on `export_job` (claim, lease, outcomes, expiry).
//! - [`file`](mod@file): writing a job's file (streamed rows, hashed and counted as they go) and reading a
//!   finished one back.
//! - [`worker`]: the loop beside the group: one job at a time, retries, the expiry sweep.
//! - [`metrics`]: what the worker's attempts and sweeps came to, for Prometheus.

pub mod file;
pub mod jobs;
pub mod metrics;
pub mod worker;

use std::path::PathBuf;
use std::time::Duration;

use demo_events::export_events::{ExportRequested, EXPORT_REQUESTED};
use demo_events::order_events::ORDER_EVENTS_TOPIC;
use futures::future::BoxFuture;
use sqlx::PgConnection;
use uuid::Uuid;

use consumer::{Event, Handler, HandlerError, HandlerTransaction};

/// How the export worker writes, retries and expires exports (`consumer run --export-…`).
#[derive(clap::Args, Debug, Clone)]
pub struct ExportSettings {
    /// Directory export files are written to; the order service must serve downloads from the
    /// same directory.
    #[arg(
        id = "export_dir",
        long = "export-dir",
        value_name = "DIR",
        env = "EXPORT_DIR",
        default_value = "exports"
    )]
    pub dir: PathBuf,
    /// How long a finished export stays downloadable; then its file is removed.
    #[arg(
        long = "export-ttl",
        env = "EXPORT_TTL",
        default_value = "1day",
        value_parser = humantime::parse_duration
    )]
    pub ttl: Duration,
    /// Attempts at writing one export before it is failed (retryable).
    #[arg(long = "export-max-attempts", env = "EXPORT_MAX_ATTEMPTS", default_value_t = 5,
          value_parser = clap::value_parser!(i32).range(1..))]
    pub max_attempts: i32,
    /// A worker's claim on a job, renewed every third of it while it writes: a worker that dies
    /// leaves its job to another after this. At least 3 s.
    #[arg(long = "export-lease", env = "EXPORT_LEASE", default_value = "60s",
          value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// Longest one export's query may run (the worker's own `statement_timeout`; the group's
    /// batch transactions keep theirs).
    #[arg(
        id = "export_statement_timeout",
        long = "export-statement-timeout",
        env = "EXPORT_STATEMENT_TIMEOUT",
        default_value = "1h",
        value_parser = humantime::parse_duration
    )]
    pub statement_timeout: Duration,
    /// How often the worker looks for a job when idle.
    #[arg(long = "export-poll", env = "EXPORT_POLL", default_value = "200ms",
          value_parser = humantime::parse_duration)]
    pub poll: Duration,
    /// How often expired exports are removed.
    #[arg(
        long = "export-sweep-interval",
        env = "EXPORT_SWEEP_INTERVAL",
        default_value = "10s",
        value_parser = humantime::parse_duration
    )]
    pub sweep_interval: Duration,
    /// How long an expired export's job row is kept (its file is already gone), at least a day:
    /// the sweep then removes it. Jobs not finished, and finished ones not yet expired, are never
    /// removed.
    #[arg(
        long = "export-retain",
        env = "EXPORT_RETAIN",
        default_value = "30days",
        value_parser = humantime::parse_duration
    )]
    pub retain: Duration,
}

impl Default for ExportSettings {
    fn default() -> Self {
        ExportSettings {
            dir: PathBuf::from("exports"),
            ttl: Duration::from_secs(86_400),
            max_attempts: 5,
            lease: Duration::from_secs(60),
            statement_timeout: Duration::from_secs(3_600),
            poll: Duration::from_millis(200),
            sweep_interval: Duration::from_secs(10),
            retain: Duration::from_secs(30 * 86_400),
        }
    }
}

impl ExportSettings {
    /// Refuses settings the worker cannot work with.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.lease >= Duration::from_secs(3),
            "--export-lease must be at least 3s (it is renewed every third of it)"
        );
        anyhow::ensure!(
            !self.poll.is_zero() && !self.sweep_interval.is_zero(),
            "--export-poll and --export-sweep-interval must be positive"
        );
        anyhow::ensure!(
            self.retain >= Duration::from_secs(86_400),
            "--export-retain must be at least 1day"
        );
        Ok(())
    }
}

/// Refuses a `consumer run` that would mix export jobs with order events: the export group runs
/// alone in its process, on a topic other than the order events'. Other groups would dead-letter
/// every export event they saw, and the export group every order event.
pub fn check_runs_alone(groups: &[String], topics: &[String]) -> anyhow::Result<()> {
    if !groups.iter().any(|g| g == "export") {
        return Ok(());
    }
    anyhow::ensure!(
        groups.iter().all(|g| g == "export"),
        "the export group runs in a consumer process of its own (--group export alone), \
         not beside {}",
        groups
            .iter()
            .filter(|g| *g != "export")
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    anyhow::ensure!(
        !topics.iter().any(|t| t == ORDER_EVENTS_TOPIC),
        "the export group consumes the export topic (--topic export-jobs), not {ORDER_EVENTS_TOPIC}"
    );
    Ok(())
}

/// The export group's handler: starts the job each `export.requested` event names.
pub struct Exports {
    group: String,
}

impl Exports {
    /// The handler of the export group with id `group` (its dedupe scope).
    pub fn new(group: impl Into<String>) -> Self {
        Exports {
            group: group.into(),
        }
    }
}

impl Handler for Exports {
    fn group(&self) -> &str {
        &self.group
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(ExportTransaction)
    }
}

struct ExportTransaction;

impl HandlerTransaction for ExportTransaction {
    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let job_id = requested_job(event)?;
            if jobs::start(conn, job_id).await? {
                tracing::info!(export_id = %job_id, "export started");
                return Ok(());
            }
            match jobs::state(conn, job_id).await? {
                // Started before: this is a redelivery, and the job goes on (or is done) as is.
                Some(state) => {
                    tracing::info!(export_id = %job_id, %state, "export event redelivered; job left as it is");
                    Ok(())
                }
                None => Err(HandlerError::Rejected(format!(
                    "export job {job_id} does not exist"
                ))),
            }
        })
    }
}

/// The job an `export.requested` event names; anything else is rejected (dead-lettered).
fn requested_job(event: &Event) -> Result<Uuid, HandlerError> {
    if event.envelope.event_type != EXPORT_REQUESTED {
        return Err(HandlerError::Rejected(format!(
            "the export group handles `{EXPORT_REQUESTED}` only, not `{}`",
            event.envelope.event_type
        )));
    }
    let requested: ExportRequested = serde_json::from_value(event.payload.clone())
        .map_err(|e| HandlerError::Rejected(format!("payload is not an export request: {e}")))?;
    if requested.job_id.to_string() != event.envelope.aggregate_id {
        return Err(HandlerError::Rejected(format!(
            "payload job_id {} does not match key {}",
            requested.job_id, event.envelope.aggregate_id
        )));
    }
    Ok(requested.job_id)
}
