//! The `consumer` command: runs the demonstration's groups (inventory, notification, export),
//! seeds the inventory's stock, and reports what a run did. The `consumer` binary calls [`main`];
//! the verification run's crash-point binary calls [`main_with_crash_points`].

use std::sync::Arc;

use anyhow::Context;
use pipeline_core::{db, ops_http, telemetry};
use prometheus::Registry;

use crate::cli::{Cli, Command, RunCommand};
use crate::export::check_runs_alone;
use crate::inventory::seed_stock;
use crate::notification::{DispatchSettings, LoggingSender};

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
    let cli = <Cli as clap::Parser>::parse();
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
        Command::Run(command) => run(*command).await,
        Command::SeedStock {
            db,
            products,
            quantity,
        } => {
            let pool = db.connect(&crate::SCHEMA).await?;
            seed_stock(&pool, products, quantity).await?;
            println!("stocked {products} products with {quantity} each");
            Ok(())
        }
        Command::Report(args) => crate::report::run(*args).await,
    }
}

/// How long start-up waits for the Kafka cluster to accept or refuse the credentials (a cluster
/// that does not answer by then is waited for as usual).
const KAFKA_ACCESS_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// `consumer run`: the groups on a pool of the runtime's sessions, their metrics served on the
/// ops endpoint once they have started.
async fn run(command: RunCommand) -> anyhow::Result<()> {
    let RunCommand {
        db,
        metrics_listen,
        http,
        run: settings,
        notification_sends_per_second,
        export,
    } = command;
    settings.validate()?;
    check_runs_alone(&settings.groups, &settings.topics)?;
    export.validate()?;
    // Credentials the brokers refuse stop the process with their reason.
    settings.kafka.check_access(KAFKA_ACCESS_CHECK).await?;
    let dispatch = DispatchSettings {
        sends_per_second: notification_sends_per_second,
        ..DispatchSettings::default()
    };
    tracing::info!(?db, ?settings, ?dispatch, ?export, "starting consumer");
    let groups = crate::groups(Arc::new(LoggingSender), dispatch, export)?;
    let pool = consumer::connect(&db, &settings).await?;
    if db.migrate {
        db::migrate(&pool, &crate::SCHEMA).await?;
    }
    let registry = Registry::new();
    let shutdown = telemetry::shutdown_on_signals();
    let kafka = settings.kafka.clone();
    let runtime =
        consumer::Runtime::start(settings, pool.clone(), &registry, &groups, shutdown.clone())
            .await?;
    ops_http::serve_worker(
        "consumer",
        metrics_listen,
        &http,
        registry,
        &pool,
        &kafka,
        shutdown,
    )
    .await?;
    Ok(runtime.wait().await?)
}
