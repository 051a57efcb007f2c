use std::sync::Arc;

use consumer::config::{Cli, Command};
use consumer::notification::LoggingSender;
use pipeline_core::telemetry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    telemetry::init(&cli.log);
    match cli.command {
        Command::Run(args) => {
            tracing::info!(?args, "starting consumer");
            let groups = consumer::demo_groups(Arc::new(LoggingSender));
            consumer::run(*args, &groups, telemetry::shutdown_on_signals()).await
        }
        Command::SeedStock {
            db,
            products,
            quantity,
        } => {
            let pool = db.connect(&consumer::SCHEMA).await?;
            consumer::seed_stock(&pool, products, quantity).await?;
            println!("stocked {products} products with {quantity} each");
            Ok(())
        }
        Command::Report(args) => {
            // Reads only: it changes no table, migrations included.
            let pool = args.db.connect(&[]).await?;
            let groups: Vec<(String, String)> = args
                .groups
                .iter()
                .map(|g| {
                    let id = format!("{}{g}", args.group_prefix);
                    (id.clone(), id)
                })
                .collect();
            let report = consumer::report::build(&pool, &args.kafka, &groups, &args.topics).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
            Ok(())
        }
    }
}
