//! Error responses: every refusal is `{"error": "..."}` JSON with a fitting status code.
//!
//! Client mistakes get a 4xx naming the mistake. Server faults get a 500 (or a 503 when a retry
//! may help) with a generic message; the cause goes to the log, never to the client.

use axum::extract::rejection::PathRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use outbox::EnqueueError;
use serde_json::json;

use crate::exports::{ExportError, FilterError};
use crate::orders::OrderError;
use crate::validation::ValidationError;

/// A refused request: status code and the message the client sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    /// An error answering `status` with `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
    }
}

impl From<OrderError> for ApiError {
    fn from(e: OrderError) -> Self {
        match e {
            OrderError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            OrderError::IllegalTransition(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            OrderError::UnknownProducts(_) | OrderError::IdempotencyKeyReused => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
            }
            OrderError::Database(e) | OrderError::Enqueue(EnqueueError::Database(e)) => {
                database_error(&e)
            }
            OrderError::CommitFailed(_) => {
                tracing::warn!(error = %e, "shared order transaction's commit failed");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database commit failed; the change may or may not have been applied",
                )
            }
            OrderError::EventAlreadyRecorded { .. }
            | OrderError::CorruptStatus(_)
            | OrderError::Enqueue(_) => {
                tracing::error!(error = %e, "order change refused: inconsistent data");
                Self::internal()
            }
        }
    }
}

impl From<FilterError> for ApiError {
    fn from(e: FilterError) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
    }
}

impl From<ExportError> for ApiError {
    fn from(e: ExportError) -> Self {
        match e {
            ExportError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            ExportError::NotReady { .. } => Self::new(StatusCode::CONFLICT, e.to_string()),
            ExportError::Expired(_) => Self::new(StatusCode::GONE, e.to_string()),
            ExportError::TooManyPending(_) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            ExportError::Database(e) | ExportError::Enqueue(EnqueueError::Database(e)) => {
                database_error(&e)
            }
            ExportError::FileMissing(_) => {
                tracing::error!(
                    error = %e,
                    "a succeeded export's file is not in --export-dir: is it the directory the \
                     export group writes to?"
                );
                Self::internal()
            }
            ExportError::Io(_) | ExportError::Enqueue(_) => {
                tracing::error!(error = %e, "export refused");
                Self::internal()
            }
        }
    }
}

/// 503 for faults a retry may get past (pool exhausted, connection lost, serialisation
/// failure, server shutting down), 500 for the rest.
fn database_error(e: &sqlx::Error) -> ApiError {
    let transient = match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(code.as_ref(), "40001" | "40P01")
                || code.starts_with("08")
                || code.starts_with("57P")
        }),
        _ => false,
    };
    if transient {
        tracing::warn!(error = %e, "database unavailable");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database temporarily unavailable, retry later",
        )
    } else {
        tracing::error!(error = %e, "database error");
        ApiError::internal()
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, rejection.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orders::{Action, IllegalTransition};
    use demo_events::order_events::OrderStatus;

    #[test]
    fn domain_errors_map_to_client_statuses() {
        let e: ApiError = OrderError::from(IllegalTransition {
            action: Action::Pay,
            status: OrderStatus::Paid,
        })
        .into();
        assert_eq!(e.status, StatusCode::CONFLICT);
        assert_eq!(e.message, "cannot pay an order that is paid");
        let e: ApiError = OrderError::UnknownProducts(vec!["sku-x".into()]).into();
        assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(e.message.contains("sku-x"));
        let e: ApiError = OrderError::Database(sqlx::Error::PoolTimedOut).into();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        let e: ApiError = OrderError::Database(sqlx::Error::RowNotFound).into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.message, "internal error");
    }
}
