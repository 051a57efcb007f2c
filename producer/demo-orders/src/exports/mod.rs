//! Asynchronous order exports: a client submits filters, gets a job id at once, polls the job and
//! downloads its CSV file once the `export` consumer group has written it.
//!
//! - [`filters`]: the body of `POST /exports` and its checks.
//! - [`store`]: the job row and its `export.requested` event, written in one transaction; reading
//!   a job back; opening its file for download.
//!
//! The order service and the export group share two things: the database (the group reads
//! `orders` and moves `export_job` along) and the export directory (the group writes the files,
//! the order service serves them).

mod filters;
mod store;

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use demo_events::export_events::EXPORT_JOBS_TOPIC;
use serde::Serialize;
use uuid::Uuid;

pub use filters::{validate_export, ExportRequest, FilterError};
pub use store::{Download, ExportService};

/// Where the order service finds export files and where it records export events
/// (`producer serve --export-dir … --export-topic …`).
#[derive(clap::Args, Debug, Clone)]
pub struct ExportSettings {
    /// Directory the `export` consumer group writes export files to, served from here: the two
    /// processes must see the same directory (a shared volume when they run on different hosts).
    #[arg(
        id = "export_dir",
        long = "export-dir",
        value_name = "DIR",
        env = "EXPORT_DIR",
        default_value = "exports"
    )]
    pub dir: PathBuf,
    /// Kafka topic of `export.requested` events, which only the `export` group consumes.
    #[arg(id = "export_topic", long = "export-topic", value_name = "TOPIC", env = "EXPORT_JOBS_TOPIC", default_value = EXPORT_JOBS_TOPIC,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub topic: String,
}

impl Default for ExportSettings {
    fn default() -> Self {
        ExportSettings {
            dir: PathBuf::from("exports"),
            topic: EXPORT_JOBS_TOPIC.to_owned(),
        }
    }
}

/// An export job as the API returns it. `state` is `expired` as soon as `expires_at` has passed,
/// even before the worker's sweep has removed the file.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ExportJob {
    pub id: Uuid,
    /// `pending`, `processing`, `succeeded`, `failed` or `expired`.
    pub state: String,
    pub filters: serde_json::Value,
    pub row_count: Option<i64>,
    /// SHA-256 of the file, lowercase hex.
    pub checksum: Option<String>,
    pub failure_reason: Option<String>,
    /// For a failed job: whether submitting the same export again may succeed.
    pub retryable: Option<bool>,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    pub file_name: Option<String>,
}

/// Why an export request was not answered with what was asked for.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export {0} not found")]
    NotFound(Uuid),
    /// The job has no file to download (yet, or ever).
    #[error("export {id} is {state}{}", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    NotReady {
        id: Uuid,
        state: String,
        reason: Option<String>,
    },
    #[error("export {0} has expired and its file was removed")]
    Expired(Uuid),
    /// The job succeeded but its file is not in this service's export directory: the directory
    /// is not the one the export group writes to, or the file was removed by hand.
    #[error("export file {0} is missing")]
    FileMissing(PathBuf),
    #[error("export directory: {0}")]
    Io(#[from] std::io::Error),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("outbox: {0}")]
    Enqueue(#[from] outbox::EnqueueError),
}
