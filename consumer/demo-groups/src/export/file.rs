//! A job's file: the matching orders streamed from PostgreSQL through a CSV writer into a
//! temporary file, hashed and counted as they go, then made visible by a rename; and a finished
//! file read back (its rows and checksum) when a job is claimed again after it was renamed.
//!
//! Memory stays flat however many orders match: rows are read one at a time from the query's
//! stream and the CSV text goes to the file in chunks of [`CHUNK_BYTES`].

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};
use demo_events::export_events::{
    export_file_name, export_temp_name, ExportFilters, EXPORT_COLUMNS,
};
use futures::TryStreamExt;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::jobs::{self, Claimed, Written};
use super::ExportSettings;

/// CSV text gathered before it is hashed and written.
pub const CHUNK_BYTES: usize = 64 * 1024;

/// The orders an export holds, oldest first, with their lines counted. The worker's transaction
/// lets the planner choose freely (the group's sessions prefer key lookups, right for its batches
/// but not for reading a large part of `orders`).
const EXPORT_QUERY: &str = "
    SELECT o.order_id, o.customer_id, o.email, o.status, o.created_at, o.updated_at,
           l.line_count, l.item_count
    FROM orders o
    CROSS JOIN LATERAL (SELECT count(*) AS line_count,
                               COALESCE(sum(ol.quantity), 0)::bigint AS item_count
                        FROM order_line ol WHERE ol.order_id = o.order_id) l
    WHERE ($1::text IS NULL OR o.status = $1)
      AND ($2::timestamptz IS NULL OR o.created_at >= $2)
      AND ($3::timestamptz IS NULL OR o.created_at < $3)
      AND ($4::text IS NULL OR o.customer_id = $4)
    ORDER BY o.created_at, o.order_id";

/// Why a job's file was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The job can never succeed (its stored filters are unreadable).
    #[error("{0}")]
    Permanent(String),
    /// The database or the file system failed; another attempt may succeed.
    #[error("{0}")]
    Transient(String),
    /// Another worker holds the job now.
    #[error("the job's lease was taken over")]
    LeaseLost,
    /// The worker is stopping.
    #[error("stopped")]
    Stopped,
}

impl From<sqlx::Error> for WriteError {
    fn from(e: sqlx::Error) -> Self {
        WriteError::Transient(format!("database: {e}"))
    }
}

impl From<std::io::Error> for WriteError {
    fn from(e: std::io::Error) -> Self {
        WriteError::Transient(format!("export file: {e}"))
    }
}

/// Writes `job`'s file into `settings.dir`, or adopts the finished file a previous attempt left
/// (renamed, but not recorded), and returns what it holds.
pub async fn write_export(
    pool: &PgPool,
    job: &mut Claimed,
    settings: &ExportSettings,
    stop: &CancellationToken,
) -> Result<Written, WriteError> {
    let filters: ExportFilters = serde_json::from_value(job.filters.clone())
        .map_err(|e| WriteError::Permanent(format!("stored filters are unreadable: {e}")))?;
    let file_name = export_file_name(job.id);
    let final_path = settings.dir.join(&file_name);
    if tokio::fs::try_exists(&final_path).await? {
        tracing::info!(export_id = %job.id, "adopting the file a previous attempt finished");
        return read_back(final_path, file_name).await;
    }
    tokio::fs::create_dir_all(&settings.dir).await?;
    let temp_path = settings.dir.join(export_temp_name(job.id));
    let result = write_temp(pool, job, &filters, &temp_path, settings, stop).await;
    let (row_count, checksum) = match result {
        Ok(written) => written,
        Err(e) => {
            if !matches!(e, WriteError::LeaseLost) {
                let _ = tokio::fs::remove_file(&temp_path).await;
            }
            return Err(e);
        }
    };
    tokio::fs::rename(&temp_path, &final_path).await?;
    sync_dir(&settings.dir).await?;
    Ok(Written {
        file_name,
        row_count,
        checksum,
    })
}

/// Streams the rows into `temp_path` and syncs it; returns the row count and checksum.
async fn write_temp(
    pool: &PgPool,
    job: &mut Claimed,
    filters: &ExportFilters,
    temp_path: &Path,
    settings: &ExportSettings,
    stop: &CancellationToken,
) -> Result<(i64, String), WriteError> {
    let mut file = tokio::fs::File::create(temp_path).await?;
    let mut sink = HashedChunks::default();
    sink.csv.write_record(EXPORT_COLUMNS).map_err(csv_error)?;
    let mut rows = 0i64;
    let renew_every = settings.lease / 3;
    let mut renewed_at = Instant::now();

    let mut tx = pool.begin().await?;
    sqlx::query(
        "SELECT set_config('statement_timeout', $1, true),
                set_config('enable_seqscan', 'on', true),
                set_config('enable_hashjoin', 'on', true),
                set_config('enable_mergejoin', 'on', true)",
    )
    .bind(format!("{}ms", settings.statement_timeout.as_millis()))
    .execute(&mut *tx)
    .await?;
    {
        let mut stream = sqlx::query(EXPORT_QUERY)
            .bind(filters.status.map(|s| s.as_str()))
            .bind(filters.created_from)
            .bind(filters.created_to)
            .bind(filters.customer_id.as_deref())
            .fetch(&mut *tx);
        while let Some(row) = stream.try_next().await? {
            write_row(&mut sink.csv, &row)?;
            rows += 1;
            if sink.pending() >= CHUNK_BYTES {
                sink.drain_to(&mut file).await?;
                if stop.is_cancelled() {
                    return Err(WriteError::Stopped);
                }
                if renewed_at.elapsed() >= renew_every {
                    if !jobs::renew(pool, job, settings.lease).await? {
                        return Err(WriteError::LeaseLost);
                    }
                    renewed_at = Instant::now();
                }
            }
        }
    }
    tx.commit().await?;
    sink.drain_to(&mut file).await?;
    file.sync_all().await?;
    Ok((rows, sink.checksum()))
}

