//! Command line of the `relay` binary; every flag also reads an environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pipeline_core::db::DbArgs;
use pipeline_core::kafka::KafkaArgs;
use pipeline_core::telemetry::LogArgs;

use crate::backoff::RetryPolicy;
use crate::lease::LeaseSettings;
use crate::publish::ProducerSettings;

/// Publishes outbox events to Kafka.
#[derive(Debug, Parser)]
#[command(name = "relay", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tail the outbox and publish to Kafka (one active relay per database; others stand by).
    Run(Box<RunArgs>),
    /// Create Kafka topics that do not exist yet.
    EnsureTopics {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// Topic to create, repeatable.
        #[arg(long = "topic", env = "TOPICS", value_delimiter = ',', required = true)]
        topics: Vec<String>,
        /// Partitions of each new topic.
        #[arg(long, env = "TOPIC_PARTITIONS", default_value_t = 12)]
        partitions: i32,
    },
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Address of the /metrics, /healthz and /readyz endpoint (port 0 picks one).
    #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9101")]
    pub metrics_listen: SocketAddr,
    /// Most events claimed and published per batch.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 5000)]
    pub batch_size: i64,
    /// Batches on their way to Kafka at once: the next batch is claimed while earlier ones are
    /// produced and marked. An aggregate is in at most one of them, so its events keep their
    /// order. 1: claim, publish and mark one batch at a time.
    #[arg(long, env = "RELAY_PIPELINE_DEPTH", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub pipeline_depth: u32,
    /// Pause between claims when the outbox has nothing due, in milliseconds.
    #[arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 5)]
    pub poll_interval_ms: u64,
    /// How often the relay vacuums its queue table (`outbox_unpublished`), in milliseconds; 0
    /// leaves it to autovacuum. Every publish deletes rows from it, and the claim reads it
    /// whole, so dead rows waiting for autovacuum's next visit (once a minute by default) would
    /// be read by every claim. Needs the table's owner; otherwise PostgreSQL skips it with a
    /// warning.
    #[arg(long, env = "RELAY_QUEUE_VACUUM_INTERVAL_MS", default_value_t = 1000)]
    pub queue_vacuum_interval_ms: u64,
    /// How often the active relay moves delayed events that fell due into the outbox, in
    /// milliseconds: a delayed event is published at most about this long after its time.
    #[arg(long, env = "RELAY_SCHEDULE_INTERVAL_MS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub schedule_interval_ms: u64,
    /// Most delayed events moved into the outbox in one statement.
    #[arg(long, env = "RELAY_SCHEDULE_BATCH_SIZE", default_value_t = 5000,
          value_parser = clap::value_parser!(i64).range(1..))]
    pub schedule_batch_size: i64,
    /// Also wake on PostgreSQL NOTIFY (sent by services that enable it).
    #[arg(long, env = "RELAY_LISTEN", default_value_t = true, action = clap::ArgAction::Set)]
    pub listen: bool,
    /// Key of the lease row that elects the one active relay among relays sharing it.
    #[arg(long, env = "RELAY_LOCK_KEY", default_value_t = 0x6f75_7462_6f78)]
    pub lock_key: i64,
    /// How often a standby relay tries to take over, in milliseconds.
    #[arg(long, env = "RELAY_STANDBY_RETRY_MS", default_value_t = 500)]
    pub standby_retry_ms: u64,
    /// How long the active relay's lease lasts without renewal, in milliseconds (renewed every
    /// third of it). A relay that dies is replaced within --standby-retry-ms; one that is frozen
    /// or cut off from PostgreSQL within this plus --standby-retry-ms (6.5 s by default).
    #[arg(long, env = "RELAY_LEASE_TTL_MS", default_value_t = 6_000,
          value_parser = clap::value_parser!(u64).range(1_500..=600_000))]
    pub lease_ttl_ms: u64,
    /// librdkafka `message.timeout.ms`: how long one delivery may take before it counts as failed.
    #[arg(long, env = "RELAY_DELIVERY_TIMEOUT_MS", default_value_t = 30_000)]
    pub delivery_timeout_ms: u64,
    /// librdkafka `linger.ms`. The relay hands librdkafka a whole claimed batch at once, so a
    /// long linger only delays the batch's last request (measured: 1 ms drained fastest).
    #[arg(long, env = "RELAY_LINGER_MS", default_value_t = 1)]
    pub linger_ms: u64,
    /// librdkafka `compression.type` (none, lz4, zstd, snappy, gzip).
    #[arg(long, env = "RELAY_COMPRESSION", default_value = "none")]
    pub compression: String,
    /// librdkafka statistics interval in milliseconds (client metrics); 0 turns them off.
    #[arg(long, env = "KAFKA_STATISTICS_INTERVAL_MS", default_value_t = 5_000)]
    pub statistics_interval_ms: u64,
    /// Delay after the first failed attempt, in milliseconds (doubles each attempt).
    #[arg(long, env = "RELAY_RETRY_BASE_MS", default_value_t = 200)]
    pub retry_base_ms: u64,
    /// Longest delay of the exponential phase, in milliseconds.
    #[arg(long, env = "RELAY_RETRY_MAX_MS", default_value_t = 30_000)]
    pub retry_max_ms: u64,
    /// Attempts after which retries slow down to --slow-retry-interval-ms.
    #[arg(long, env = "RELAY_SLOW_RETRY_AFTER", default_value_t = 20)]
    pub slow_retry_after: i32,
    /// Delay between retries past --slow-retry-after, in milliseconds.
    #[arg(long, env = "RELAY_SLOW_RETRY_INTERVAL_MS", default_value_t = 300_000)]
    pub slow_retry_interval_ms: u64,
    /// Attempts allowed for permanent errors (message too large, unknown topic…) before the event
    /// is marked failed; it then holds its order's later events until an operator acts.
    #[arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: i32,
}

