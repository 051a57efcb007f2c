//! The `verify` command line and the settings a run derives from it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use super::fault_plan::{FaultKind, Timing};

/// Runs the real binaries under load while injecting faults, then checks that every
/// acknowledged event was applied exactly once and in order by each consumer group.
#[derive(Debug, Parser)]
#[command(name = "verify", version, about)]
pub struct VerifyArgs {
    /// The test-suite profile: at least 10,000 events and one fault of each kind.
    #[arg(long, conflicts_with = "long")]
    pub short: bool,
    /// The thorough profile: at least 100,000 events and four faults of each kind.
    #[arg(long)]
    pub long: bool,
    /// Seed of the fault plan and the order mix; the same seed gives the same plan.
    /// Random when absent (the report records it).
    #[arg(long, env = "VERIFY_SEED")]
    pub seed: Option<u64>,
    /// Least number of acknowledged events; the load goes on until the fault plan is done.
    #[arg(long, env = "VERIFY_EVENTS")]
    pub events: Option<u64>,
    /// Number of faults to inject.
    #[arg(long, env = "VERIFY_FAULTS")]
    pub faults: Option<usize>,
    /// Events per second the driver aims at (open loop, bounded by --concurrency).
    #[arg(long, env = "VERIFY_RATE")]
    pub rate: Option<f64>,
    /// Most orders in flight in the driver.
    #[arg(long, env = "VERIFY_CONCURRENCY", default_value_t = 128)]
    pub concurrency: usize,
    /// Where to write the JSON report.
    #[arg(long, env = "VERIFY_REPORT")]
    pub report: PathBuf,
    /// Directory of the binaries (`producer`, and the crash-point `relay-crash-points` and
    /// `consumer-crash-points` the relays and consumers run); default: this executable's
    /// directory.
    #[arg(long, env = "PIPELINE_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// The java command of the Kafka nodes (Java 17 or newer).
    #[arg(long, env = "VERIFY_KAFKA_JAVA", default_value = "java")]
    pub kafka_java: PathBuf,
    /// The folder holding Apache Kafka's jars (`scripts/lib.sh`'s kafka_fetch fills one from
    /// deploy/kafka/pom.xml).
    #[arg(long, env = "VERIFY_KAFKA_JARS")]
    pub kafka_jars: PathBuf,
    /// The folder holding cluster.properties.in and log4j2-cluster.properties (deploy/kafka).
    #[arg(long, env = "VERIFY_KAFKA_CONFIG_DIR")]
    pub kafka_config_dir: PathBuf,
    /// Node N (1 to 3) listens for clients on this port + 100 × (N − 1)
    /// and for its controller on the port after that (29092/29093, 29192/29193, 29292/29293).
    #[arg(long, env = "VERIFY_KAFKA_BASE_PORT", default_value_t = 29_092)]
    pub kafka_base_port: u16,
    /// Each Kafka node's JVM heap options.
    #[arg(
        long,
        env = "VERIFY_KAFKA_HEAP_OPTS",
        default_value = "-Xms128m -Xmx384m",
        allow_hyphen_values = true
    )]
    pub kafka_heap_opts: String,
    /// A class-data archive of the Kafka broker's classes (`-XX:SharedArchiveFile`, made by
    /// `scripts/lib.sh` when its broker stops): each node then starts in about half the time.
    /// Ignored when the file does not exist.
    #[arg(long, env = "VERIFY_KAFKA_CLASS_ARCHIVE")]
    pub kafka_class_archive: Option<PathBuf>,
    /// The nodes' CPU priority (`nice`; negative is higher, and needs root: without it they run
    /// at the harness's). The nodes stand in for brokers on hosts of their own, which the
    /// pipeline's load would not slow: at the default, a node restarted under the run's load
    /// starts as fast as it would on a quieter machine.
    #[arg(long, env = "VERIFY_KAFKA_NICE", default_value_t = -5, allow_hyphen_values = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub kafka_nice: i32,
    /// log4j2 root level of the nodes' logs (the nodes' starts, fencing,
    /// leader elections and ISR changes are logged whatever it is).
    #[arg(long, env = "VERIFY_KAFKA_LOG_LEVEL", default_value = "WARN")]
    pub kafka_log_level: String,
    /// A PostgreSQL server URL; its database is only used to create the run's databases.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// Where the run's logs, trigger files and broker directory go (a subdirectory per run).
    #[arg(long, env = "VERIFY_WORK_DIR")]
    pub work_dir: Option<PathBuf>,
    /// Keep the run's database and the Kafka nodes' data instead of removing them.
    #[arg(long)]
    pub keep: bool,
    /// How long to wait, after the load, for the outbox to drain and both groups to catch up.
    #[arg(long, env = "VERIFY_DRAIN_TIMEOUT_SECS", default_value_t = 300)]
    pub drain_timeout_secs: u64,
    /// The consumers' `--fetch-wait-max` (their default is 100 ms): a group that fell behind
    /// during a fault catches up in full fetches.
    #[arg(long, env = "VERIFY_CONSUMER_FETCH_WAIT_MS", default_value_t = 500)]
    pub consumer_fetch_wait_ms: u64,
    /// Extra environment of the consumer processes, KEY=VALUE, repeatable: e.g.
    /// `KAFKA_OPTIONS=debug=cgrp,fetch` with `RUST_LOG=info,consumer::kafka=debug` to trace
    /// librdkafka's group and fetch decisions while investigating.
    #[arg(long = "consumer-env", value_parser = parse_env_pair)]
    pub consumer_env: Vec<(String, String)>,
    /// Leave out these fault kinds (comma separated), e.g. postgres_restart on a shared server.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub skip_fault: Vec<FaultKind>,
    /// Where the relays read the outbox's events: `queue` (the queue table) or `wal` (the
    /// write-ahead log, from a replication slot of the run's own).
    #[arg(long, env = "VERIFY_RELAY_SOURCE", value_enum, default_value_t = RelaySource::Queue)]
    pub relay_source: RelaySource,
}

