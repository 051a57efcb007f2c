use std::sync::Arc;

use consumer::handlers::notification::LoggingSender;
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
    let groups = consumer::demo_groups(Arc::new(LoggingSender));
    if let Err(e) = operator::run(cli, &groups).await {
        eprintln!("error: {e:#}");
        std::process::exit(exit_code(&e));
    }
}
