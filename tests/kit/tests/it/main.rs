//! The pipeline's binaries end to end, on a real PostgreSQL and Kafka.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod bad_input;
mod console;
mod database_url;
mod delayed_events;
mod end_to_end;
mod exports;
mod fenced_partition;
mod group_pause;
mod hostile_http;
mod hostile_records;
mod prometheus;
mod rate_limits;
mod schedules;
mod secure_transport;
mod topics;
mod tracing;
