//! Why a relay could not start, or had to stop: what [`crate::run`] returns, for a host to
//! branch on.

use rdkafka::error::KafkaError;

use crate::settings::InvalidSettings;

/// Why a relay could not start, or had to stop; the cause is its `source()` (anyhow's `{:#}`
/// prints the whole chain). Failures it can wait out (the database or the
/// brokers unreachable for a while, a batch refused, the lease lost) are not errors: it retries,
/// stands by or takes over again by itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The settings do not make a working relay: fix them.
    #[error(transparent)]
    InvalidSettings(#[from] InvalidSettings),
    /// Its metrics could not be registered: the registry already has metrics of these names
    /// (one relay per registry).
    #[error("registering the relay's metrics")]
    Metrics(#[from] prometheus::Error),
    /// The Kafka producer could not be created, at start or to replace one that failed for
    /// good (librdkafka refused its configuration: `--kafka-option`, say).
    #[error("creating the Kafka producer")]
    Producer(#[from] KafkaError),
    /// The connection that listens for new events could not be opened.
    #[error("opening the connection that listens for new events")]
    Listen(#[source] sqlx::Error),
    /// With `--source wal` the relay's role must see when every session's transaction began
    /// (superuser, or `GRANT pg_read_all_stats TO` the role): what it has published is known
    /// from that.
    #[error(
        "--source wal needs the relay's database role to see every session's transaction \
         (superuser, or GRANT pg_read_all_stats TO the role)"
    )]
    WalPrivileges,
}
