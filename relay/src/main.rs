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
            // What acks=all is worth on each topic, said where the topics are set up.
            for topic in &topics {
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
    }
}
