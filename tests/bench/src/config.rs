//! The benchmark's command line, and the settings it resolves to.
//!
//! Sizes and durations are optional on the command line: unset, they take the full or the
//! `--quick` default, so `--quick --backlog 50000` shortens everything but the backlog.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use clap::Parser;
use serde::Serialize;

/// Measures the pipeline's throughput, latency and footprint against its targets, in one run.
///
/// Writes a JSON report to --out and prints a table. Needs PostgreSQL, the broker and the release
/// binaries (scripts/bench.sh provides all three).
#[derive(Debug, Parser)]
#[command(name = "bench", version, about)]
pub struct BenchArgs {
    /// Where to write the JSON report.
    #[arg(long, env = "BENCH_OUT", default_value = ".run/bench.json")]
    pub out: PathBuf,
    /// Smaller backlogs and shorter phases: a smoke run of a few minutes.
    #[arg(long, env = "BENCH_QUICK")]
    pub quick: bool,
    /// Keep the databases, topics and logs the benchmark created.
    #[arg(long, env = "BENCH_KEEP")]
    pub keep: bool,
    /// Where the CPU profiles of the idle phase and each latency rate go (`perf` recordings and
    /// one flat profile per process).
    #[arg(
        long,
        env = "BENCH_CPU_PROFILES",
        default_value = ".run/bench-profiles"
    )]
    pub cpu_profiles: PathBuf,
    /// Take no CPU profiles.
    #[arg(long, env = "BENCH_NO_CPU_PROFILES")]
    pub no_cpu_profiles: bool,
    /// Phases to run, comma separated.
    #[arg(
        long,
        env = "BENCH_PHASES",
        value_delimiter = ',',
        default_value = "idle,broker,database,relay,consumer,latency,sustained"
    )]
    pub phases: Vec<Phase>,
    /// Directory of the producer, relay and consumer binaries [default: this binary's directory].
    #[arg(long, env = "PIPELINE_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Partitions of every topic the benchmark creates.
    #[arg(long, env = "BENCH_PARTITIONS", default_value_t = 12)]
    pub partitions: i32,
    /// Products orders are spread over (sku-00001…), in the catalogue and the stock.
    #[arg(long, env = "BENCH_PRODUCTS", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(3..=99_999))]
    pub products: u32,
    /// Messages the plain producer writes and the plain consumer reads back [200000; quick 20000].
    #[arg(long, env = "BENCH_BROKER_MESSAGES")]
    pub broker_messages: Option<u64>,
    /// Outbox events preloaded for the relay and consumer drains [200000; quick 20000].
    #[arg(long, env = "BENCH_BACKLOG")]
    pub backlog: Option<u64>,
    /// `relay run --batch-size`.
    #[arg(long, env = "BENCH_RELAY_BATCH_SIZE", default_value_t = 5000)]
    pub relay_batch_size: u32,
    /// `relay run --linger`, in milliseconds (also the plain producer's linger.ms).
    #[arg(long, env = "BENCH_RELAY_LINGER_MS", default_value_t = 1)]
    pub relay_linger_ms: u64,
    /// `relay run --poll-interval`, in milliseconds.
    #[arg(long, env = "BENCH_RELAY_POLL_INTERVAL_MS", default_value_t = 5)]
    pub relay_poll_interval_ms: u64,
    /// `relay run --source`: where the relay reads new events, `queue` or `wal` (the
    /// write-ahead log, from a replication slot of each phase's database).
    #[arg(long, env = "BENCH_RELAY_SOURCE", default_value = "queue",
          value_parser = ["queue", "wal"])]
    pub relay_source: String,
    /// `consumer run --max-batch` of the default mode (the per-message mode uses 1).
    #[arg(long, env = "BENCH_CONSUMER_MAX_BATCH", default_value_t = 500)]
    pub consumer_max_batch: u32,
    /// Longest a batched consumer drain runs; the rate is then taken over what it did
    /// [300; quick 60].
    #[arg(long, env = "BENCH_CONSUMER_MAX_SECONDS")]
    pub consumer_max_seconds: Option<u64>,
    /// Longest a per-message consumer drain runs; the rate is then taken over what it did
    /// [60; quick 15].
    #[arg(long, env = "BENCH_PER_MESSAGE_MAX_SECONDS")]
    pub per_message_max_seconds: Option<u64>,
    /// Open-loop request rates (events/s) of the latency phase, comma separated.
    #[arg(
        long,
        env = "BENCH_RATES",
        value_delimiter = ',',
        default_value = "100,500,1000,2000"
    )]
    pub rates: Vec<f64>,
    /// Measured seconds of the idle phase [60; quick 15].
    #[arg(long, env = "BENCH_IDLE_SECONDS")]
    pub idle_seconds: Option<u64>,
    /// Measured seconds at each latency rate [25; quick 8].
    #[arg(long, env = "BENCH_RATE_SECONDS")]
    pub rate_seconds: Option<u64>,
    /// Unmeasured seconds before each latency run and sustain step [5; quick 2].
    #[arg(long, env = "BENCH_WARMUP_SECONDS")]
    pub warmup_seconds: Option<u64>,
    /// Rates (events/s) the sustained phase steps through, ascending; it stops at the first
    /// step the pipeline does not hold.
    #[arg(
        long,
        env = "BENCH_SUSTAIN_RATES",
        value_delimiter = ',',
        default_value = "2000,3000,4000,5000,6000,7000,8000"
    )]
    pub sustain_rates: Vec<f64>,
    /// Seconds each sustained step lasts [60; quick 15].
    #[arg(long, env = "BENCH_SUSTAIN_SECONDS")]
    pub sustain_seconds: Option<u64>,
    /// Seconds of events the outbox backlog and each group's lag may hold at the end of a step.
    #[arg(long, env = "BENCH_LAG_BOUND_SECONDS", default_value_t = 2.0)]
    pub lag_bound_seconds: f64,
    /// Most order-service requests in flight; beyond it the driver falls behind its timetable
    /// (which the timetable lag shows).
    #[arg(long, env = "BENCH_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: usize,
    /// Delayed events waiting a day ahead while the delayed phase times the claim
    /// [1000000; quick 100000].
    #[arg(long, env = "BENCH_DELAYED_EVENTS")]
    pub delayed_events: Option<u64>,
    /// Longest wait for a drain (outbox empty, lag zero) before the phase fails.
    #[arg(long, env = "BENCH_DRAIN_TIMEOUT_SECONDS", default_value_t = 600)]
    pub drain_timeout_seconds: u64,
    /// Published and consumed events three days old loaded in bulk before the retention phase
    /// [10000000; quick 1000000].
    #[arg(long, env = "BENCH_RETENTION_HISTORY_EVENTS")]
    pub retention_history_events: Option<u64>,
    /// Seconds of load with retention off before the baseline is measured, so that it starts
    /// after the writes and cache misses that follow the bulk load [120; quick 30; 0: none].
    #[arg(long, env = "BENCH_RETENTION_SETTLE_SECONDS")]
    pub retention_settle_seconds: Option<u64>,
    /// Seconds of load with retention off, the retention phase's baseline [300; quick 120].
    #[arg(long, env = "BENCH_RETENTION_OFF_SECONDS")]
    pub retention_off_seconds: Option<u64>,
    /// Seconds of load with retention on [600; quick 240].
    #[arg(long, env = "BENCH_RETENTION_ON_SECONDS")]
    pub retention_on_seconds: Option<u64>,
    /// Events the retention phase lets pile up for each consumer drain [100000; quick 20000].
    #[arg(long, env = "BENCH_RETENTION_DRAIN_EVENTS")]
    pub retention_drain_events: Option<u64>,
    /// Request rate (events/s) of the retention phase's load.
    #[arg(long, env = "BENCH_RETENTION_RATE", default_value_t = 1000.0)]
    pub retention_rate: f64,
    /// Age past which retention removes rows in the retention phase (every window but
    /// progress, which keeps its default).
    #[arg(long, env = "BENCH_RETENTION_WINDOW_SECONDS", default_value_t = 120)]
    pub retention_window_seconds: u64,
    /// How often the relay and the consumer run retention in the retention phase.
    #[arg(long, env = "BENCH_RETENTION_INTERVAL_SECONDS", default_value_t = 10)]
    pub retention_interval_seconds: u64,
    /// PostgreSQL's server log, read for lock waits [default: the server's current log file,
    /// else Debian's /var/log/postgresql/postgresql-VERSION-CLUSTER.log].
    #[arg(long, env = "BENCH_SERVER_LOG")]
    pub server_log: Option<PathBuf>,
}

