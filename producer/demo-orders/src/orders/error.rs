//! Why an order operation did not happen.

use outbox::EnqueueError;
use uuid::Uuid;

use super::model::IllegalTransition;

/// Why an order operation did not happen. Nothing was written in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("order {0} not found")]
    NotFound(Uuid),
    #[error(transparent)]
    IllegalTransition(#[from] IllegalTransition),
    #[error("unknown product {}", .0.join(", "))]
    UnknownProducts(Vec<String>),
    #[error("Idempotency-Key was already used for a different request")]
    IdempotencyKeyReused,
    /// The outbox already holds this order's event of this type: the lifecycle makes that
    /// impossible, so the data is inconsistent and the change is refused.
    #[error("order {order_id} already has a `{event_type}` event in the outbox")]
    EventAlreadyRecorded {
        order_id: Uuid,
        event_type: &'static str,
    },
    #[error("stored order has unknown status `{0}`")]
    CorruptStatus(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The commit of a transaction shared with other requests failed: whether it took effect
    /// is unknown, as for any commit whose connection fails.
    #[error("database commit failed: {0}")]
    CommitFailed(String),
    #[error("outbox: {0}")]
    Enqueue(#[from] EnqueueError),
}

impl OrderError {
    /// True for a refusal decided before anything was written: the transaction it happened in
    /// is still good for other changes.
    pub(super) fn wrote_nothing(&self) -> bool {
        matches!(
            self,
            OrderError::NotFound(_)
                | OrderError::IllegalTransition(_)
                | OrderError::UnknownProducts(_)
                | OrderError::IdempotencyKeyReused
        )
    }
}
