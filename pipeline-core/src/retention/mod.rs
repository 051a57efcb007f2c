//! Retention: old rows removed in bounded steps so that tables stay flat however long the
//! pipeline runs.
//!
//! Each table that grows has a [`Rule`]: how long its rows are kept (its [`Window`], at least
//! its floor) and one SQL step that removes, past a cursor, at most a batch of rows older than
//! the cutoff, keeping every row something still needs. A [`Runner`] applies a database's rules
//! one step at a time, each step a short transaction of its own under a transaction-scoped
//! advisory lock, so one runner works on a set of tables at a time and no statement holds locks
//! for long, and it pauses after each step in proportion to the step's time, removes at most a
//! bounded multiple of what the table gains ([`pace`]), and waits while the pipeline it runs
//! beside is behind ([`Backlog`]). The owners of the tables define their rules (the relay's for the outbox's tables,
//! the consumer runtime's for the groups'); the operator command runs the same rules by hand.
//!
//! A table in time partitions ([`TimePartitions`]) sheds whole partitions instead: its rule's
//! steps then only go over the rows kept past their partition.
//!
//! Layout: [`window`] (durations and their floors), [`rule`] (what a rule is and the SQL it runs),
//! [`partitions`] (tables partitioned by time),
//! [`runner`] (steps, runs, the loop), [`pace`] (removal bounded by the insert rate), [`backlog`] (the signal a runner yields to), [`state`] (what the runners record per table in
//! `retention_state`, read by `pipeline retention status`), [`metrics`].

pub mod backlog;
pub mod metrics;
pub mod pace;
pub mod partitions;
pub mod rule;
pub mod runner;
pub mod state;
pub mod window;

pub use backlog::Backlog;
pub use metrics::RetentionMetrics;
pub use partitions::TimePartitions;
pub use rule::{Rule, Step};
pub use runner::{Report, Runner, TableReport};
pub use window::{BelowFloor, Window};