/// A phase of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Every service running, no traffic: the pipeline's fixed cost.
    Idle,
    /// Plain producer and consumer: the broker's ceiling.
    Broker,
    /// PostgreSQL alone: one-row commits and batched inserts, the database's ceiling.
    Database,
    /// The relay draining a preloaded outbox.
    Relay,
    /// Each consumer group draining the relay's topic, batched and one message at a time.
    Consumer,
    /// End-to-end latency at fixed open-loop rates.
    Latency,
    /// The highest rate the whole pipeline holds.
    Sustained,
    /// The relay's claim and release with many delayed events waiting (not in the default run).
    Delayed,
    /// Retention of old rows under steady load, over a large history (not in the default run).
    Retention,
    /// What each source of the relay costs PostgreSQL, the writers' own cost taken out, at each
    /// rate of --rates (not in the default run; the write-ahead log's pass runs it).
    RelayCost,
}

/// Resolved settings: every size and duration decided.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub out: PathBuf,
    pub quick: bool,
    pub keep: bool,
    /// Where CPU profiles go; `None`: none taken.
    pub cpu_profiles: Option<PathBuf>,
    pub phases: Vec<Phase>,
    pub bin_dir: PathBuf,
    pub partitions: i32,
    pub products: u32,
    /// Available quantity stocked per product: large enough that no order is short.
    pub stock: i32,
    pub broker_messages: u64,
    pub backlog: u64,
    pub relay_batch_size: u32,
    pub relay_linger_ms: u64,
    pub relay_poll_interval_ms: u64,
    pub relay_source: String,
    pub consumer_max_batch: u32,
    #[serde(serialize_with = "as_seconds")]
    pub consumer_max: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub per_message_max: Duration,
    pub rates: Vec<f64>,
    #[serde(serialize_with = "as_seconds")]
    pub rate_duration: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub idle_duration: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub warmup: Duration,
    pub sustain_rates: Vec<f64>,
    #[serde(serialize_with = "as_seconds")]
    pub sustain_duration: Duration,
    pub lag_bound_seconds: f64,
    pub max_in_flight: usize,
    #[serde(serialize_with = "as_seconds")]
    pub drain_timeout: Duration,
    pub delayed_events: i64,
    pub retention: RetentionSettings,
}

