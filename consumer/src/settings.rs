//! What [`run`](crate::run) takes: the groups to run, the topics, the Kafka cluster, and how
//! batches, transactions, retries and the group membership behave; and the database sessions
//! they call for ([`session_options`], [`connect`]).
//!
//! A program fills in a [`ConsumerSettings`] (its `Default` is the recommended configuration;
//! only the topics must be named). With the non-default `cli` feature the struct is also a set of
//! `clap` arguments, each flag reading an environment variable as well; a binary maps its command
//! line onto it.

use std::time::Duration;

use anyhow::Context;
use pipeline_core::db::{DbArgs, KEY_LOOKUP_PLANNER};
use pipeline_core::kafka::KafkaArgs;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;

use crate::kafka::{GroupProtocol, MemberSettings};
use crate::rate_limit::RateLimit;
use crate::retention::RetentionSettings;
use crate::transaction::CUSTOM_PLANS_UP_TO;

/// How the runtime runs its groups.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct ConsumerSettings {
    /// The Kafka cluster the groups consume from.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub kafka: KafkaArgs,
    /// Consumer group to run, repeatable: a name the program registered. Empty: every group
    /// the program registered.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "group",
            env = "CONSUMER_GROUPS",
            value_delimiter = ',',
            required = true
        )
    )]
    pub groups: Vec<String>,
    /// Prefix of the Kafka group ids (group id = prefix + group name), to run isolated copies.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CONSUMER_GROUP_PREFIX", default_value = "")
    )]
    pub group_prefix: String,
    /// Topic to consume, repeatable; at least one.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "topic",
            env = "CONSUMER_TOPICS",
            value_delimiter = ',',
            required = true
        )
    )]
    pub topics: Vec<String>,
    /// Most messages applied in one database transaction (1: one transaction per message).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CONSUMER_MAX_BATCH", default_value_t = 500)
    )]
    pub max_batch: usize,
    /// Most shared transactions the process runs at once for each of its groups, each taking
    /// the batches of every partition, of any of the groups, waiting for one (up to --max-batch
    /// messages). 0: no shared transactions, each partition batch has a transaction of its own.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CONSUMER_SHARED_TRANSACTIONS", default_value_t = 2)
    )]
    pub shared_transactions: usize,
    /// How long partition batches wait for the group's shared transaction
    /// being written to finish before another starts beside it; batches arriving meanwhile share
    /// the next one. 0: a free runner starts a shared transaction at once.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_SHARED_TRANSACTION_PATIENCE",
            default_value = "1ms",
            value_parser = humantime::parse_duration
        )
    )]
    pub shared_transaction_patience: Duration,
    /// How long a shared transaction that took the batches of one group only waits for
    /// another group's (the groups consume the same events, so one is usually on its way):
    /// one commit for both instead of one each, at the cost of this wait for the first. Waits
    /// only while the other groups' batches are missing; 0 never waits.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_SHARED_TRANSACTION_GATHER",
            default_value = "1ms",
            value_parser = humantime::parse_duration
        )
    )]
    pub shared_transaction_gather: Duration,
    /// Transactions of at most this many messages plan their statements with their parameter
    /// values (`plan_cache_mode=force_custom_plan`); larger ones use PostgreSQL's cached generic
    /// plans. 0: always generic.
    #[cfg_attr(feature = "cli", arg(long, env = "CONSUMER_CUSTOM_PLANS_UP_TO", default_value_t = CUSTOM_PLANS_UP_TO))]
    pub custom_plans_up_to: usize,
    /// Messages queued for one partition's task before the partition is paused; it resumes once
    /// half of them are done. Bounds memory at about partitions × this × message size; with too
    /// little room a task runs dry while the partition is resumed and fetched again.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CONSUMER_MAX_QUEUED", default_value_t = 5000)
    )]
    pub max_queued: usize,
    /// The consumer group protocol (`group.protocol`): `classic`, where the members agree on an
    /// assignment among themselves, or `consumer` (KIP-848, Apache Kafka 4.0 or newer), where the
    /// broker assigns partitions to each member incrementally and the session timeout and the
    /// assignor are the broker's settings (`group.consumer.session.timeout.ms`,
    /// `group.consumer.assignors`).
    #[cfg_attr(feature = "cli", arg(
        long,
        env = "CONSUMER_GROUP_PROTOCOL",
        value_enum,
        default_value_t = GroupProtocol::Classic
    ))]
    pub group_protocol: GroupProtocol,
    /// partition.assignment.strategy (classic protocol only).
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_ASSIGNMENT_STRATEGY",
            default_value = "cooperative-sticky"
        )
    )]
    pub assignment_strategy: String,
    /// The group session timeout: how long a member may go unheard before the group gives its
    /// partitions to others. The classic protocol sends it (`session.timeout.ms`); with
    /// `--group-protocol consumer` the broker's `group.consumer.session.timeout.ms` applies and
    /// this value should match it (it is the default of `--leave-after-database-unreachable`).
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_SESSION_TIMEOUT",
            default_value = "10s",
            value_parser = humantime::parse_duration
        )
    )]
    pub session_timeout: Duration,
    /// max.poll.interval.ms. Polling runs on its own thread, so slow batches do not count.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_MAX_POLL_INTERVAL",
            default_value = "60s",
            value_parser = humantime::parse_duration
        )
    )]
    pub max_poll_interval: Duration,
    /// `fetch.wait.max.ms`: how long the broker holds a fetch that finds nothing. A fetch
    /// returns as soon as records arrive, so this adds no latency; it sets how often an idle
    /// group asks (ten times a second), and how long a partition resumed, moved back or newly
    /// assigned may wait for the fetch already out.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_FETCH_WAIT_MAX",
            default_value = "100ms",
            value_parser = humantime::parse_duration
        )
    )]
    pub fetch_wait_max: Duration,
    /// Offsets of finished batches are committed together at most this often (0: after every
    /// poll). Always after the batches' database commits; a revoke or shutdown
    /// commits at once.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_COMMIT_INTERVAL",
            default_value = "20ms",
            value_parser = humantime::parse_duration
        )
    )]
    pub commit_interval: Duration,
    /// How long a revoke waits for in-flight batches.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_REVOKE_TIMEOUT",
            default_value = "10s",
            value_parser = humantime::parse_duration
        )
    )]
    pub revoke_timeout: Duration,
    /// Interval of the lag collector; 0 turns it off.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "LAG_INTERVAL",
            default_value = "5s",
            value_parser = humantime::parse_duration
        )
    )]
    pub lag_interval: Duration,
    /// Further consumer group ids whose lag to export besides the groups run here (expected
    /// groups keep reporting lag while none of their members runs).
    #[cfg_attr(
        feature = "cli",
        arg(long = "lag-group", env = "LAG_GROUPS", value_delimiter = ',')
    )]
    pub lag_groups: Vec<String>,
    /// Dead-letter topic; `{topic}` stands for the original topic. Empty: dead letters are only
    /// recorded in the database.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DEAD_LETTER_TOPIC", default_value = "{topic}.dlq")
    )]
    pub dead_letter_topic: String,
    /// Partitions of dead-letter topics created at start-up when missing.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DEAD_LETTER_PARTITIONS", default_value_t = 3)
    )]
    pub dead_letter_partitions: i32,
    /// How long a batch may keep failing while the database answers before its messages are
    /// retried one by one and the one that still fails is dead-lettered.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_RETRY_BUDGET",
            default_value = "30s",
            value_parser = humantime::parse_duration
        )
    )]
    pub retry_budget: Duration,
    /// PostgreSQL statement_timeout of the consumer's connections: bounds one
    /// statement of a batch, so a revoke never waits on a stuck statement.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_STATEMENT_TIMEOUT",
            default_value = "5s",
            value_parser = humantime::parse_duration
        )
    )]
    pub statement_timeout: Duration,
    /// PostgreSQL idle_in_transaction_session_timeout of the consumer's connections: a batch
    /// transaction whose process froze or lost its path to the database
    /// is ended by the server after this, releasing its locks (the partition's ownership row
    /// among them) for the partition's next owner.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_IDLE_IN_TRANSACTION_TIMEOUT",
            default_value = "5s",
            value_parser = humantime::parse_duration
        )
    )]
    pub idle_in_transaction_timeout: Duration,
    /// How long the database may be out of reach before this member leaves its groups so that
    /// members that reach it take its partitions; it joins again once the
    /// database answers. 0: the session timeout.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_LEAVE_AFTER_DATABASE_UNREACHABLE",
            default_value = "0s",
            value_parser = humantime::parse_duration
        )
    )]
    pub leave_after_database_unreachable: Duration,
    /// First retry delay of a batch after a transient failure.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_RETRY_BASE",
            default_value = "100ms",
            value_parser = humantime::parse_duration
        )
    )]
    pub retry_base: Duration,
    /// Longest retry delay.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CONSUMER_RETRY_MAX",
            default_value = "10s",
            value_parser = humantime::parse_duration
        )
    )]
    pub retry_max: Duration,
    /// A group's cap on the events it applies, as GROUP=N/s or GROUP=N/min; repeatable, at
    /// most one per group. It holds in each process that runs the group (M processes apply up
    /// to M × N); a limited group's batches hold at most a tenth of a second's events. Events
    /// wait in Kafka meanwhile: the lag grows. Empty: no group is limited.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "rate-limit",
            env = "CONSUMER_RATE_LIMITS",
            value_delimiter = ',',
            value_name = "GROUP=N/s"
        )
    )]
    pub rate_limits: Vec<RateLimit>,
    /// Retention of the groups' tables in this consumer's database.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub retention: RetentionSettings,
}

