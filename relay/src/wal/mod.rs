//! The outbox's events from PostgreSQL's write-ahead log: a logical replication slot streams the
//! inserts of the `outbox_events` publication (`pgoutput`), so nothing polls and nothing is
//! written back for an event to be read. [`stream`] is the relay's loop in `--source wal`;
//! [`reader`] holds the session on the slot; [`pgoutput`] reads its messages; [`source`] keeps
//! what the database knows of the stream (whether writers queue, and the horizon).

pub mod pgoutput;
mod queued;
pub mod reader;
pub mod source;
pub mod stream;
