//! Command line of the demonstration's `consumer` binary; every flag also reads an environment
//! variable.

use std::net::SocketAddr;
use std::num::NonZeroU32;

use clap::{Parser, Subcommand};
use consumer::ConsumerSettings;
use demo_events::order_events::ORDER_EVENTS_TOPIC;
use pipeline_core::db::DbArgs;
use pipeline_core::kafka::KafkaArgs;
use pipeline_core::telemetry::LogArgs;

use crate::export::ExportSettings;

/// Applies order events exactly once, in order per order, for one or more consumer groups.
#[derive(Debug, Parser)]
#[command(name = "consumer", version)]
pub struct Cli {
    /// Log format and filter.
    #[command(flatten)]
    pub log: LogArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of the `consumer` binary.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run consumer groups until SIGTERM or SIGINT.
    Run(Box<RunCommand>),
    /// Set the inventory's stock of the demonstration catalogue.
    SeedStock {
        /// The database holding the inventory's stock.
        #[command(flatten)]
        db: DbArgs,
        /// Products sku-00001… to stock.
        #[arg(long, env = "CATALOG_PRODUCTS", default_value_t = 100)]
        products: u32,
        /// Available quantity of each.
        #[arg(long, env = "STOCK_QUANTITY", default_value_t = 1_000_000)]
        quantity: i32,
    },
    /// Print what the pipeline did: orders, outbox, processed per group, lag.
    Report(Box<ReportArgs>),
}

/// Arguments of `consumer run`: the groups' database and ops endpoint, the runtime's settings,
/// the notification dispatcher's send limit and the settings of the `export` group (each used
/// when its group is one of the groups run).
#[derive(Debug, clap::Args)]
pub struct RunCommand {
    /// The groups' database (with `--migrate`, the consumer library's tables and the groups'
    /// are applied at start-up).
    #[command(flatten)]
    pub db: DbArgs,
    /// Address of the /metrics, /healthz and /readyz endpoint (port 0 picks one).
    #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9102")]
    pub metrics_listen: SocketAddr,
    /// The bounds the ops endpoint holds its clients to.
    #[command(flatten)]
    pub http: pipeline_core::http_server::ServerLimits,
    /// What `consumer::run` takes.
    #[command(flatten)]
    pub run: ConsumerSettings,
    /// Most calls per second the `notification` group's dispatcher makes to its sender (in each
    /// process running the group); notifications wait in their table meanwhile. None given: as
    /// fast as the sender answers.
    #[arg(
        long,
        env = "NOTIFICATION_SENDS_PER_SECOND",
        value_name = "N",
        value_parser = parse_sends_per_second
    )]
    pub notification_sends_per_second: Option<NonZeroU32>,
    /// The `export` group's directory, lease, retries and expiry.
    #[command(flatten)]
    pub export: ExportSettings,
}

/// A whole number of sends per second, from 1.
fn parse_sends_per_second(s: &str) -> Result<NonZeroU32, String> {
    match s.trim().parse::<i64>() {
        Ok(0) => Err(
            "a limit of zero would send nothing; to send without a limit, leave the \
                      flag out"
                .to_owned(),
        ),
        Ok(n) if n < 0 => Err("a limit cannot be negative".to_owned()),
        Ok(n) => u32::try_from(n)
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| format!("{n} sends a second is too many for a limit")),
        Err(_) => Err(format!("`{s}` is not a whole number of sends a second")),
    }
}

/// Arguments of `consumer report`.
#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The pipeline's database.
    #[command(flatten)]
    pub db: DbArgs,
    /// Kafka, for the groups' lag.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Group to report, repeatable: any group name.
    #[arg(
        long = "group",
        env = "CONSUMER_GROUPS",
        value_delimiter = ',',
        required = true
    )]
    pub groups: Vec<String>,
    /// Prefix of the Kafka group ids, as given to `run`.
    #[arg(long, env = "CONSUMER_GROUP_PREFIX", default_value = "")]
    pub group_prefix: String,
    /// Topics whose lag to report.
    #[arg(long = "topic", env = "CONSUMER_TOPICS", value_delimiter = ',', default_value = ORDER_EVENTS_TOPIC)]
    pub topics: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}
