//! What the order service, the relay and the consumers share.

pub mod crash_point;
pub mod db;
pub mod envelope;
pub mod export_events;
pub mod kafka;
pub mod ops_http;
pub mod order_events;
pub mod overlap;
pub mod record;
pub mod telemetry;
