//! `load`: drives the order service over HTTP and prints a summary; exits non-zero if any order
//! failed.

use std::process::ExitCode;

use clap::Parser;
use pipeline_core::telemetry;
use pipeline_load::LoadArgs;

#[tokio::main]
async fn main() -> ExitCode {
    let args = LoadArgs::parse();
    telemetry::init(&args.log);
    let shutdown = telemetry::shutdown_on_signals();
    match pipeline_load::run(args, shutdown).await {
        Ok(summary) if summary.succeeded() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "load failed");
            ExitCode::FAILURE
        }
    }
}
