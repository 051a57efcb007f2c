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
    /// (`--listen false`, or its LISTEN session is down); also the pause before its second look
    /// when it starts listening.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_POLL_INTERVAL", default_value = "5ms",
            value_parser = humantime::parse_duration)
    )]
    pub poll_interval: Duration,
    /// While the relay listens, how often it claims anyway: the bound on how late an event is
    /// published when no insert announced it (a retry falling due, a requeue, a wake-up lost
    /// while the relay stopped listening).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LISTEN_POLL_INTERVAL", default_value = "1s",
            value_parser = humantime::parse_duration)
    )]
    pub listen_poll_interval: Duration,
    /// How often the relay vacuums its queue table (`outbox_unpublished`); 0 leaves it to
    /// autovacuum. Every publish deletes rows from it, and the claim reads it whole, so dead rows
    /// waiting for autovacuum's next visit (once a minute by default) would be read by every
    /// claim. Needs the table's owner; otherwise PostgreSQL skips it with a warning.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_QUEUE_VACUUM_INTERVAL", default_value = "1s",
            value_parser = humantime::parse_duration)
    )]
    pub queue_vacuum_interval: Duration,
    /// How often the active relay releases delayed events that fell due into the outbox: a
    /// delayed event is published at most about this long after its time (a recurring
    /// schedule's occurrence at most about twice this long, the first after the schedule was
    /// made or changed).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_RELEASE_INTERVAL", default_value = "1s",
            value_parser = humantime::parse_duration)
    )]
    pub release_interval: Duration,
    /// Most delayed events released into the outbox in one statement.
    #[cfg_attr(
        feature = "cli",
        arg(long = "release-batch-size", env = "RELAY_RELEASE_BATCH_SIZE",
            value_name = "RELEASE_BATCH_SIZE", default_value_t = 5000,
            value_parser = clap::value_parser!(i64).range(1..))
    )]
    pub release_batch_size: i64,
    /// Wait for new events on PostgreSQL's LISTEN (the outbox's insert trigger notifies while
    /// the relay waits) instead of polling every --poll-interval.
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
    /// How often a standby relay tries to take over.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_STANDBY_RETRY", default_value = "500ms",
            value_parser = humantime::parse_duration)
    )]
    pub standby_retry: Duration,
    /// How long the active relay's lease lasts without renewal (renewed every third of it), from
    /// 1.5 s to 10 min. A relay that dies is replaced within --standby-retry; one that is frozen
    /// or cut off from PostgreSQL within this plus --standby-retry (6.5 s by default).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LEASE_TTL", default_value = "6s",
            value_parser = humantime::parse_duration)
    )]
    pub lease_ttl: Duration,
    /// librdkafka `message.timeout.ms`: how long one delivery may take before it counts as failed.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_DELIVERY_TIMEOUT", default_value = "30s",
            value_parser = humantime::parse_duration)
    )]
    pub delivery_timeout: Duration,
    /// librdkafka `linger.ms`. The relay hands librdkafka a whole claimed batch at once, so a
    /// long linger only delays the batch's last request.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_LINGER", default_value = "1ms",
            value_parser = humantime::parse_duration)
    )]
    pub linger: Duration,
    /// librdkafka `compression.type` (none, lz4, zstd, snappy, gzip).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_COMPRESSION", default_value = "none")
    )]
    pub compression: String,
    /// librdkafka statistics interval (client metrics); 0 turns them off.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KAFKA_STATISTICS_INTERVAL", default_value = "5s",
            value_parser = humantime::parse_duration)
    )]
    pub statistics_interval: Duration,
    /// Delay after the first failed attempt (doubles each attempt).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_RETRY_BASE", default_value = "200ms",
            value_parser = humantime::parse_duration)
    )]
    pub retry_base: Duration,
    /// Longest delay of the exponential phase.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_RETRY_MAX", default_value = "30s",
            value_parser = humantime::parse_duration)
    )]
    pub retry_max: Duration,
    /// Attempts after which retries slow down to --slow-retry-interval.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_SLOW_RETRY_AFTER", default_value_t = 20)
    )]
    pub slow_retry_after: i32,
    /// Delay between retries past --slow-retry-after.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "RELAY_SLOW_RETRY_INTERVAL", default_value = "5m",
            value_parser = humantime::parse_duration)
    )]
    pub slow_retry_interval: Duration,
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
    /// Where the events are read from: the queue table or the write-ahead log.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub source: SourceSettings,
}

/// Where the relay reads the outbox's events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Source {
    /// Claimed from the queue table the outbox's insert trigger fills, each delivery recorded.
    #[default]
    Queue,
    /// Streamed from the write-ahead log through a logical replication slot: writers queue
    /// nothing and the relay records no delivery per event. The queue table still carries what
    /// the log cannot: events Kafka refused, requeued ones, and those of a fall-back.
    Wal,
}

/// The source of the relay's events, and the replication slot when it is the write-ahead log.
#[derive(Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct SourceSettings {
    /// Where the relay reads new events: `queue` (the outbox's queue table) or `wal` (the
    /// write-ahead log, through a logical replication slot; needs `wal_level = logical`).
    #[cfg_attr(
        feature = "cli",
        arg(long = "source", env = "RELAY_SOURCE", value_enum, default_value_t = Source::Queue)
    )]
    pub source: Source,
    /// The logical replication slot the relay streams from in `--source wal` (created when
    /// missing): lower-case letters, digits and underscores.
    #[cfg_attr(
        feature = "cli",
        arg(long = "slot", env = "RELAY_SLOT", default_value = DEFAULT_SLOT)
    )]
    pub slot: String,
    /// The URL the replication session connects with in `--source wal`: a role with the
    /// REPLICATION attribute (and `pg_read_all_stats`). Unset: the relay's database URL.
    #[cfg_attr(
        feature = "cli",
        arg(long = "replication-url", env = "RELAY_REPLICATION_URL")
    )]
    pub replication_url: Option<String>,
}

