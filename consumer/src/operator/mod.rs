//! What the operator command (`pipeline`, consumer/operator) needs from the consumer library:
//! resolving a group's dead letters with its handler ([`dead_letters`]: replay, skip, discard).

pub mod dead_letters;