impl Default for ConsumerSettings {
    /// The defaults of every setting; `topics` is empty and must be filled in.
    fn default() -> Self {
        ConsumerSettings {
            kafka: KafkaArgs::default(),
            groups: Vec::new(),
            group_prefix: String::new(),
            topics: Vec::new(),
            max_batch: 500,
            shared_transactions: 2,
            shared_transaction_patience: Duration::from_millis(1),
            shared_transaction_gather: Duration::from_millis(1),
            custom_plans_up_to: CUSTOM_PLANS_UP_TO,
            max_queued: 5000,
            group_protocol: GroupProtocol::Classic,
            assignment_strategy: "cooperative-sticky".to_owned(),
            session_timeout: Duration::from_secs(10),
            max_poll_interval: Duration::from_secs(60),
            fetch_wait_max: Duration::from_millis(100),
            commit_interval: Duration::from_millis(20),
            revoke_timeout: Duration::from_secs(10),
            lag_interval: Duration::from_secs(5),
            lag_groups: Vec::new(),
            dead_letter_topic: "{topic}.dlq".to_owned(),
            dead_letter_partitions: 3,
            retry_budget: Duration::from_secs(30),
            statement_timeout: Duration::from_secs(5),
            idle_in_transaction_timeout: Duration::from_secs(5),
            leave_after_database_unreachable: Duration::ZERO,
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(10),
            rate_limits: Vec::new(),
            retention: RetentionSettings::default(),
        }
    }
}