/// The slot of [`SourceSettings::default`].
pub const DEFAULT_SLOT: &str = "outbox_relay";

impl Default for SourceSettings {
    fn default() -> Self {
        SourceSettings {
            source: Source::Queue,
            slot: DEFAULT_SLOT.to_owned(),
            replication_url: None,
        }
    }
}

impl std::fmt::Debug for SourceSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceSettings")
            .field("source", &self.source)
            .field("slot", &self.slot)
            .field(
                "replication_url",
                &self
                    .replication_url
                    .as_deref()
                    .map(pipeline_core::db::redact_url),
            )
            .finish()
    }
}

impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            kafka: KafkaArgs::default(),
            batch_size: 5000,
            pipeline_depth: 4,
            poll_interval: Duration::from_millis(5),
            listen_poll_interval: Duration::from_secs(1),
            queue_vacuum_interval: Duration::from_secs(1),
            release_interval: Duration::from_secs(1),
            release_batch_size: 5000,
            listen: true,
            lock_key: DEFAULT_LOCK_KEY,
            standby_retry: Duration::from_millis(500),
            lease_ttl: Duration::from_secs(6),
            delivery_timeout: Duration::from_secs(30),
            linger: Duration::from_millis(1),
            compression: "none".to_owned(),
            statistics_interval: Duration::from_secs(5),
            retry_base: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
            slow_retry_after: 20,
            slow_retry_interval: Duration::from_secs(300),
            max_attempts: 5,
            retention: RetentionSettings::default(),
            source: SourceSettings::default(),
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
            base: self.retry_base,
            max: self.retry_max,
            slow_after: self.slow_retry_after,
            slow_interval: self.slow_retry_interval,
            max_attempts: self.max_attempts,
        }
    }

    /// How the lease is held and taken over.
    pub fn lease_settings(&self) -> LeaseSettings {
        LeaseSettings {
            lock_key: self.lock_key,
            lease_ttl: self.lease_ttl,
            standby_retry: self.standby_retry,
        }
    }

    /// The Kafka producer's settings.
    pub fn producer_settings(&self) -> ProducerSettings {
        ProducerSettings {
            delivery_timeout: self.delivery_timeout,
            linger: self.linger,
            compression: self.compression.clone(),
            statistics_interval: self.statistics_interval,
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
            !self.listen_poll_interval.is_zero(),
            "listen_poll_interval (--listen-poll-interval) must be positive",
        )?;
        ensure(
            !self.release_interval.is_zero(),
            "release_interval (--release-interval) must be positive",
        )?;
        ensure(
            self.release_batch_size > 0,
            "release_batch_size (--release-batch-size) must be positive",
        )?;
        ensure(
            (Duration::from_millis(1_500)..=Duration::from_secs(600)).contains(&self.lease_ttl),
            "lease_ttl (--lease-ttl) must be from 1.5s to 10m",
        )?;
        ensure(
            self.max_attempts > 0,
            "max_attempts (--max-attempts) must be positive",
        )?;
        ensure(
            !self.standby_retry.is_zero() && self.standby_retry <= self.lease_ttl,
            "standby_retry (--standby-retry) must be positive and at most lease_ttl \
             (--lease-ttl)",
        )?;
        ensure(
            self.delivery_timeout >= Duration::from_secs(1),
            "delivery_timeout (--delivery-timeout) below 1s leaves librdkafka no room to retry",
        )?;
        ensure(
            self.delivery_timeout > self.linger,
            "delivery_timeout (--delivery-timeout) must exceed linger (--linger), or every \
             message times out while lingering",
        )?;
        ensure(
            !self.retry_base.is_zero() && self.retry_base <= self.retry_max,
            "retry_base (--retry-base) must be positive and at most retry_max (--retry-max)",
        )?;
        ensure(
            crate::wal::reader::valid_slot(&self.source.slot),
            "source.slot (--slot) must be lower-case letters, digits and underscores, at most 63",
        )?;
        ensure(
            self.source.source == Source::Queue || self.source.replication_url.is_some(),
            "source.replication_url (--replication-url, or the database URL) is needed with \
             --source wal",
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
        assert!(refused(|s| s.lease_ttl = Duration::from_secs(1))
            .0
            .contains("--lease-ttl"));
        assert!(refused(|s| s.standby_retry = Duration::from_secs(7))
            .0
            .contains("--standby-retry"));
        assert!(refused(|s| s.linger = Duration::from_secs(40))
            .0
            .contains("--linger"));
        assert!(refused(|s| s.listen_poll_interval = Duration::ZERO)
            .0
            .contains("--listen-poll-interval"));
        assert!(refused(|s| s.release_interval = Duration::ZERO)
            .0
            .contains("--release-interval"));
        assert!(refused(|s| s.retention.published = Window::secs(10))
            .0
            .contains("--retain-published is 10s, below its floor of 1m"));
        assert!(refused(|s| s.retention.operator_actions = Window::days(1))
            .0
            .contains("--retain-operator-actions"));
    }
}