/// The retention phase's sizes and durations.
#[derive(Debug, Clone, Serialize)]
pub struct RetentionSettings {
    pub history_events: i64,
    #[serde(serialize_with = "as_seconds")]
    pub settle_duration: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub off_duration: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub on_duration: Duration,
    pub drain_events: u64,
    pub rate: f64,
    #[serde(serialize_with = "as_seconds")]
    pub window: Duration,
    #[serde(serialize_with = "as_seconds")]
    pub interval: Duration,
    pub server_log: Option<PathBuf>,
}

impl Settings {
    /// Fills in the full or quick defaults and checks the values.
    pub fn resolve(args: BenchArgs) -> anyhow::Result<Settings> {
        let quick = args.quick;
        let pick =
            |v: Option<u64>, full: u64, short: u64| v.unwrap_or(if quick { short } else { full });
        let secs =
            |v: Option<u64>, full: u64, short: u64| Duration::from_secs(pick(v, full, short));
        let bin_dir = match args.bin_dir {
            Some(dir) => dir,
            None => std::env::current_exe()
                .context("locating the bench executable")?
                .parent()
                .context("the bench executable has no directory")?
                .to_path_buf(),
        };
        let settings = Settings {
            out: args.out,
            quick,
            keep: args.keep,
            cpu_profiles: (!args.no_cpu_profiles).then_some(args.cpu_profiles),
            phases: args.phases,
            bin_dir,
            partitions: args.partitions,
            products: args.products,
            stock: 1_000_000_000,
            broker_messages: pick(args.broker_messages, 200_000, 20_000),
            backlog: pick(args.backlog, 200_000, 20_000),
            relay_batch_size: args.relay_batch_size,
            relay_linger_ms: args.relay_linger_ms,
            relay_source: args.relay_source,
            relay_poll_interval_ms: args.relay_poll_interval_ms,
            consumer_max_batch: args.consumer_max_batch,
            consumer_max: secs(args.consumer_max_seconds, 300, 60),
            per_message_max: secs(args.per_message_max_seconds, 60, 15),
            rates: args.rates,
            rate_duration: secs(args.rate_seconds, 25, 8),
            idle_duration: secs(args.idle_seconds, 60, 15),
            warmup: secs(args.warmup_seconds, 5, 2),
            sustain_rates: args.sustain_rates,
            sustain_duration: secs(args.sustain_seconds, 60, 15),
            lag_bound_seconds: args.lag_bound_seconds,
            max_in_flight: args.max_in_flight,
            drain_timeout: Duration::from_secs(args.drain_timeout_seconds),
            delayed_events: i64::try_from(pick(args.delayed_events, 1_000_000, 100_000))?,
            retention: RetentionSettings {
                history_events: i64::try_from(pick(
                    args.retention_history_events,
                    10_000_000,
                    1_000_000,
                ))?,
                settle_duration: secs(args.retention_settle_seconds, 120, 30),
                off_duration: secs(args.retention_off_seconds, 300, 120),
                on_duration: secs(args.retention_on_seconds, 600, 240),
                drain_events: pick(args.retention_drain_events, 100_000, 20_000),
                rate: args.retention_rate,
                window: Duration::from_secs(args.retention_window_seconds),
                interval: Duration::from_secs(args.retention_interval_seconds),
                server_log: args.server_log,
            },
        };
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> anyhow::Result<()> {
        ensure!(self.partitions > 0, "--partitions must be positive");
        ensure!(
            self.broker_messages > 0,
            "--broker-messages must be positive"
        );
        ensure!(self.backlog >= 3, "--backlog must be at least 3 events");
        ensure!(
            self.relay_batch_size > 0,
            "--relay-batch-size must be positive"
        );
        ensure!(
            self.consumer_max_batch > 0,
            "--consumer-max-batch must be positive"
        );
        ensure!(self.max_in_flight > 0, "--max-in-flight must be positive");
        let r = &self.retention;
        ensure!(
            r.history_events >= 5,
            "--retention-history-events must be at least 5"
        );
        ensure!(
            r.off_duration >= Duration::from_secs(10) && r.on_duration >= Duration::from_secs(10),
            "--retention-off-seconds and --retention-on-seconds must be at least 10"
        );
        ensure!(
            r.drain_events > 0,
            "--retention-drain-events must be positive"
        );
        ensure!(
            r.window >= Duration::from_secs(1) && r.interval >= Duration::from_secs(1),
            "--retention-window-seconds and --retention-interval-seconds must be at least 1"
        );
        let rates = self
            .rates
            .iter()
            .chain(&self.sustain_rates)
            .chain(std::iter::once(&r.rate));
        for &rate in rates {
            ensure!(
                rate.is_finite() && rate > 0.0,
                "rates must be positive, got {rate}"
            );
        }
        ensure!(
            self.sustain_rates.windows(2).all(|w| w[0] < w[1]),
            "--sustain-rates must be ascending"
        );
        ensure!(
            self.sustain_duration >= Duration::from_secs(4),
            "--sustain-seconds must be at least 4"
        );
        ensure!(
            self.lag_bound_seconds > 0.0,
            "--lag-bound-seconds must be positive"
        );
        Ok(())
    }

    /// Whether `phase` was asked for.
    pub fn runs(&self, phase: Phase) -> bool {
        self.phases.contains(&phase)
    }
}

/// Durations as seconds in the report.
fn as_seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}
