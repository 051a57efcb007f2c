//! `producer load`: drives the order service over HTTP with a deterministic mix of orders.
//!
//! Open loop: order `i` starts at `i / rate` seconds whatever the service's speed, unless
//! `concurrency` orders are already in flight. Each order is placed (with an idempotency key),
//! then either cancelled unpaid (~10%), or paid and then shipped (~80%) or cancelled (~20%).

mod client;
mod plan;
mod summary;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pipeline_core::telemetry::LogArgs;
use reqwest::Url;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use client::{OrderClient, RequestFailure, RequestStats};
pub use plan::{Fate, OrderPlan};
pub use summary::{OrderOutcome, Summary, Tally};

/// `producer load`: place and move orders through the order service.
#[derive(clap::Args, Debug, Clone)]
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
    /// Timeout of each HTTP attempt, in milliseconds.
    #[arg(long, env = "LOAD_REQUEST_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_ms: u64,
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
    tracing::info!(url = %args.url, orders = args.orders, rate = args.rate, seed, "starting load");
    let client = OrderClient::new(
        args.url.clone(),
        Duration::from_millis(args.request_timeout_ms),
        args.max_retries,
    )
    .context("building the HTTP client")?;
    let progress = progress_bar(args.orders);
    let started = Instant::now();
    let tally = drive(&args, &client, seed, &progress, &shutdown).await;
    progress.finish_and_clear();
    let summary = tally.summary(args.orders, started.elapsed(), seed);
    println!("{summary}");
    if let Some(path) = &args.summary_json {
        summary.write_json(path)?;
    }
    Ok(summary)
}

/// Starts the orders on schedule and collects their outcomes.
async fn drive(
    args: &LoadArgs,
    client: &OrderClient,
    seed: u64,
    progress: &ProgressBar,
    shutdown: &CancellationToken,
) -> Tally {
    // Keys unique to this run: rerunning a seed must place new orders, not replay old ones.
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let slots = Arc::new(Semaphore::new(args.concurrency as usize));
    let mut in_flight = JoinSet::new();
    let mut tally = Tally::new();
    let started = Instant::now();
    for index in 0..args.orders {
        if args.rate > 0.0 {
            let due = started + Duration::from_secs_f64(index as f64 / args.rate);
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                () = shutdown.cancelled() => break,
            }
        }
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot,
            () = shutdown.cancelled() => break,
        };
        // Closed only if dropped, and `slots` lives until the end of this function.
        let Ok(slot) = slot else { break };
        while let Some(done) = in_flight.try_join_next() {
            record(&mut tally, progress, done);
        }
        let plan = OrderPlan::generate(seed, index, args.products);
        let client = client.clone();
        let key = format!("load-{run_id}-{index}");
        let _ = in_flight.spawn(async move {
            let outcome = run_order(&client, &plan, &key).await;
            drop(slot);
            outcome
        });
    }
    if shutdown.is_cancelled() {
        tracing::warn!("interrupted: finishing the orders in flight");
    }
    while let Some(done) = in_flight.join_next().await {
        record(&mut tally, progress, done);
    }
    tally
}

fn record(
    tally: &mut Tally,
    progress: &ProgressBar,
    done: Result<OrderOutcome, tokio::task::JoinError>,
) {
    match done {
        Ok(outcome) => tally.add(outcome),
        Err(e) => {
            tracing::error!(error = %e, "order task failed");
            tally.add(OrderOutcome::default());
        }
    }
    progress.set_position(tally.attempted());
}

/// Places one order and takes it through its planned actions, stopping at the first failure.
pub async fn run_order(client: &OrderClient, plan: &OrderPlan, key: &str) -> OrderOutcome {
    let mut outcome = OrderOutcome::default();
    let order = match client.place(&plan.request, key, &mut outcome.stats).await {
        Ok(order) => order,
        Err(e) => {
            outcome.failure = Some(e);
            return outcome;
        }
    };
    outcome.created = true;
    outcome.events = 1;
    for &action in plan.fate.actions() {
        match client.act(order.order_id, action, &mut outcome.stats).await {
            Ok(_) => outcome.events += 1,
            Err(e) => {
                outcome.failure = Some(e);
                break;
            }
        }
    }
    outcome
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
    use super::parse_rate;

    #[test]
    fn rate_must_be_non_negative() {
        assert_eq!(parse_rate("0"), Ok(0.0));
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert!(parse_rate("-1").is_err());
        assert!(parse_rate("inf").is_err());
        assert!(parse_rate("x").is_err());
    }
}
