//! Operator commands: `consumer dead-letters` lists a group's dead letters and replays or
//! discards one ([`dead_letters`]); `consumer report` prints what the pipeline did ([`report`]).

pub mod dead_letters;
pub mod report;
