//! Asynchronous order exports: a client submits filters, gets a job id at once, polls the job and
//! downloads its CSV file once the `export` consumer group has written it.
//!
//! - [`filters`]: the body of `POST /exports` and its checks.
//! - [`job`]: an export job as the API returns it, and why a request about one fails.
//! - [`settings`]: where the export files are and where their events go.
//! - [`store`]: the job row and its `export.requested` event, written in one transaction; reading
//!   a job back; opening its file for download.
//!
//! The order service and the export group share two things: the database (the group reads
//! `orders` and moves `export_job` along) and the export directory (the group writes the files,
//! the order service serves them).

mod filters;
mod job;
mod settings;
mod store;

pub use filters::{validate_export, ExportRequest, FilterError};
pub use job::{ExportError, ExportJob};
pub use settings::ExportSettings;
pub use store::{Download, ExportService};
