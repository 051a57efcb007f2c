//! The `producer` command line: one binary, two subcommands.

use clap::{Parser, Subcommand};
use pipeline_core::telemetry::LogArgs;
use tokio_util::sync::CancellationToken;

use crate::catalog::{self, SeedCatalogArgs};
use crate::server::{self, ServeArgs};

/// The order service of the event pipeline, and its catalogue seed.
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
    Serve(Box<ServeArgs>),
    /// Create or update the demonstration products sku-00001 … sku-N (idempotent).
    SeedCatalog(SeedCatalogArgs),
}

impl Cli {
    /// The log settings of the chosen subcommand.
    pub fn log_args(&self) -> &LogArgs {
        match &self.command {
            Command::Serve(args) => &args.log,
            Command::SeedCatalog(args) => &args.log,
        }
    }
}

/// Runs the chosen subcommand until it is done or `shutdown` is cancelled.
pub async fn run(cli: Cli, shutdown: CancellationToken) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => server::run(*args, shutdown).await,
        Command::SeedCatalog(args) => catalog::run(args).await,
    }
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
        assert!(
            Cli::try_parse_from(["producer", "load"]).is_err(),
            "load is its own binary"
        );
    }
}
