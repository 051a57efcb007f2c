//! Bad input: the operator asked for something that does not exist or cannot be done. The
//! command says why and exits with status 2; anything else (a database or broker that does not
//! answer) exits with 1.

/// What the operator asked that cannot be done.
#[derive(Debug, thiserror::Error)]
pub enum BadInput {
    /// No actor from the flag or the environment.
    #[error("say who acts: --actor, $PIPELINE_ACTOR or $USER")]
    NoActor,
    /// An id the databases do not know.
    #[error("no {what} {id}")]
    NotFound {
        /// What was looked up (order, event, dead letter, …).
        what: &'static str,
        /// The id given.
        id: String,
    },
    /// A group name that is not known: not registered by the program, without rows in its
    /// database and (where asked) unknown to Kafka; or a replay for a group with no handler.
    #[error("unknown consumer group {0}: {1}")]
    UnknownGroup(String, String),
    /// A group outside those `--group` names, which are the scope of what is read and done.
    #[error("group {0} is outside this command's groups (--group)")]
    OutOfScope(String),
    /// A requeue of an event that is not failed.
    #[error("event {event_id} is {state}, not failed: only failed events can be requeued")]
    NotFailed {
        /// The event.
        event_id: uuid::Uuid,
        /// Its state.
        state: String,
    },
    /// Filters that match nothing to act on.
    #[error("nothing matches: {0}")]
    NothingMatches(String),
    /// A changing action without any filter.
    #[error("{0}: give a filter (--id, --aggregate, --reason, --since, --until) or --all")]
    NoFilter(&'static str),
    /// Anything else the operator must change in the request.
    #[error("{0}")]
    Refused(String),
}

/// The exit status for `error`: 2 for bad input, 1 otherwise.
pub fn exit_code(error: &anyhow::Error) -> u8 {
    if error
        .chain()
        .any(|c| c.downcast_ref::<BadInput>().is_some())
    {
        2
    } else {
        1
    }
}
