//! The `producer` command line: one binary, three subcommands.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pipeline_core::telemetry::LogArgs;
use tokio_util::sync::CancellationToken;

use crate::catalog::{self, SeedCatalogArgs};
use crate::load::{self, LoadArgs};
use crate::server::{self, ServeArgs};

/// The order service of the event pipeline, its catalogue seed and its load driver.
///
/// Every flag can also be set through the environment variable shown in its help.
#[derive(Parser, Debug)]
#[command(name = "producer", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to run.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the order API, /metrics, /healthz and /readyz; orders and their events are
    /// written to PostgreSQL in one transaction.
    Serve(ServeArgs),
    /// Create or update the demonstration products sku-00001 … sku-N (idempotent).
    SeedCatalog(SeedCatalogArgs),
    /// Drive the order service over HTTP and print a summary; exits non-zero if any order failed.
    Load(LoadArgs),
}

impl Cli {
    /// The log settings of the chosen subcommand.
    pub fn log_args(&self) -> &LogArgs {
        match &self.command {
            Command::Serve(args) => &args.log,
            Command::SeedCatalog(args) => &args.log,
            Command::Load(args) => &args.log,
        }
    }
}

/// Runs the chosen subcommand until it is done or `shutdown` is cancelled.
pub async fn run(cli: Cli, shutdown: CancellationToken) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => server::run(args, shutdown).await?,
        Command::SeedCatalog(args) => catalog::run(args).await?,
        Command::Load(args) => {
            let summary = load::run(args, shutdown).await?;
            if !summary.succeeded() {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_each_subcommand() {
        let cli = Cli::parse_from(["producer", "serve", "--listen", "127.0.0.1:0"]);
        let Command::Serve(args) = cli.command else {
            panic!("expected serve")
        };
        assert_eq!(args.listen.port(), 0);
        assert!(!args.notify_relay);

        let cli = Cli::parse_from(["producer", "seed-catalog", "--products", "7"]);
        assert!(matches!(cli.command, Command::SeedCatalog(a) if a.products == 7));

        let cli = Cli::parse_from(["producer", "load", "--orders", "5", "--rate", "0"]);
        assert!(matches!(cli.command, Command::Load(a) if a.orders == 5 && a.rate == 0.0));
        assert!(Cli::try_parse_from(["producer", "load", "--concurrency", "0"]).is_err());
    }
}
