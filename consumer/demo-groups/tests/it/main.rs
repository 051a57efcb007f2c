//! The demonstration groups' integration tests, on a real PostgreSQL and Kafka.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod apply;
mod common;
mod dead_letters;
mod export_topic;
mod exports;
mod operator_dead_letters;
mod operator_groups;
mod operator_outbox;
mod operator_reprocess;
mod rate_limits;
mod runbooks;
mod settings;
