//! The export jobs' rows: submitting one (the row and its event in one transaction), reading one
//! back, and opening a finished one's file.

use std::path::Path;
use std::sync::Arc;

use demo_events::export_events::{
    export_file_name, ExportFilters, ExportRequested, EXPORT_REQUESTED,
};
use outbox::NewEvent;
use pipeline_core::envelope::TRACEPARENT;
use sqlx::PgPool;
use uuid::Uuid;

use super::job::{ExportError, ExportJob};
use super::settings::ExportSettings;

/// The columns of [`ExportJob`]; a finished job whose `expires_at` has passed reads `expired`.
const JOB_COLUMNS: &str = "id,
    CASE WHEN state IN ('succeeded', 'failed') AND expires_at <= clock_timestamp()
         THEN 'expired' ELSE state END AS state,
    filters, row_count, checksum, failure_reason, retryable, attempts,
    created_at, started_at, finished_at, expires_at, file_name";

/// Submits, reads and serves export jobs.
#[derive(Debug, Clone)]
pub struct ExportService {
    pool: PgPool,
    settings: Arc<ExportSettings>,
}

/// A finished export ready to stream: its job and its open file.
#[derive(Debug)]
pub struct Download {
    pub job: ExportJob,
    pub file_name: String,
    pub file: tokio::fs::File,
    pub len: u64,
}

impl ExportService {
    /// Jobs in `pool`'s `export_job`, events recorded for `settings.topic`, files read from
    /// `settings.dir`.
    pub fn new(pool: PgPool, settings: ExportSettings) -> Self {
        ExportService {
            pool,
            settings: Arc::new(settings),
        }
    }

    /// Records a pending job for `filters` and its `export.requested` event in one transaction:
    /// both or neither. Returns the job as stored.
    pub async fn submit(
        &self,
        filters: &ExportFilters,
        traceparent: Option<&str>,
    ) -> Result<ExportJob, ExportError> {
        let id = Uuid::now_v7();
        let stored = serde_json::to_value(filters)
            .map_err(|e| ExportError::Database(sqlx::Error::Encode(Box::new(e))))?;
        let payload = serde_json::to_value(ExportRequested {
            job_id: id,
            filters: filters.clone(),
        })
        .map_err(|e| ExportError::Database(sqlx::Error::Encode(Box::new(e))))?;
        let mut tx = self.pool.begin().await?;
        // Submissions take turns (a transaction-scoped lock, taken by a statement of its own so
        // that the next one's snapshot sees the jobs of those before), so the count is exact.
        let _ = sqlx::query("SELECT pg_advisory_xact_lock(hashtext('export_job submit'))")
            .execute(&mut *tx)
            .await?;
        let job: Option<ExportJob> = sqlx::query_as(&format!(
            "INSERT INTO export_job (id, filters)
             SELECT $1, $2
             WHERE (SELECT count(*) FROM export_job
                    WHERE state IN ('pending', 'processing')) < $3
             RETURNING {JOB_COLUMNS}"
        ))
        .bind(id)
        .bind(&stored)
        .bind(i64::from(self.settings.max_pending))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(job) = job else {
            return Err(ExportError::TooManyPending(self.settings.max_pending));
        };
        let event = NewEvent {
            business_key: id.to_string(),
            event_type: EXPORT_REQUESTED.to_owned(),
            aggregate_id: id.to_string(),
            topic: self.settings.topic.clone(),
            payload,
            headers: traceparent
                .map(|tp| vec![(TRACEPARENT.to_owned(), tp.to_owned())])
                .unwrap_or_default(),
        };
        let _ = outbox::enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(job)
    }

    /// The job `id`, if there is one.
    pub async fn get(&self, id: Uuid) -> Result<Option<ExportJob>, ExportError> {
        Ok(sqlx::query_as(&format!(
            "SELECT {JOB_COLUMNS} FROM export_job WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The file of job `id`, opened for streaming, once the job has succeeded and until it
    /// expires.
    pub async fn download(&self, id: Uuid) -> Result<Download, ExportError> {
        let job = self.get(id).await?.ok_or(ExportError::NotFound(id))?;
        match job.state.as_str() {
            "succeeded" => {}
            "expired" => return Err(ExportError::Expired(id)),
            _ => {
                return Err(ExportError::NotReady {
                    id,
                    state: job.state.clone(),
                    reason: job.failure_reason.clone(),
                })
            }
        }
        // The name is always derived from the id; a stored name that differs is refused rather
        // than followed, so no row can point the service at another file.
        let file_name = export_file_name(id);
        if job.file_name.as_deref() != Some(file_name.as_str()) {
            return Err(ExportError::FileMissing(
                Path::new(&file_name).to_path_buf(),
            ));
        }
        let path = self.settings.dir.join(&file_name);
        let file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ExportError::FileMissing(path))
            }
            Err(e) => return Err(e.into()),
        };
        let len = file.metadata().await?.len();
        Ok(Download {
            job,
            file_name,
            file,
            len,
        })
    }
}
