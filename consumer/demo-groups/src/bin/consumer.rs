//! The demonstration's consumer: runs its groups (inventory, notification, export), seeds the
//! inventory's stock, and reports what a run did.

use std::sync::Arc;

use demo_groups::cli::{Cli, Command, RunCommand};
use demo_groups::export::check_runs_alone;
use demo_groups::inventory::seed_stock;
use demo_groups::notification::{DispatchSettings, LoggingSender};
use pipeline_core::{db, ops_http, telemetry};
use prometheus::Registry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    telemetry::init(&cli.log);
    #[cfg(feature = "fault-injection")]
    pipeline_core::crash_point::arm_from_env();
    match cli.command {
        Command::Run(command) => run(*command).await,
        Command::SeedStock {
            db,
            products,
            quantity,
        } => {
            let pool = db.connect(&demo_groups::SCHEMA).await?;
            seed_stock(&pool, products, quantity).await?;
            println!("stocked {products} products with {quantity} each");
            Ok(())
        }
        Command::Report(args) => demo_groups::report::run(*args).await,
    }
}

/// `consumer run`: the groups on a pool of the runtime's sessions, their metrics served on the
/// ops endpoint once they have started.
async fn run(command: RunCommand) -> anyhow::Result<()> {
    let RunCommand {
        db,
        metrics_listen,
        run: settings,
        notification_sends_per_second,
        export,
    } = command;
    settings.validate()?;
    check_runs_alone(&settings.groups, &settings.topics)?;
    let dispatch = DispatchSettings {
        sends_per_second: notification_sends_per_second,
        ..DispatchSettings::default()
    };
    tracing::info!(?db, ?settings, ?dispatch, ?export, "starting consumer");
    let groups = demo_groups::groups(Arc::new(LoggingSender), dispatch, export)?;
    let pool = consumer::connect(&db, &settings).await?;
    if db.migrate {
        db::migrate(&pool, &demo_groups::SCHEMA).await?;
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
        registry,
        &pool,
        &kafka,
        shutdown,
    )
    .await?;
    runtime.wait().await
}
