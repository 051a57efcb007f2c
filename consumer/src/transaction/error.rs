//! How a batch can fail, sorted by what the partition's task should do about it.

use rdkafka::error::KafkaError;

use crate::handlers::HandlerError;

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// A dependency is down (database connection lost, broker unreachable for dead letters):
    /// the partition waits and retries for as long as it takes.
    #[error("dependency unavailable: {0}")]
    Unavailable(String),
    /// The database answered but the transaction failed (deadlock, serialisation, a statement
    /// error): retried within the retry budget, then the offending message is isolated.
    #[error("transient database error: {0}")]
    Transient(#[source] sqlx::Error),
    /// The database refuses the work itself (missing table, permission): retrying cannot help.
    #[error("fatal database error: {0}")]
    Fatal(#[source] sqlx::Error),
    /// This consumer no longer owns the partition: it must apply nothing more.
    #[error("partition no longer owned by this consumer")]
    Fenced,
}

impl From<sqlx::Error> for ProcessError {
    fn from(e: sqlx::Error) -> Self {
        if is_missing_partition(&e) {
            // The effect history has no partition for the time now yet: the consumers create
            // them ahead (see `crate::retention::ensure_partitions`); wait for it.
            ProcessError::Unavailable(format!("{e}; waiting for the partition to be created"))
        } else if is_fatal(&e) {
            ProcessError::Fatal(e)
        } else if is_unavailable(&e) {
            ProcessError::Unavailable(e.to_string())
        } else {
            ProcessError::Transient(e)
        }
    }
}

impl From<KafkaError> for ProcessError {
    fn from(e: KafkaError) -> Self {
        ProcessError::Unavailable(format!("dead-letter topic: {e}"))
    }
}

impl From<HandlerError> for ProcessError {
    fn from(e: HandlerError) -> Self {
        match e {
            HandlerError::Database(e) => e.into(),
            HandlerError::Unavailable(reason) => ProcessError::Unavailable(reason),
            // Callers turn rejections into dead letters before they get here.
            HandlerError::Rejected(reason) => ProcessError::Fatal(sqlx::Error::Protocol(format!(
                "unhandled rejection: {reason}"
            ))),
        }
    }
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// A row for which a partitioned table has no partition (check violation, raised by the
/// table's routing rather than a constraint).
pub(crate) fn is_missing_partition(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().as_deref() == Some("23514")
                && db.message().starts_with("no partition of relation")
        }
        _ => false,
    }
}

/// SQLSTATE classes no retry can fix: syntax or undefined objects (42), invalid authorisation
/// (28), invalid catalog (3D), feature not supported (0A).
fn is_fatal(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Configuration(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::TypeNotFound { .. } => true,
        _ => sqlstate(e)
            .map(|c| {
                ["42", "28", "3D", "0A"]
                    .iter()
                    .any(|class| c.starts_with(class))
            })
            .unwrap_or(false),
    }
}

/// Lost or refused connections: connection exceptions (08), server shutting down or starting
/// (57P01, 57P02, 57P03), out of resources (53), and client-side I/O or pool errors.
fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        _ => sqlstate(e)
            .map(|c| c.starts_with("08") || c.starts_with("53") || c.starts_with("57P"))
            .unwrap_or(false),
    }
}

/// Data exceptions (22), integrity violations (23) and a value past a limit of the database's
/// (54000, a value too large for an index entry, say) raised while applying one event are about
/// that event: it is dead-lettered rather than retried.
pub(crate) fn is_rejection(e: &sqlx::Error) -> bool {
    !is_missing_partition(e)
        && sqlstate(e)
            .map(|c| c.starts_with("22") || c.starts_with("23") || c == "54000")
            .unwrap_or(false)
}