/// The relays' `--source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RelaySource {
    Queue,
    Wal,
}

impl RelaySource {
    /// The relay's flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            RelaySource::Queue => "queue",
            RelaySource::Wal => "wal",
        }
    }
}

fn parse_env_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

/// How the run's Apache Kafka cluster is started.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    pub java: PathBuf,
    pub jars: PathBuf,
    pub config_dir: PathBuf,
    pub base_port: u16,
    pub heap_opts: Vec<String>,
    pub class_archive: Option<PathBuf>,
    pub nice: i32,
    pub log_level: String,
}

/// The profile a run uses when `--events`, `--faults` or `--rate` are not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    Short,
    Long,
}

/// Everything a run needs, resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    pub profile: Profile,
    pub seed: u64,
    pub min_events: u64,
    pub faults: usize,
    pub rate: f64,
    pub concurrency: usize,
    pub report: PathBuf,
    pub bin_dir: PathBuf,
    pub kafka: KafkaSettings,
    pub server_url: String,
    pub work_root: PathBuf,
    pub keep: bool,
    pub drain_timeout: Duration,
    pub skip: Vec<FaultKind>,
    pub consumer_fetch_wait_ms: u64,
    pub consumer_env: Vec<(String, String)>,
    pub relay_source: RelaySource,
    pub timing: Timing,
}

/// The relays' `--lease-ttl` and `--standby-retry`, in milliseconds: a frozen or cut-off active relay is
/// replaced within their sum.
pub const RELAY_LEASE_TTL_MS: u64 = 6_000;
pub const RELAY_STANDBY_RETRY_MS: u64 = 500;

/// Within how long a standby must be active after the active relay froze or was cut off: the
/// lease's bound, plus one probe round of the harness (it reads `relay_active` every 100 ms,
/// through an HTTP request that a loaded machine may answer late).
pub const RELAY_TAKEOVER_BOUND_MS: u64 = RELAY_LEASE_TTL_MS + RELAY_STANDBY_RETRY_MS + 1_000;

/// The consumers' `--session-timeout`: a frozen consumer loses its partitions after this.
pub const SESSION_TIMEOUT_MS: u64 = 6_000;

/// A Kafka node's `broker.session.timeout.ms`: a killed or frozen node is fenced after this (its
/// partitions get new leaders from the in-sync replicas).
pub const KAFKA_SESSION_TIMEOUT_MS: u64 = 6_000;

/// Within how long every partition a killed or frozen Kafka node led must have another leader:
/// its session timeout, plus a controller election when the node was also the active controller
/// (2 s without fetches, then an election; the new controller starts every session afresh) and
/// a margin for a loaded machine.
pub const KAFKA_FAILOVER_BOUND_MS: u64 = KAFKA_SESSION_TIMEOUT_MS + 8_000;

/// The relays' delivery timeout (`--delivery-timeout`, their default), in milliseconds: the run keeps two
/// Kafka nodes down for less than this.
pub const RELAY_DELIVERY_TIMEOUT_MS: u64 = 30_000;

/// The consumer group protocol of a group's members (the consumers' `--group-protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupProtocol {
    /// The classic protocol: the members agree on an assignment among themselves.
    Classic,
    /// The consumer protocol (KIP-848): the broker assigns each member its partitions.
    Consumer,
}

impl GroupProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
}

