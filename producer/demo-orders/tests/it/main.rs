//! The order service's integration tests, on a real PostgreSQL.
//!
//! One test binary (`cargo test --test it`): each file beside this one is a module of it, so the
//! crate's dependencies are compiled into one executable, not one for each file.

mod api_bad_input;
mod api_bodies;
mod api_exports;
mod api_idempotency;
mod api_lifecycle;
mod api_nul_characters;
mod binary;
mod common;
mod outbox;
mod shared_transactions;
