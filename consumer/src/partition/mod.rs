//! The partition task: one per assigned partition. It takes the partition's messages in order,
//! hands them as batches to the batch transaction (alone, or through the group's shared
//! transactions), retries what failed, and reports the offset to commit only after each batch's
//! transaction has committed.

mod context;
mod task;

pub use context::{FatalSignal, FinishedOffset, TaskContext};
pub use task::PartitionTask;
