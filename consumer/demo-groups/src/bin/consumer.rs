//! The demonstration's consumer: runs its groups (inventory, notification, export), seeds the
//! inventory's stock, and reports what a run did.

use std::sync::Arc;

use demo_groups::cli::{Cli, Command, RunCommand};
use demo_groups::export::check_runs_alone;
use demo_groups::inventory::seed_stock;
use demo_groups::notification::LoggingSender;
use pipeline_core::telemetry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    telemetry::init(&cli.log);
    match cli.command {
        Command::Run(command) => {
            let RunCommand { run: args, export } = *command;
            check_runs_alone(&args.groups, &args.topics)?;
            tracing::info!(?args, ?export, "starting consumer");
            let groups = demo_groups::groups(Arc::new(LoggingSender), export)?;
            if args.db.migrate {
                let pool = args.db.connect(&demo_groups::SCHEMA).await?;
                pool.close().await;
            }
            consumer::run(args, &groups, telemetry::shutdown_on_signals()).await
        }
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