/// Settings that cannot work together, with the reason.
#[derive(Debug, thiserror::Error)]
#[error("invalid consumer settings: {0}")]
pub struct InvalidSettings(pub String);

impl ConsumerSettings {
    /// The Kafka consumer settings every group runs with (`--leave-after-database-unreachable`
    /// 0: the session timeout).
    pub fn member_settings(&self) -> MemberSettings {
        MemberSettings {
            topics: self.topics.clone(),
            group_protocol: self.group_protocol,
            assignment_strategy: self.assignment_strategy.clone(),
            session_timeout: self.session_timeout,
            max_poll_interval: self.max_poll_interval,
            fetch_wait_max: self.fetch_wait_max,
            commit_interval: self.commit_interval,
            revoke_timeout: self.revoke_timeout,
            max_queued: self.max_queued,
            leave_after_database_unreachable: if self.leave_after_database_unreachable.is_zero() {
                self.session_timeout
            } else {
                self.leave_after_database_unreachable
            },
        }
    }

    /// Refuses settings that cannot work: no topic, or timeouts that cannot work together.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), InvalidSettings> {
            if ok {
                Ok(())
            } else {
                Err(InvalidSettings(message()))
            }
        }
        ensure(
            !self.topics.is_empty() && self.topics.iter().all(|t| !t.trim().is_empty()),
            || "topics (--topic): name at least one topic to consume".to_owned(),
        )?;
        ensure(self.max_batch > 0, || {
            "max_batch (--max-batch) must be positive".to_owned()
        })?;
        ensure(self.max_queued >= self.max_batch, || {
            "max_queued (--max-queued) must be at least max_batch (--max-batch)".to_owned()
        })?;
        ensure(self.max_poll_interval >= self.session_timeout, || {
            format!(
                "max_poll_interval (--max-poll-interval, {:?}) must be at least session_timeout \
                 (--session-timeout, {:?})",
                self.max_poll_interval, self.session_timeout
            )
        })?;
        ensure(self.revoke_timeout < self.max_poll_interval, || {
            format!(
                "revoke_timeout (--revoke-timeout, {:?}) must be below max_poll_interval \
                 (--max-poll-interval, {:?}): a revoke blocks polling",
                self.revoke_timeout, self.max_poll_interval
            )
        })?;
        ensure(
            !self.retry_base.is_zero() && self.retry_base <= self.retry_max,
            || {
                "retry_base (--retry-base) must be positive and at most retry_max (--retry-max)"
                    .to_owned()
            },
        )?;
        ensure(
            !self.statement_timeout.is_zero() && self.statement_timeout < self.revoke_timeout,
            || {
                format!(
                    "statement_timeout (--statement-timeout, {:?}) must be positive and below \
                     revoke_timeout (--revoke-timeout, {:?}): a revoke waits for the statement \
                     in flight",
                    self.statement_timeout, self.revoke_timeout
                )
            },
        )?;
        ensure(self.retry_budget >= self.retry_base, || {
            "retry_budget (--retry-budget) must allow at least one retry (at least retry_base, \
             --retry-base)"
                .to_owned()
        })?;
        // The probe answers at most once a second: below three seconds a member would leave
        // its groups between two answers of a database that is there.
        ensure(
            self.leave_after_database_unreachable.is_zero()
                || self.leave_after_database_unreachable >= Duration::from_secs(3),
            || {
                format!(
                    "leave_after_database_unreachable (--leave-after-database-unreachable, {:?}) \
                     must be 0s (the session timeout) or at least 3s: the database is probed once \
                     a second, and a member would leave its groups between two answers",
                    self.leave_after_database_unreachable
                )
            },
        )?;
        ensure(self.session_timeout >= Duration::from_secs(3), || {
            "session_timeout (--session-timeout) below 3s leaves no room for the 1 s heartbeat"
                .to_owned()
        })?;
        ensure(
            self.dead_letter_topic.is_empty()
                || self.dead_letter_topic.contains("{topic}")
                || self.topics.len() == 1,
            || {
                "dead_letter_topic (--dead-letter-topic) without {topic} would mix several \
                 topics' dead letters"
                    .to_owned()
            },
        )?;
        ensure(self.retention.batch_size > 0, || {
            "retention.batch_size (--retention-batch-size) must be positive".to_owned()
        })?;
        ensure(
            !self.retention.enabled() || self.statement_timeout < Duration::from_secs(60),
            || {
                "statement_timeout (--statement-timeout) must be below 1m while retention \
                 runs: retention removes an order's progress only a minute after announcing it, \
                 longer than any batch statement may run"
                    .to_owned()
            },
        )?;
        self.check_rate_limits()?;
        self.retention
            .validate()
            .map_err(|e| InvalidSettings(e.to_string()))
    }

    /// Refuses rate limits that cannot work (zero, too high, no group), two for one group, and,
    /// when `groups` names the groups to run, a limit for a group this process does not run.
    pub fn check_rate_limits(&self) -> Result<(), InvalidSettings> {
        for (i, limit) in self.rate_limits.iter().enumerate() {
            limit
                .check()
                .map_err(|e| InvalidSettings(format!("rate_limits (--rate-limit): {e}")))?;
            if self.rate_limits[..i].iter().any(|l| l.group == limit.group) {
                return Err(InvalidSettings(format!(
                    "rate_limits (--rate-limit): group {} has two limits; give it one",
                    limit.group
                )));
            }
            if !self.groups.is_empty() && !self.groups.contains(&limit.group) {
                return Err(InvalidSettings(format!(
                    "rate_limits (--rate-limit {limit}): this process does not run group {} \
                     (it runs {})",
                    limit.group,
                    self.groups.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The rate limit of `group` (a name `groups` holds), if it has one.
    pub fn rate_limit(&self, group: &str) -> Option<&RateLimit> {
        self.rate_limits.iter().find(|l| l.group == group)
    }
}

/// `options` with the session settings the runtime's pool needs: `statement_timeout`
/// (`statement_timeout`), so a revoke never waits on a stuck statement;
/// `idle_in_transaction_session_timeout` (`idle_in_transaction_timeout`), so the server ends
/// the transaction of a process that froze and releases its partition's ownership row; and the
/// key-lookup planner ([`pipeline_core::db::Planner::KeyLookups`]), so a batch's statements stay
/// index lookups however small the tables were when they were planned.
pub fn session_options(options: PgConnectOptions, settings: &ConsumerSettings) -> PgConnectOptions {
    let statement_timeout = settings.statement_timeout.as_millis().to_string();
    let idle_in_transaction = settings.idle_in_transaction_timeout.as_millis().to_string();
    options
        .options([
            ("statement_timeout", statement_timeout.as_str()),
            (
                "idle_in_transaction_session_timeout",
                idle_in_transaction.as_str(),
            ),
        ])
        .options(KEY_LOOKUP_PLANNER)
}

/// A pool for the runtime: `db`'s URL and size, with [`session_options`]. Applies no migrations
/// (see [`crate::MIGRATOR`]).
pub async fn connect(db: &DbArgs, settings: &ConsumerSettings) -> anyhow::Result<PgPool> {
    let options = session_options(db.connect_options()?, settings);
    db.connect_pool(options, &[])
        .await
        .context("connecting the consumer's pool")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_work_once_the_topics_are_named() {
        let settings = ConsumerSettings::default();
        assert!(settings
            .validate()
            .is_err_and(|e| e.to_string().contains("topic")));
        let settings = ConsumerSettings {
            topics: vec!["events".to_owned()],
            ..ConsumerSettings::default()
        };
        settings.validate().expect("the defaults are valid");
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        let valid = ConsumerSettings {
            topics: vec!["a".to_owned(), "b".to_owned()],
            ..ConsumerSettings::default()
        };
        let refused = |change: fn(&mut ConsumerSettings), field: &str| {
            let mut settings = valid.clone();
            change(&mut settings);
            let error = settings.validate().expect_err(field).to_string();
            assert!(error.contains(field), "{error}");
        };
        refused(|s| s.max_batch = 0, "max_batch");
        refused(|s| s.max_queued = s.max_batch - 1, "max_queued");
        refused(|s| s.revoke_timeout = s.max_poll_interval, "revoke_timeout");
        refused(
            |s| s.statement_timeout = Duration::ZERO,
            "statement_timeout",
        );
        refused(
            |s| s.session_timeout = Duration::from_secs(2),
            "session_timeout",
        );
        refused(
            |s| s.leave_after_database_unreachable = Duration::from_millis(300),
            "leave_after_database_unreachable",
        );
        refused(
            |s| s.dead_letter_topic = "dlq".to_owned(),
            "dead_letter_topic",
        );
    }

    #[test]
    fn rate_limits_that_cannot_work_are_refused() {
        let valid = ConsumerSettings {
            groups: vec!["inventory".to_owned(), "notification".to_owned()],
            topics: vec!["events".to_owned()],
            rate_limits: vec![
                RateLimit::per_second("inventory", 200),
                RateLimit::per_minute("notification", 30),
            ],
            ..ConsumerSettings::default()
        };
        valid.validate().expect("valid limits");
        assert_eq!(
            valid.rate_limit("inventory"),
            Some(&RateLimit::per_second("inventory", 200))
        );
        assert_eq!(valid.rate_limit("export"), None);
        let refused = |change: fn(&mut ConsumerSettings), expected: &str| {
            let mut settings = valid.clone();
            change(&mut settings);
            let error = settings.validate().expect_err(expected).to_string();
            assert!(error.contains("--rate-limit"), "{error}");
            assert!(error.contains(expected), "{error}");
        };
        refused(|s| s.rate_limits[0].events = 0, "zero");
        refused(
            |s| s.rate_limits[0] = RateLimit::per_second("inventory", 2_000_000),
            "above 1000000/s",
        );
        refused(
            |s| s.rate_limits[1] = RateLimit::per_second("inventory", 10),
            "two limits",
        );
        refused(
            |s| s.rate_limits[1] = RateLimit::per_second("export", 10),
            "does not run group export",
        );
        refused(|s| s.rate_limits[1].group = String::new(), "names no group");
        // With no group named the process runs every registered one: the runtime checks the
        // names once it knows them.
        let mut every_group = valid.clone();
        every_group.groups.clear();
        every_group.rate_limits[1] = RateLimit::per_second("export", 10);
        every_group.validate().expect("checked at start");
    }

    #[test]
    fn sessions_get_both_timeouts_and_the_key_lookup_planner() {
        let settings = ConsumerSettings::default();
        let options = session_options(PgConnectOptions::new(), &settings);
        let options = options.get_options().expect("options set");
        assert!(options.contains("statement_timeout=5000"), "{options}");
        assert!(
            options.contains("idle_in_transaction_session_timeout=5000"),
            "{options}"
        );
        assert!(options.contains("enable_seqscan=off"), "{options}");
        assert!(options.contains("jit=off"), "{options}");
    }
}
