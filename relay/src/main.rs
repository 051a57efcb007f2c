use clap::Parser;
use pipeline_core::telemetry;
use relay::config::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(&cli.log);
    match cli.command {
        Command::Run(args) => {
            tracing::info!(?args, "starting relay");
            relay::run(*args, telemetry::shutdown_on_signals()).await
        }
        Command::EnsureTopics {
            kafka,
            topics,
            partitions,
        } => {
            kafka.ensure_topics(&topics, partitions).await?;
            println!("topics ready: {}", topics.join(", "));
            Ok(())
        }
    }
}