fn write_row(
    csv: &mut csv::Writer<SharedBuffer>,
    row: &sqlx::postgres::PgRow,
) -> Result<(), WriteError> {
    let order_id: uuid::Uuid = row.try_get(0)?;
    let customer_id: &str = row.try_get(1)?;
    let email: Option<&str> = row.try_get(2)?;
    let status: &str = row.try_get(3)?;
    let created_at: DateTime<Utc> = row.try_get(4)?;
    let updated_at: DateTime<Utc> = row.try_get(5)?;
    let line_count: i64 = row.try_get(6)?;
    let item_count: i64 = row.try_get(7)?;
    csv.write_record([
        order_id.to_string().as_str(),
        customer_id,
        email.unwrap_or(""),
        status,
        &created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        &updated_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        &line_count.to_string(),
        &item_count.to_string(),
    ])
    .map_err(csv_error)
}

fn csv_error(e: csv::Error) -> WriteError {
    WriteError::Transient(format!("writing CSV: {e}"))
}

/// CSV text on its way to the file, hashed as it is written.
struct HashedChunks {
    csv: csv::Writer<SharedBuffer>,
    buffer: SharedBuffer,
    hasher: Sha256,
}

/// The CSV writer's output, which [`HashedChunks::drain_to`] takes out between records (the
/// writer owns its output and lends no mutable access to it).
#[derive(Clone, Default)]
struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl SharedBuffer {
    fn take(&self) -> std::io::Result<Vec<u8>> {
        let mut bytes = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("export buffer poisoned"))?;
        Ok(std::mem::take(&mut *bytes))
    }

    fn len(&self) -> usize {
        self.0.lock().map_or(0, |b| b.len())
    }
}

impl Write for SharedBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("export buffer poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Default for HashedChunks {
    fn default() -> Self {
        let buffer = SharedBuffer::default();
        HashedChunks {
            csv: csv::Writer::from_writer(buffer.clone()),
            buffer,
            hasher: Sha256::new(),
        }
    }
}

impl HashedChunks {
    /// Bytes the CSV writer has handed over and not yet written.
    fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Hashes and writes what the CSV writer has produced so far.
    async fn drain_to(&mut self, file: &mut tokio::fs::File) -> Result<(), WriteError> {
        self.csv.flush()?;
        let chunk = self.buffer.take()?;
        self.hasher.update(&chunk);
        file.write_all(&chunk).await?;
        Ok(())
    }

    fn checksum(self) -> String {
        format!("{:x}", self.hasher.finalize())
    }
}

/// The rows and checksum of a finished file.
async fn read_back(path: PathBuf, file_name: String) -> Result<Written, WriteError> {
    let (row_count, checksum) = tokio::task::spawn_blocking(move || count_and_hash(&path))
        .await
        .map_err(|e| WriteError::Transient(format!("reading the export file back: {e}")))??;
    Ok(Written {
        file_name,
        row_count,
        checksum,
    })
}

/// Data rows (header excluded) and SHA-256 of the CSV file at `path`, in one pass.
pub fn count_and_hash(path: &Path) -> Result<(i64, String), WriteError> {
    struct Hashing<R> {
        inner: R,
        hasher: Sha256,
    }
    impl<R: Read> Read for Hashing<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.hasher.update(&buf[..n]);
            Ok(n)
        }
    }
    let file = std::fs::File::open(path)?;
    let mut reader = csv::Reader::from_reader(Hashing {
        inner: file,
        hasher: Sha256::new(),
    });
    let mut record = csv::ByteRecord::new();
    let mut rows = 0i64;
    while reader.read_byte_record(&mut record).map_err(csv_error)? {
        rows += 1;
    }
    let mut hashing = reader.into_inner();
    // The CSV reader stops at the end of the last record; hash whatever follows it too.
    let mut rest = Vec::new();
    let _ = hashing.read_to_end(&mut rest)?;
    Ok((rows, format!("{:x}", hashing.hasher.finalize())))
}

/// Makes a rename in `dir` durable.
async fn sync_dir(dir: &Path) -> std::io::Result<()> {
    tokio::fs::File::open(dir).await?.sync_all().await
}

/// Removes files of `dir` named like an export's temporary file and untouched for `older_than`:
/// left by a worker that died while writing. Returns how many.
pub async fn remove_stray_temp_files(dir: &Path, older_than: Duration) -> std::io::Result<usize> {
    let mut removed = 0;
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    while let Some(entry) = entries.next_entry().await? {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with(".export-") && name.ends_with(".csv.tmp")) {
            continue;
        }
        let idle = entry
            .metadata()
            .await?
            .modified()?
            .elapsed()
            .unwrap_or_default();
        if idle >= older_than {
            match tokio::fs::remove_file(entry.path()).await {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}
