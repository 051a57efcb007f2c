//! What a transaction decides as it goes: the handler's effects of one event, and the
//! transaction's working state (progress per aggregate, effects and dead letters to write). Read by
//! the transaction of batches, the release of parked events and the resolution of dead letters.

use std::collections::{HashMap, HashSet};

use sqlx::{Postgres, Transaction};

use super::dead_letter::DeadLetter;
use super::error::{is_rejection, ProcessError};
use super::store::AppliedEffect;
use crate::handlers::{Event, HandlerError, HandlerTransaction};

/// What a transaction has learned so far about the aggregates it touches.
#[derive(Default)]
pub(crate) struct TransactionState {
    /// Last applied sequence per aggregate, as read at the start and advanced since.
    pub(crate) progress: HashMap<String, i64>,
    /// Aggregates whose last applied sequence this transaction moved, with the new value.
    pub(crate) advanced: HashMap<String, i64>,
    /// Orders with parked events.
    pub(crate) parked_aggregates: HashSet<String>,
    /// The group's progress horizon (see `progress_horizon`): an aggregate without progress may have
    /// been forgotten if its events occurred before it.
    pub(crate) horizon: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) effects: Vec<AppliedEffect>,
    /// Dead letters recorded so far, to publish before commit.
    pub(crate) letters: Vec<DeadLetter>,
}

/// Decides one event's effects; a rejection (the handler's, or a data or constraint error the
/// database raised about this event) is returned as the dead-letter reason.
pub(crate) async fn apply_one(
    tx: &mut Transaction<'_, Postgres>,
    effects: &mut dyn HandlerTransaction,
    event: &Event,
) -> Result<Result<(), String>, ProcessError> {
    match effects.apply(tx, event).await {
        Ok(()) => Ok(Ok(())),
        Err(HandlerError::Rejected(reason)) => Ok(Err(reason)),
        Err(HandlerError::Database(e)) if is_rejection(&e) => {
            Ok(Err(format!("rejected by the database: {e}")))
        }
        Err(e @ (HandlerError::Database(_) | HandlerError::Unavailable(_))) => Err(e.into()),
    }
}
