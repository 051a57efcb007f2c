//! The consumer runtime's integration tests, on a real PostgreSQL and Kafka.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod common;
mod hostile_records;
mod migrations;
mod outside_dependency;
mod partitions;
mod plans;
mod rate_limit;
mod retention;