/// Which protocol each group kind uses: one group on each, swapped from one seed to the next
/// (an even seed puts the inventory group on the classic protocol).
pub fn group_protocols(seed: u64) -> [(&'static str, GroupProtocol); 2] {
    let (first, second) = if seed.is_multiple_of(2) {
        (GroupProtocol::Classic, GroupProtocol::Consumer)
    } else {
        (GroupProtocol::Consumer, GroupProtocol::Classic)
    };
    [("inventory", first), ("notification", second)]
}

impl Settings {
    pub fn resolve(args: VerifyArgs) -> anyhow::Result<Settings> {
        let profile = if args.long {
            Profile::Long
        } else {
            Profile::Short
        };
        // Past the failover bound: the node's partitions get new leaders while it is stopped.
        let broker_freeze_ms = (
            KAFKA_FAILOVER_BOUND_MS + 1_000,
            KAFKA_FAILOVER_BOUND_MS + 4_000,
        );
        let kinds = FaultKind::ALL.len();
        let (min_events, faults, rate, timing) = match profile {
            Profile::Short => (
                10_000,
                kinds,
                1_000.0,
                // Each wait as short as its fault allows: a fault outlasts the bound it tests
                // by two seconds or more, and two nodes stay down past the outage's grace.
                Timing {
                    gap_ms: (500, 1_500),
                    down_ms: (500, 2_500),
                    broker_down_ms: (2_000, 5_000),
                    broker_freeze_ms,
                    below_min_isr_ms: (6_000, 9_000),
                    freeze_ms: (SESSION_TIMEOUT_MS + 2_000, SESSION_TIMEOUT_MS + 4_000),
                    rebalance_dwell_ms: (500, 2_000),
                    outage_ms: (
                        RELAY_TAKEOVER_BOUND_MS + 2_000,
                        RELAY_TAKEOVER_BOUND_MS + 4_000,
                    ),
                },
            ),
            Profile::Long => (
                100_000,
                LONG_ROUNDS * kinds,
                1_000.0,
                Timing {
                    gap_ms: (2_000, 6_000),
                    down_ms: (500, 5_000),
                    broker_down_ms: (2_000, 10_000),
                    broker_freeze_ms,
                    below_min_isr_ms: (8_000, 15_000),
                    freeze_ms: (SESSION_TIMEOUT_MS + 3_000, SESSION_TIMEOUT_MS + 8_000),
                    rebalance_dwell_ms: (1_000, 5_000),
                    outage_ms: (
                        RELAY_TAKEOVER_BOUND_MS + 3_000,
                        RELAY_TAKEOVER_BOUND_MS + 8_000,
                    ),
                },
            ),
        };
        let rate = args.rate.unwrap_or(rate);
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--rate must be a positive number"
        );
        anyhow::ensure!(args.concurrency > 0, "--concurrency must be positive");
        anyhow::ensure!(
            (1_024..=65_000).contains(&args.kafka_base_port),
            "--kafka-base-port must be between 1024 and 65000"
        );
        let bin_dir = match args.bin_dir {
            Some(dir) => dir,
            None => std::env::current_exe()
                .context("locating the verify executable")?
                .parent()
                .map(PathBuf::from)
                .context("the verify executable has no directory")?,
        };
        // Absolute: each Kafka node runs in its own directory.
        let absolute = |path: PathBuf| {
            std::path::absolute(&path).with_context(|| format!("resolving {}", path.display()))
        };
        let work_root = absolute(args.work_dir.unwrap_or_else(|| bin_dir.join("verify-runs")))?;
        let kafka = KafkaSettings {
            java: args.kafka_java,
            jars: absolute(args.kafka_jars)?,
            config_dir: absolute(args.kafka_config_dir)?,
            base_port: args.kafka_base_port,
            heap_opts: args
                .kafka_heap_opts
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            class_archive: args.kafka_class_archive.filter(|path| path.is_file()),
            nice: args.kafka_nice,
            log_level: args.kafka_log_level,
        };
        Ok(Settings {
            profile,
            seed: args.seed.unwrap_or_else(rand::random),
            min_events: args.events.unwrap_or(min_events),
            faults: args.faults.unwrap_or(faults),
            rate,
            concurrency: args.concurrency,
            report: args.report,
            bin_dir,
            kafka,
            server_url: args.database_url,
            work_root,
            keep: args.keep,
            drain_timeout: Duration::from_secs(args.drain_timeout_secs),
            skip: args.skip_fault,
            consumer_fetch_wait_ms: args.consumer_fetch_wait_ms,
            consumer_env: args.consumer_env,
            relay_source: args.relay_source,
            timing,
        })
    }
}

/// Rounds of the long profile: each injects one fault of every kind.
pub const LONG_ROUNDS: usize = 4;
