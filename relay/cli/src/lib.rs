//! The `relay` command line: the relay library behind a command line (every flag also reads an
//! environment variable), with logging, the database pool, the ops endpoint and exit code. The
//! `relay` binary calls [`main`]; the verification run's crash-point binary calls
//! [`main_with_crash_points`].

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};
use pipeline_core::db::{self, DbArgs};
use pipeline_core::http_server::ServerLimits;
use pipeline_core::kafka::KafkaArgs;
use pipeline_core::ops_http;
use pipeline_core::telemetry::{self, LogArgs};
use prometheus::Registry;
use relay::{Relay, RelaySettings};

/// Publishes outbox events to Kafka.
#[derive(Debug, Parser)]
#[command(name = "relay", version, about)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
struct RunArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    relay: RelaySettings,
    /// Address of the /metrics, /healthz and /readyz endpoint (port 0 picks one).
    #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9101")]
    metrics_listen: SocketAddr,
    /// The bounds the ops endpoint holds its clients to.
    #[command(flatten)]
    http: ServerLimits,
}

/// Parses the command line and runs its command.
pub fn main() -> anyhow::Result<()> {
    start(false)
}

/// [`main`], with the libraries' crash points armed from the environment
/// (`pipeline_core::crash_point`): for the verification run's binaries, never for production.
pub fn main_with_crash_points() -> anyhow::Result<()> {
    start(true)
}

fn start(crash_points: bool) -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(&cli.log);
    if crash_points {
        pipeline_core::crash_point::arm_from_env();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(command(cli))
}

async fn command(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(args) => {
            tracing::info!(?args, "starting relay");
            run(*args).await
        }
        Command::EnsureTopics {
            kafka,
            topics,
            partitions,
        } => ensure_topics(&kafka, &topics, partitions).await,
    }
}

/// How long start-up waits for the Kafka cluster to accept or refuse the credentials (a cluster
/// that does not answer by then is waited for as usual).
const KAFKA_ACCESS_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Connects, serves the ops endpoint and runs the relay until SIGINT or SIGTERM.
async fn run(args: RunArgs) -> anyhow::Result<()> {
    let RunArgs {
        db,
        relay: mut settings,
        metrics_listen,
        http,
    } = args;
    if settings.source.replication_url.is_none() {
        settings.source.replication_url = Some(db.database_url.clone());
    }
    settings.validate()?;
    // Credentials the brokers refuse stop the relay with their reason.
    settings.kafka.check_access(KAFKA_ACCESS_CHECK).await?;
    let pool = relay::connect(&db, &settings).await?;
    if db.migrate {
        db::migrate(&pool, &[&relay::MIGRATOR]).await?;
    }
    let shutdown = telemetry::shutdown_on_signals();
    let registry = Registry::new();
    let kafka = settings.kafka.clone();
    let relay = Relay::new(settings, pool.clone(), &registry)?;
    ops_http::serve_worker(
        "relay",
        metrics_listen,
        &http,
        registry,
        &pool,
        &kafka,
        shutdown.clone(),
    )
    .await
    .context("serving the ops endpoint")?;
    let result = relay.run(shutdown.clone()).await;
    shutdown.cancel();
    Ok(result?)
}

/// Creates the topics that do not exist yet and says what acks=all is worth on each.
async fn ensure_topics(
    kafka: &KafkaArgs,
    topics: &[String],
    partitions: i32,
) -> anyhow::Result<()> {
    kafka.check_access(KAFKA_ACCESS_CHECK).await?;
    kafka.ensure_topics(topics, partitions).await?;
    for topic in topics {
        let d = kafka.topic_durability(topic).await?;
        let min_isr = d
            .min_insync_replicas
            .map_or_else(|| "?".to_owned(), |n| n.to_string());
        println!(
            "topic {topic}: {} partitions, replication factor {}, min.insync.replicas {min_isr}",
            d.partitions, d.replication_factor
        );
        for weakness in d.weaknesses() {
            tracing::warn!(%topic, "{weakness}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    /// The run command's arguments from `args` alone: the environment the tests run in (its
    /// DATABASE_URL, KAFKA_BROKERS…) is not read.
    fn run_args(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let command = Cli::command().mut_subcommand("run", |run| run.mut_args(|a| a.env(None)));
        let argv = ["relay", "run"].iter().chain(args);
        let cli = Cli::from_arg_matches(&command.try_get_matches_from(argv)?)?;
        let Command::Run(args) = cli.command else {
            panic!("not the run command");
        };
        Ok(*args)
    }

    /// The command line's defaults are the library's: the relay runs the same whether a program
    /// embeds it with `RelaySettings::default()` or the binary runs without flags.
    #[test]
    fn the_command_line_defaults_are_the_library_defaults() {
        let args = run_args(&[]).expect("the defaults parse");
        assert_eq!(
            format!("{:?}", args.relay),
            format!("{:?}", RelaySettings::default())
        );
        assert_eq!(format!("{:?}", args.db), format!("{:?}", DbArgs::default()));
        args.relay.validate().expect("the defaults are valid");
    }

    #[test]
    fn the_release_step_keeps_its_flags() {
        let args = run_args(&["--release-interval", "50ms", "--release-batch-size", "7"])
            .expect("the arguments parse");
        assert_eq!(
            (args.relay.release_interval, args.relay.release_batch_size),
            (std::time::Duration::from_millis(50), 7)
        );
        assert!(run_args(&["--pipeline-depth", "17"]).is_err());
        // A duration names its unit; one out of range parses and is refused by the settings.
        let error = run_args(&["--lease-ttl", "1000"]).expect_err("no unit");
        assert!(error.to_string().contains("--lease-ttl"), "{error}");
        let short = run_args(&["--lease-ttl", "1s"]).expect("parses");
        assert!(short.relay.validate().is_err());
    }
}
