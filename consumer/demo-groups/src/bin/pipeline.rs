//! The operator command with the demonstration's groups registered (inventory, notification,
//! export), so `dead-letters replay` applies their events with their handlers.

use std::sync::Arc;

use demo_groups::export::ExportSettings;
use demo_groups::notification::LoggingSender;
use operator::cli::Cli;
use operator::error::exit_code;
use pipeline_core::telemetry::{self, LogArgs};

#[tokio::main]
async fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // Results go to stdout; only warnings are logged (to stderr) unless RUST_LOG says more.
    telemetry::init(&LogArgs {
        log_json: false,
        log: std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
    });
    let groups = match demo_groups::groups(Arc::new(LoggingSender), ExportSettings::default()) {
        Ok(groups) => groups,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    };
    if let Err(e) = operator::run(cli, &groups).await {
        eprintln!("error: {e:#}");
        std::process::exit(exit_code(&e));
    }
}
