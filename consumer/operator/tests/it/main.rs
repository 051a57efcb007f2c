//! The operator library's integration tests, on a real PostgreSQL.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod group_pause;
mod known_groups;
mod retention;
mod schedules;
mod wal_status;
