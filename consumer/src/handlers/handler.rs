//! What a consumer group does with an event: the handler contract and its error kinds.

use futures::future::BoxFuture;
use pipeline_core::envelope::Envelope;
use sqlx::PgConnection;

/// An event ready to apply: its envelope and its raw JSON payload.
#[derive(Debug, Clone)]
pub struct Event {
    /// Ids, type, order (aggregate) and sequence, from the record's key and headers.
    pub envelope: Envelope,
    /// The record's payload, parsed as JSON.
    pub payload: serde_json::Value,
}

/// Why a handler could not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The event itself is bad (unknown type, payload the handler rejects): dead-letter it.
    #[error("rejected: {0}")]
    Rejected(String),
    /// An outside dependency the handler calls (a mail API, a payment provider) is down for a
    /// while: the transaction is rolled back and the batch retried with backoff, the partition
    /// waits, nothing is dead-lettered however long it lasts, and processing resumes by itself
    /// once it answers.
    #[error("dependency unavailable: {0}")]
    Unavailable(String),
    /// The database failed: the batch is retried.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A consumer group's business logic.
pub trait Handler: Send + Sync + 'static {
    /// The group's id: its Kafka consumer group id, also its dedupe scope.
    fn group(&self) -> &str;

    /// Starts the handler's part of one transaction.
    fn transaction(&self) -> Box<dyn HandlerTransaction + '_>;
}

/// The handler's part of one transaction: the effects of the transaction's events, written
/// inside the transaction that records them processed, so they commit exactly once or not at all.
/// A transaction applies one partition's batch or, shared, the batches of several partitions.
/// Effects are decided event by event, in order, and written together by
/// [`HandlerTransaction::flush`]: a transaction costs a few set-based statements, not a few per
/// event.
pub trait HandlerTransaction: Send {
    /// Called once, before any `apply`, with the events the transaction is about to apply: reads
    /// (and locks, in a fixed order, so concurrent transactions cannot deadlock) what they need.
    /// Does nothing unless implemented.
    fn prepare<'a>(
        &'a mut self,
        _conn: &'a mut PgConnection,
        _events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }

    /// Decides one event's effects. `Rejected` must leave no trace: the transaction's view stays
    /// as it was before the call. May read what `prepare` did not (events unparked).
    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;

    /// Writes every effect decided so far; called once, as the transaction's last statement
    /// before commit, so locks it takes on rows other transactions share are held only that long.
    /// Does nothing unless implemented (for a handler whose `apply` writes as it goes).
    fn flush<'a>(
        &'a mut self,
        _conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }
}
