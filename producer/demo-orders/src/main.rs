//! `producer`: the order service, its catalogue seed and its load driver.

use std::process::ExitCode;

use clap::Parser;
use pipeline_core::telemetry;
use demo_orders::cli::{self, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_args());
    let shutdown = telemetry::shutdown_on_signals();
    match cli::run(cli, shutdown).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "producer failed");
            ExitCode::FAILURE
        }
    }
}
