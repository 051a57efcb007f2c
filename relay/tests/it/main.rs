//! The relay's integration tests, on a real PostgreSQL and Kafka.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod claim;
mod common;
mod fatal;
mod lease;
mod publish;
mod release;
mod retention;
mod schedules;
mod vacuum;
mod wakeup;
mod wal;
mod wal_relay;
