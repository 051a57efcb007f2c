//! The batch transaction: a partition's batch of messages (or the batches of several partitions
//! of one group, in a shared transaction) applied in one database transaction. For every message
//! it inserts the group's dedupe row (`processed_message`) and, only when that row is new,
//! applies the handler's effects, in the sequence of the message's order; events ahead of their
//! predecessor are parked, messages that cannot be applied are dead-lettered. One statement opens
//! the transaction (ownership fence, dedupe rows, the aggregates' progress) and one records what it
//! applied.
//!
//! Its parts, lowest first: `message` (what a batch works on and reports) and `error` (how it
//! fails); `store` (the transaction's statements) and `dead_letter`; `effects` (a transaction's
//! working state); `sequence` (apply, park, release in order); `apply` (the transaction);
//! `shared` (shared transactions).

mod apply;
pub mod dead_letter;
mod effects;
mod error;
mod message;
mod sequence;
mod shared;
mod store;

pub use apply::{
    dead_letter_alone, process_batch, process_batch_with, process_batches, PartitionBatch,
    TransactionContext,
};
pub use dead_letter::{DeadLetter, DeadLetterSink};
pub(crate) use effects::{apply_one, TransactionState};
pub use error::ProcessError;
pub use message::{BatchReport, Fence, InboundMessage, Outcome, RecordHeaders};
pub(crate) use sequence::unpark;
pub use sequence::{decide, Decision};
pub use shared::{SharedResult, SharedTransactionSettings, SharedTransactions};
pub use store::{claim_partition, CUSTOM_PLANS_UP_TO};
pub(crate) use store::{record_applied, set_outcomes, AppliedEffect, OutcomeChange};
