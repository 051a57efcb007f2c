//! `producer`: the order service and its catalogue seed.

use std::process::ExitCode;

use clap::Parser;
use demo_orders::cli::{self, Cli};
use pipeline_core::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_args());
    let shutdown = telemetry::shutdown_on_signals();
    match cli::run(cli, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "producer failed");
            ExitCode::FAILURE
        }
    }
}
