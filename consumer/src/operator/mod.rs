//! What the operator command (`pipeline`, consumer/operator) needs from the consumer library:
//! resolving a group's dead letters with its handler ([`dead_letters`]: replay, skip, discard),
//! publishing the letters that raises ([`DeadLetterSink`]), a group's pause ([`pause_state`],
//! [`PausedSince`]) and its members and lag as Kafka reports them ([`read_group`]).

pub mod dead_letters;

pub use crate::kafka::{read_group, GroupSnapshot};
pub use crate::pause::{read as pause_state, PausedSince};
pub use crate::transaction::DeadLetterSink;
