//! An export job as the API returns it, and why a request about one fails.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

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
    /// As many jobs as `--export-max-pending` are pending or being written.
    #[error("{0} exports are pending or being written already; try again when one has finished")]
    TooManyPending(u32),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("outbox: {0}")]
    Enqueue(#[from] outbox::EnqueueError),
}
