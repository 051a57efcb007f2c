//! Order exports: the event the order service records when a client asks for an export, and the
//! filters and file names the order service and the `export` consumer group share.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::order_events::OrderStatus;

/// Default topic of export jobs. Only the `export` group reads it: the order groups never see
/// an export event.
pub const EXPORT_JOBS_TOPIC: &str = "export-jobs";

/// Event type recorded when an export is requested.
pub const EXPORT_REQUESTED: &str = "export.requested";

/// The columns of an export file, in order (its first line).
pub const EXPORT_COLUMNS: [&str; 8] = [
    "order_id",
    "customer_id",
    "email",
    "status",
    "created_at",
    "updated_at",
    "line_count",
    "item_count",
];

/// Which orders an export holds: every given filter must match. Checked by the order service
/// before it is stored (`created_from` < `created_to`, `customer_id` 1 to 200 characters).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportFilters {
    /// Orders in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<OrderStatus>,
    /// Orders created at or after this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_from: Option<DateTime<Utc>>,
    /// Orders created before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_to: Option<DateTime<Utc>>,
    /// Orders of this customer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer_id: Option<String>,
}

/// The payload of an `export.requested` event. The job row (`export_job`) is the truth; the
/// event only says which job to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRequested {
    /// The job (also the event's aggregate id).
    pub job_id: Uuid,
    /// The filters, as stored on the job.
    pub filters: ExportFilters,
}

/// The finished file of job `id`, in the export directory.
pub fn export_file_name(id: Uuid) -> String {
    format!("export-{id}.csv")
}

/// The file job `id` is written to before it is complete; renamed to [`export_file_name`] once
/// it is. Its leading dot keeps it out of plain listings.
pub fn export_temp_name(id: Uuid) -> String {
    format!(".export-{id}.csv.tmp")
}
