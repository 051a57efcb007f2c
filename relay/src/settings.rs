//! The relay's settings: a plain struct a program fills in (its `Default` is the recommended
//! configuration), and the database sessions they call for.
//!
//! With the non-default `cli` feature the struct is also a set of `clap` arguments, each flag
//! reading an environment variable as well; the `relay` binary maps its command line onto it.

use std::time::Duration;

use anyhow::Context;
use pipeline_core::db::DbArgs;
use pipeline_core::kafka::KafkaArgs;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;

use crate::backoff::RetryPolicy;
use crate::lease::LeaseSettings;
use crate::publish::ProducerSettings;
use crate::retention::RetentionSettings;

/// The lease key of [`RelaySettings::default`] (`outbox` in ASCII).
pub const DEFAULT_LOCK_KEY: i64 = 0x6f75_7462_6f78;

/// What the relay does and how fast: Kafka, batches, lease, retries.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct RelaySettings {
    /// The Kafka cluster and the client's options.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub kafka: KafkaArgs,
    /// Most events claimed and published per batch.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 5000)
    )]
    pub batch_size: i64,
    /// Batches on their way to Kafka at once: the next batch is claimed while earlier ones are
    /// produced and marked. An aggregate is in at most one of them, so its events keep their
    /// order. 1: claim, publish and mark one batch at a time.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_PIPELINE_DEPTH", default_value_t = 4,
            value_parser = clap::value_parser!(u32).range(1..=16))
    )]
    pub pipeline_depth: u32,
    /// Pause between claims when the outbox has nothing due and the relay does not listen
    /// (`--listen false`, or its LISTEN session is down), in milliseconds; also the pause before
    /// its second look when it starts listening.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 5)
    )]
    pub poll_interval_ms: u64,
    /// While the relay listens, how often it claims anyway, in milliseconds: the bound on how
    /// late an event is published when no insert announced it (a retry falling due, a requeue,
    /// a wake-up lost while the relay stopped listening).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LISTEN_POLL_INTERVAL_MS", default_value_t = 1000,
            value_parser = clap::value_parser!(u64).range(1..))
    )]
    pub listen_poll_interval_ms: u64,
    /// How often the relay vacuums its queue table (`outbox_unpublished`), in milliseconds; 0
    /// leaves it to autovacuum. Every publish deletes rows from it, and the claim reads it
    /// whole, so dead rows waiting for autovacuum's next visit (once a minute by default) would
    /// be read by every claim. Needs the table's owner; otherwise PostgreSQL skips it with a
    /// warning.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_QUEUE_VACUUM_INTERVAL_MS", default_value_t = 1000)
    )]
    pub queue_vacuum_interval_ms: u64,
    /// How often the active relay releases delayed events that fell due into the outbox, in
    /// milliseconds: a delayed event is published at most about this long after its time (a
    /// recurring schedule's occurrence at most about twice this long, the first after the
    /// schedule was made or changed).
    #[cfg_attr(
        feature = "cli",
        arg(long = "release-interval-ms", env = "RELAY_RELEASE_INTERVAL_MS",
            value_name = "RELEASE_INTERVAL_MS", default_value_t = 1000,
            value_parser = clap::value_parser!(u64).range(1..))
    )]
    pub release_interval_ms: u64,
    /// Most delayed events released into the outbox in one statement.
    #[cfg_attr(
        feature = "cli",
        arg(long = "release-batch-size", env = "RELAY_RELEASE_BATCH_SIZE",
            value_name = "RELEASE_BATCH_SIZE", default_value_t = 5000,
            value_parser = clap::value_parser!(i64).range(1..))
    )]
    pub release_batch_size: i64,
    /// Wait for new events on PostgreSQL's LISTEN (the outbox's insert trigger notifies while
    /// the relay waits) instead of polling every --poll-interval-ms.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LISTEN", default_value_t = true, action = clap::ArgAction::Set)
    )]
    pub listen: bool,
    /// Key of the lease row that elects the one active relay among relays sharing it.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LOCK_KEY", default_value_t = DEFAULT_LOCK_KEY)
    )]
    pub lock_key: i64,
    /// How often a standby relay tries to take over, in milliseconds.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_STANDBY_RETRY_MS", default_value_t = 500)
    )]
    pub standby_retry_ms: u64,
    /// How long the active relay's lease lasts without renewal, in milliseconds (renewed every
    /// third of it). A relay that dies is replaced within --standby-retry-ms; one that is frozen
    /// or cut off from PostgreSQL within this plus --standby-retry-ms (6.5 s by default).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LEASE_TTL_MS", default_value_t = 6_000,
            value_parser = clap::value_parser!(u64).range(1_500..=600_000))
    )]
    pub lease_ttl_ms: u64,
    /// librdkafka `message.timeout.ms`: how long one delivery may take before it counts as failed.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_DELIVERY_TIMEOUT_MS", default_value_t = 30_000)
    )]
    pub delivery_timeout_ms: u64,
    /// librdkafka `linger.ms`. The relay hands librdkafka a whole claimed batch at once, so a
    /// long linger only delays the batch's last request.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LINGER_MS", default_value_t = 1)
    )]
    pub linger_ms: u64,
    /// librdkafka `compression.type` (none, lz4, zstd, snappy, gzip).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_COMPRESSION", default_value = "none")
    )]
    pub compression: String,
    /// librdkafka statistics interval in milliseconds (client metrics); 0 turns them off.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KAFKA_STATISTICS_INTERVAL_MS", default_value_t = 5_000)
    )]
    pub statistics_interval_ms: u64,
    /// Delay after the first failed attempt, in milliseconds (doubles each attempt).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_RETRY_BASE_MS", default_value_t = 200)
    )]
    pub retry_base_ms: u64,
    /// Longest delay of the exponential phase, in milliseconds.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_RETRY_MAX_MS", default_value_t = 30_000)
    )]
    pub retry_max_ms: u64,
    /// Attempts after which retries slow down to --slow-retry-interval-ms.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_SLOW_RETRY_AFTER", default_value_t = 20)
    )]
    pub slow_retry_after: i32,
    /// Delay between retries past --slow-retry-after, in milliseconds.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_SLOW_RETRY_INTERVAL_MS", default_value_t = 300_000)
    )]
    pub slow_retry_interval_ms: u64,
    /// Attempts allowed for permanent errors (message too large, unknown topic…) before the event
    /// is marked failed; it then holds its aggregate's later events until an operator acts.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 5)
    )]
    pub max_attempts: i32,
    /// Retention of published events and operator actions.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub retention: RetentionSettings,
}

impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            kafka: KafkaArgs::default(),
            batch_size: 5000,
            pipeline_depth: 4,
            poll_interval_ms: 5,
            listen_poll_interval_ms: 1000,
            queue_vacuum_interval_ms: 1000,
            release_interval_ms: 1000,
            release_batch_size: 5000,
            listen: true,
            lock_key: DEFAULT_LOCK_KEY,
            standby_retry_ms: 500,
            lease_ttl_ms: 6_000,
            delivery_timeout_ms: 30_000,
            linger_ms: 1,
            compression: "none".to_owned(),
            statistics_interval_ms: 5_000,
            retry_base_ms: 200,
            retry_max_ms: 30_000,
            slow_retry_after: 20,
            slow_retry_interval_ms: 300_000,
            max_attempts: 5,
            retention: RetentionSettings::default(),
        }
    }
}

/// Settings the relay cannot work with; the message names the setting and its flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid relay settings: {0}")]
pub struct InvalidSettings(pub String);

impl RelaySettings {
    /// How failed publish attempts are retried.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(self.retry_base_ms),
            max: Duration::from_millis(self.retry_max_ms),
            slow_after: self.slow_retry_after,
            slow_interval: Duration::from_millis(self.slow_retry_interval_ms),
            permanent_attempts: self.max_attempts,
        }
    }

    /// How the lease is held and taken over.
    pub fn lease_settings(&self) -> LeaseSettings {
        LeaseSettings {
            key: self.lock_key,
            ttl: Duration::from_millis(self.lease_ttl_ms),
            retry_every: Duration::from_millis(self.standby_retry_ms),
        }
    }

    /// The Kafka producer's settings.
    pub fn producer_settings(&self) -> ProducerSettings {
        ProducerSettings {
            delivery_timeout: Duration::from_millis(self.delivery_timeout_ms),
            linger: Duration::from_millis(self.linger_ms),
            compression: self.compression.clone(),
            statistics_interval: Duration::from_millis(self.statistics_interval_ms),
        }
    }

    /// Refuses settings that cannot work.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        fn ensure(ok: bool, message: &str) -> Result<(), InvalidSettings> {
            if ok {
                Ok(())
            } else {
                Err(InvalidSettings(message.to_owned()))
            }
        }
        ensure(
            self.batch_size > 0,
            "batch_size (--batch-size) must be positive",
        )?;
        ensure(
            (1..=16).contains(&self.pipeline_depth),
            "pipeline_depth (--pipeline-depth) must be from 1 to 16",
        )?;
        ensure(
            self.listen_poll_interval_ms > 0,
            "listen_poll_interval_ms (--listen-poll-interval-ms) must be positive",
        )?;
        ensure(
            self.release_interval_ms > 0,
            "release_interval_ms (--release-interval-ms) must be positive",
        )?;
        ensure(
            self.release_batch_size > 0,
            "release_batch_size (--release-batch-size) must be positive",
        )?;
        ensure(
            (1_500..=600_000).contains(&self.lease_ttl_ms),
            "lease_ttl_ms (--lease-ttl-ms) must be from 1500 to 600000",
        )?;
        ensure(
            self.max_attempts > 0,
            "max_attempts (--max-attempts) must be positive",
        )?;
        ensure(
            self.standby_retry_ms > 0 && self.standby_retry_ms <= self.lease_ttl_ms,
            "standby_retry_ms (--standby-retry-ms) must be positive and at most lease_ttl_ms \
             (--lease-ttl-ms)",
        )?;
        ensure(
            self.delivery_timeout_ms >= 1000,
            "delivery_timeout_ms (--delivery-timeout-ms) below 1000 leaves librdkafka no room to \
             retry",
        )?;
        ensure(
            self.delivery_timeout_ms > self.linger_ms,
            "delivery_timeout_ms (--delivery-timeout-ms) must exceed linger_ms (--linger-ms), or \
             every message times out while lingering",
        )?;
        ensure(
            self.retry_base_ms > 0 && self.retry_base_ms <= self.retry_max_ms,
            "retry_base_ms (--retry-base-ms) must be positive and at most retry_max_ms \
             (--retry-max-ms)",
        )?;
        ensure(
            self.retention.batch_size > 0,
            "retention.batch_size (--retention-batch-size) must be positive",
        )?;
        self.retention
            .validate()
            .map_err(|e| InvalidSettings(e.to_string()))
    }
}

