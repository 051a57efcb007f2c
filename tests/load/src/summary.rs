//! The `load` command's figures: the tally of a run, and its summary on stdout and optionally as
//! JSON.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::figures::{max_ms, micros_histogram, per_second, quantile_ms};
use crate::record::{Recorder, StepRecord};

/// Running totals of a load run.
#[derive(Debug)]
pub struct Tally {
    attempted: u64,
    created: u64,
    events: u64,
    failed_orders: u64,
    retries: u64,
    errors_by_status: BTreeMap<String, u64>,
    latency_us: Histogram<u64>,
}

impl Default for Tally {
    fn default() -> Self {
        Self::new()
    }
}

impl Tally {
    /// An empty tally.
    pub fn new() -> Self {
        Self {
            attempted: 0,
            created: 0,
            events: 0,
            failed_orders: 0,
            retries: 0,
            errors_by_status: BTreeMap::new(),
            latency_us: micros_histogram(),
        }
    }

    /// Orders started so far.
    pub fn attempted(&self) -> u64 {
        self.attempted
    }

    /// The summary of the run so far.
    pub fn summary(&self, planned: u64, elapsed: Duration, seed: u64) -> Summary {
        let seconds = elapsed.as_secs_f64();
        let ms = |q: f64| quantile_ms(&self.latency_us, q);
        Summary {
            orders: self.created,
            events: self.events,
            errors: self.errors_by_status.values().sum(),
            elapsed_seconds: seconds,
            planned_orders: planned,
            attempted_orders: self.attempted,
            failed_orders: self.failed_orders,
            retries: self.retries,
            errors_by_status: self.errors_by_status.clone(),
            orders_per_second: per_second(self.created, seconds),
            events_per_second: per_second(self.events, seconds),
            latency_ms: Latency {
                p50: ms(0.50),
                p90: ms(0.90),
                p99: ms(0.99),
                max: max_ms(&self.latency_us),
            },
            seed,
        }
    }
}

impl Recorder for Tally {
    /// Counts the order when it is placed, each step that went through as an event, and the
    /// step that failed (an order stops at its first failure) as the order's failure.
    fn record(&mut self, step: StepRecord) {
        if step.sequence == 1 {
            self.attempted += 1;
            self.created += u64::from(step.outcome.is_ok());
        }
        self.retries += step.stats.retries;
        for us in step.stats.latencies_us {
            self.latency_us.saturating_record(us.max(1));
        }
        match step.outcome {
            Ok(()) => self.events += 1,
            Err(failure) => {
                tracing::warn!(error = %failure, "order failed");
                self.failed_orders += 1;
                *self.errors_by_status.entry(failure.label()).or_default() += 1;
            }
        }
    }
}

/// Request latency percentiles, in milliseconds, over every attempt.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// The result of a load run. `orders`, `events`, `errors` and `elapsed_seconds` are what
/// scripts compare against the pipeline's output.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Orders placed.
    pub orders: u64,
    /// State changes the service confirmed, placing included: the events the outbox should hold.
    pub events: u64,
    /// Requests that failed for good (after retries).
    pub errors: u64,
    pub elapsed_seconds: f64,
    pub planned_orders: u64,
    pub attempted_orders: u64,
    pub failed_orders: u64,
    /// Attempts repeated after a 5xx or a lost connection.
    pub retries: u64,
    /// Requests that failed for good, by status code (or `timeout`, `connect`, `transport`).
    pub errors_by_status: BTreeMap<String, u64>,
    pub orders_per_second: f64,
    pub events_per_second: f64,
    pub latency_ms: Latency,
    /// The seed of the order mix: rerun with `--seed` to get the same mix.
    pub seed: u64,
}

impl Summary {
    /// Whether every planned order went through every step.
    pub fn succeeded(&self) -> bool {
        self.failed_orders == 0 && self.attempted_orders == self.planned_orders
    }

    /// Writes the summary as JSON to `path`.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self).context("serialising the summary")?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "orders created:   {} of {} planned",
            self.orders, self.planned_orders
        )?;
        writeln!(f, "events expected:  {}", self.events)?;
        writeln!(f, "failed orders:    {}", self.failed_orders)?;
        write!(f, "http errors:      {}", self.errors)?;
        for (status, n) in &self.errors_by_status {
            write!(f, " [{status}: {n}]")?;
        }
        writeln!(f)?;
        writeln!(f, "retries:          {}", self.retries)?;
        writeln!(f, "elapsed:          {:.2} s", self.elapsed_seconds)?;
        writeln!(
            f,
            "rate:             {:.1} orders/s, {:.1} events/s",
            self.orders_per_second, self.events_per_second
        )?;
        writeln!(
            f,
            "latency:          p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            self.latency_ms.p50, self.latency_ms.p90, self.latency_ms.p99, self.latency_ms.max
        )?;
        write!(f, "seed:             {}", self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{RequestFailure, RequestStats};
    use crate::record::StepFailure;
    use tokio::time::Instant;

    fn step(sequence: i64, stats: RequestStats, failure: Option<u16>) -> StepRecord {
        let now = Instant::now();
        StepRecord {
            order: 0,
            order_id: None,
            sequence,
            action: None,
            due: now,
            started: now,
            finished: now,
            stats,
            outcome: match failure {
                None => Ok(()),
                Some(code) => Err(StepFailure::Request(RequestFailure::Status {
                    status: reqwest::StatusCode::from_u16(code).expect("status"),
                    body: String::new(),
                })),
            },
        }
    }

    #[test]
    fn tally_counts_events_failures_and_latency() {
        let mut tally = Tally::new();
        // One order placed, paid and shipped; its placing was retried once.
        let latencies = |us: &[u64]| RequestStats {
            latencies_us: us.to_vec(),
            ..RequestStats::default()
        };
        let mut placing = latencies(&[10_000, 20_000]);
        placing.retries = 1;
        tally.record(step(1, placing, None));
        tally.record(step(2, latencies(&[30_000]), None));
        tally.record(step(3, latencies(&[40_000]), None));
        // One placed, then refused its payment.
        tally.record(step(1, RequestStats::default(), None));
        tally.record(step(2, RequestStats::default(), Some(409)));
        let summary = tally.summary(3, Duration::from_secs(2), 9);
        assert_eq!((summary.orders, summary.events, summary.errors), (2, 4, 1));
        assert_eq!(summary.errors_by_status.get("409"), Some(&1));
        assert_eq!(summary.retries, 1);
        assert!(!summary.succeeded(), "one failed, one never attempted");
        assert!(
            (summary.latency_ms.p50 - 20.0).abs() < 0.1,
            "{:?}",
            summary.latency_ms
        );
        assert!(
            (summary.latency_ms.max - 40.0).abs() < 0.1,
            "{:?}",
            summary.latency_ms
        );
        assert!((summary.orders_per_second - 1.0).abs() < 1e-9);
    }
}
