//! What a consumer group does with an event: the handler contract and its error kinds.

use futures::future::BoxFuture;
use pipeline_core::envelope::Envelope;
use sqlx::PgConnection;

/// An event ready to apply: its envelope and its raw JSON payload.
#[derive(Debug, Clone)]
pub struct Event {
    pub envelope: Envelope,
    pub payload: serde_json::Value,
}

/// Why a handler could not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The event itself is bad (unknown type, payload the handler rejects): dead-letter it.
    #[error("rejected: {0}")]
    Rejected(String),
    /// The database failed: the batch is retried.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A consumer group's business logic. Effects are written through `conn`, inside the transaction
/// that also records the event as processed, so they commit exactly once or not at all.
pub trait Handler: Send + Sync + 'static {
    /// The consumer group name, also the dedupe scope.
    fn group(&self) -> &str;

    /// Runs once per batch before any event is applied, e.g. to lock the rows the batch touches
    /// in a fixed order so that concurrent batches cannot deadlock.
    fn prepare<'a>(
        &'a self,
        _conn: &'a mut PgConnection,
        _events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }

    /// Applies one event.
    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// Parses the order snapshot every order event carries.
pub fn order_snapshot(
    event: &Event,
) -> Result<pipeline_core::order_events::OrderSnapshot, HandlerError> {
    let snapshot: pipeline_core::order_events::OrderSnapshot =
        serde_json::from_value(event.payload.clone()).map_err(|e| {
            HandlerError::Rejected(format!("payload is not an order snapshot: {e}"))
        })?;
    if snapshot.order_id.to_string() != event.envelope.aggregate_id {
        return Err(HandlerError::Rejected(format!(
            "payload order_id {} does not match key {}",
            snapshot.order_id, event.envelope.aggregate_id
        )));
    }
    Ok(snapshot)
}
