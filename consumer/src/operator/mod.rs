//! What the operator command (`pipeline`, in consumer/operator) needs from the consumer library:
//! resolving a group's dead letters with its handler ([`dead_letters`]: replay, skip, discard);
//! and `consumer report`, the run's summary of what the pipeline did ([`report`]).

pub mod dead_letters;
pub mod report;
