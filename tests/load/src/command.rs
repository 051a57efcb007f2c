//! The `load` command: the generator over the command line, with the seeded order mix, a progress
//! bar and the summary.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pipeline_core::telemetry::LogArgs;
use reqwest::Url;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::{ClientSettings, OrderClient, RetryPolicy};
use crate::drive::{drive, DriveSettings, OnStop, Pacing};
use crate::plan::OrderPlan;
use crate::record::{Recorder, StepRecord};
use crate::summary::{Summary, Tally};

/// Longest wait for a connection to the service, within each attempt's timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Drive the order service over HTTP and print a summary; exits non-zero if any order failed.
///
/// Every flag can also be set through the environment variable shown in its help.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "load", version, about, long_about = None)]
pub struct LoadArgs {
    /// Base URL of the order service.
    #[arg(
        long,
        env = "ORDER_SERVICE_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub url: Url,
    /// Number of orders to place.
    #[arg(long, env = "LOAD_ORDERS", default_value_t = 1000)]
    pub orders: u64,
    /// Orders started per second (open loop); 0 starts them as fast as concurrency allows.
    #[arg(long, env = "LOAD_RATE", default_value_t = 200.0, value_parser = parse_rate)]
    pub rate: f64,
    /// Most orders in flight at once.
    #[arg(long, env = "LOAD_CONCURRENCY", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub concurrency: u32,
    /// Products to order from: sku-00001 … sku-N (seed the catalogue with at least as many).
    #[arg(long, env = "CATALOG_PRODUCTS", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub products: u32,
    /// Seed of the order mix; the same seed gives the same orders. Random when absent.
    #[arg(long, env = "LOAD_SEED")]
    pub seed: Option<u64>,
    /// Also write the summary as JSON to this file.
    #[arg(long, env = "LOAD_SUMMARY_JSON")]
    pub summary_json: Option<PathBuf>,
    /// Retries of a request after a 5xx or a connection error.
    #[arg(long, env = "LOAD_MAX_RETRIES", default_value_t = 4)]
    pub max_retries: u32,
    /// Timeout of each HTTP attempt.
    #[arg(long, env = "LOAD_REQUEST_TIMEOUT", default_value = "10s",
          value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    #[command(flatten)]
    pub log: LogArgs,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s
        .parse()
        .map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if rate.is_finite() && rate >= 0.0 {
        Ok(rate)
    } else {
        Err(format!("rate must be 0 or a positive number, got {s}"))
    }
}

/// Runs the load described by `args` until done or `shutdown`, then prints the summary on
/// stdout (and to `--summary-json`). Orders in flight at shutdown are finished first.
pub async fn run(args: LoadArgs, shutdown: CancellationToken) -> anyhow::Result<Summary> {
    let seed = args.seed.unwrap_or_else(rand::random);
    anyhow::ensure!(
        !args.request_timeout.is_zero(),
        "--request-timeout must be positive"
    );
    tracing::info!(url = %args.url, orders = args.orders, rate = args.rate, seed, "starting load");
    let client = OrderClient::new(
        args.url.clone(),
        ClientSettings {
            request_timeout: args.request_timeout,
            connect_timeout: CONNECT_TIMEOUT,
            retry: RetryPolicy::attempts(args.max_retries),
        },
    )
    .context("building the HTTP client")?;
    let settings = DriveSettings {
        pacing: Pacing::Orders {
            rate: args.rate,
            orders: Some(args.orders),
            max_catch_up: None,
        },
        concurrency: args.concurrency as usize,
        key_prefix: "load".to_owned(),
        on_stop: OnStop::Finish,
    };
    let mut progress = Progress {
        tally: Tally::new(),
        bar: progress_bar(args.orders),
    };
    let started = Instant::now();
    let products = args.products;
    let _ = drive(
        &client,
        &settings,
        |index| OrderPlan::generate(seed, index, products),
        &mut progress,
        &shutdown,
    )
    .await?;
    progress.bar.finish_and_clear();
    let summary = progress.tally.summary(args.orders, started.elapsed(), seed);
    println!("{summary}");
    if let Some(path) = &args.summary_json {
        summary.write_json(path)?;
    }
    Ok(summary)
}

/// The tally, and a progress bar of the orders started.
struct Progress {
    tally: Tally,
    bar: ProgressBar,
}

impl Recorder for Progress {
    fn record(&mut self, step: StepRecord) {
        self.tally.record(step);
        self.bar.set_position(self.tally.attempted());
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
fn progress_bar(orders: u64) -> ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(orders);
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed_precise} [{wide_bar}] {pos}/{len} orders ({per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::{parse_rate, LoadArgs};
    use clap::{CommandFactory, Parser};

    #[test]
    fn cli_is_well_formed() {
        LoadArgs::command().debug_assert();
    }

    #[test]
    fn parses_the_flags() {
        let args = LoadArgs::parse_from(["load", "--orders", "5", "--rate", "0"]);
        assert!(args.orders == 5 && args.rate == 0.0);
        assert!(LoadArgs::try_parse_from(["load", "--concurrency", "0"]).is_err());
    }

    #[test]
    fn rate_must_be_non_negative() {
        assert_eq!(parse_rate("0"), Ok(0.0));
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert!(parse_rate("-1").is_err());
        assert!(parse_rate("inf").is_err());
        assert!(parse_rate("x").is_err());
    }
}
