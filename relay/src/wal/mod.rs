//! The outbox's events from PostgreSQL's write-ahead log: a logical replication slot streams the
//! inserts of the `outbox_events` publication (`pgoutput`), so nothing polls and nothing is
//! written back for an event to be read. [`reader`] holds the session on the slot; [`pgoutput`]
//! reads its messages.

pub mod pgoutput;
pub mod reader;
