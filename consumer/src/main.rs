use std::sync::Arc;

use consumer::config::{Cli, Command, RunCommand};
use consumer::handlers::inventory::seed_stock;
use consumer::handlers::notification::LoggingSender;
use consumer::operator;
use pipeline_core::telemetry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    telemetry::init(&cli.log);
    match cli.command {
        Command::Run(command) => {
            let RunCommand { run: args, export } = *command;
            consumer::handlers::export::check_runs_alone(&args.groups, &args.topics)?;
            tracing::info!(?args, ?export, "starting consumer");
            let groups =
                consumer::export_group(consumer::demo_groups(Arc::new(LoggingSender)), export)?;
            consumer::run(args, &groups, telemetry::shutdown_on_signals()).await
        }
        Command::SeedStock {
            db,
            products,
            quantity,
        } => {
            let pool = db.connect(&consumer::SCHEMA).await?;
            seed_stock(&pool, products, quantity).await?;
            println!("stocked {products} products with {quantity} each");
            Ok(())
        }
        Command::Report(args) => operator::report::run(*args).await,
    }
}