impl RunArgs {
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(self.retry_base_ms),
            max: Duration::from_millis(self.retry_max_ms),
            slow_after: self.slow_retry_after,
            slow_interval: Duration::from_millis(self.slow_retry_interval_ms),
            permanent_attempts: self.max_attempts,
        }
    }

    pub fn lease_settings(&self) -> LeaseSettings {
        LeaseSettings {
            key: self.lock_key,
            ttl: Duration::from_millis(self.lease_ttl_ms),
            retry_every: Duration::from_millis(self.standby_retry_ms),
        }
    }

    pub fn producer_settings(&self) -> ProducerSettings {
        ProducerSettings {
            delivery_timeout: Duration::from_millis(self.delivery_timeout_ms),
            linger: Duration::from_millis(self.linger_ms),
            compression: self.compression.clone(),
            statistics_interval: Duration::from_millis(self.statistics_interval_ms),
        }
    }

    /// Refuses settings that cannot work.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.batch_size > 0, "--batch-size must be positive");
        anyhow::ensure!(self.max_attempts > 0, "--max-attempts must be positive");
        anyhow::ensure!(
            self.standby_retry_ms > 0 && self.standby_retry_ms <= self.lease_ttl_ms,
            "--standby-retry-ms must be positive and at most --lease-ttl-ms"
        );
        anyhow::ensure!(
            self.delivery_timeout_ms >= 1000,
            "--delivery-timeout-ms below 1000 leaves librdkafka no room to retry"
        );
        anyhow::ensure!(
            self.delivery_timeout_ms > self.linger_ms,
            "--delivery-timeout-ms must exceed --linger-ms, or every message times out while lingering"
        );
        anyhow::ensure!(
            self.retry_base_ms > 0 && self.retry_base_ms <= self.retry_max_ms,
            "--retry-base-ms must be positive and at most --retry-max-ms"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// With the default settings an event Kafka refuses for good (message too large, invalid
    /// topic…) is marked failed, and its order reported held, within seconds.
    #[test]
    fn a_permanent_error_gives_up_within_seconds_by_default() {
        let cli = Cli::try_parse_from(["relay", "run"]).expect("the defaults parse");
        let Command::Run(args) = cli.command else {
            panic!("not the run command");
        };
        let retry = args.retry_policy();
        assert!(retry.gives_up(args.max_attempts, true));
        assert!(!retry.gives_up(args.max_attempts - 1, true));
        let waits: Duration = (1..args.max_attempts).map(|a| retry.delay(a)).sum();
        assert!(waits <= Duration::from_secs(4), "{waits:?}");
    }
}