/// `options` with the session settings the relay's pool needs.
///
/// A relay frozen inside a transaction (one holding its lease row FOR KEY SHARE) must not keep a
/// standby from taking the lease over: the server ends such a transaction, as it ends the lease
/// sessions' own, after one lease operation's timeout (`idle_in_transaction_session_timeout`).
pub fn session_options(options: PgConnectOptions, settings: &RelaySettings) -> PgConnectOptions {
    let idle = settings
        .lease_settings()
        .op_timeout()
        .as_millis()
        .to_string();
    options.options([("idle_in_transaction_session_timeout", idle.as_str())])
}

/// A pool for the relay: `db`'s URL and size, with [`session_options`]. Applies no migrations
/// (see [`crate::MIGRATOR`]).
pub async fn connect(db: &DbArgs, settings: &RelaySettings) -> anyhow::Result<PgPool> {
    let options = session_options(db.connect_options()?, settings);
    db.connect_pool(options, &[])
        .await
        .context("connecting the relay's pool")
}

#[cfg(test)]
mod tests {
    use pipeline_core::retention::Window;

    use super::*;

    /// With the default settings an event Kafka refuses for good (message too large, invalid
    /// topic…) is marked failed, and its aggregate's later events reported held, within seconds.
    #[test]
    fn a_permanent_error_gives_up_within_seconds_by_default() {
        let settings = RelaySettings::default();
        settings.validate().expect("the defaults are valid");
        let retry = settings.retry_policy();
        assert!(retry.gives_up(settings.max_attempts, true));
        assert!(!retry.gives_up(settings.max_attempts - 1, true));
        let waits: Duration = (1..settings.max_attempts).map(|a| retry.delay(a)).sum();
        assert!(waits <= Duration::from_secs(4), "{waits:?}");
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        let refused = |change: fn(&mut RelaySettings)| {
            let mut s = RelaySettings::default();
            change(&mut s);
            s.validate().expect_err("refused")
        };
        assert!(refused(|s| s.batch_size = 0).0.contains("--batch-size"));
        assert!(refused(|s| s.pipeline_depth = 17)
            .0
            .contains("--pipeline-depth"));
        assert!(refused(|s| s.release_batch_size = 0)
            .0
            .contains("--release-batch-size"));
        assert!(refused(|s| s.lease_ttl_ms = 1_000)
            .0
            .contains("--lease-ttl-ms"));
        assert!(refused(|s| s.standby_retry_ms = 7_000)
            .0
            .contains("--standby-retry-ms"));
        assert!(refused(|s| s.linger_ms = 40_000).0.contains("--linger-ms"));
        assert!(refused(|s| s.retention.published = Window::secs(10))
            .0
            .contains("--retain-published is 10s, below its floor of 1m"));
        assert!(refused(|s| s.retention.operator_actions = Window::days(1))
            .0
            .contains("--retain-operator-actions"));
    }
}
