//! The export worker's Prometheus metrics: what became of each attempt, how long a finished
//! export took and how many rows it wrote, what the sweep expired, and the jobs still waiting.

use prometheus::{exponential_buckets, Histogram, HistogramOpts, IntCounter, IntCounterVec};
use prometheus::{Gauge, IntGauge, Opts, Registry};

/// Values of the `outcome` label of `export_jobs_total`.
pub const OUTCOMES: [&str; 4] = ["succeeded", "failed", "retried", "lease_lost"];

/// Metrics of the export worker of this process.
#[derive(Clone)]
pub struct ExportMetrics {
    /// `export_jobs_total`: export attempts by outcome (see [`OUTCOMES`]): a finished file, a
    /// job failed for good, an attempt left for a retry, an attempt whose lease another worker
    /// took over.
    pub jobs: IntCounterVec,
    /// `export_duration_seconds`: claim to recorded success of an export that succeeded.
    pub duration: Histogram,
    /// `export_rows_total`: data rows written into succeeded exports' files.
    pub rows: IntCounter,
    /// `export_expired_total`: exports whose time was up, their files removed by the sweep.
    pub expired: IntCounter,
    /// `export_jobs_waiting`: jobs submitted and not finished (pending or processing), read by
    /// every sweep.
    pub waiting: IntGauge,
    /// `export_oldest_waiting_seconds`: age of the oldest job not finished, 0 when none; read by
    /// every sweep.
    pub oldest_waiting: Gauge,
}

impl ExportMetrics {
    /// Creates the metrics, not registered anywhere yet (see [`ExportMetrics::register`]).
    pub fn new() -> prometheus::Result<Self> {
        let jobs = IntCounterVec::new(
            Opts::new("export_jobs_total", "Export attempts, by outcome"),
            &["outcome"],
        )?;
        for outcome in OUTCOMES {
            let _ = jobs.with_label_values(&[outcome]);
        }
        Ok(ExportMetrics {
            jobs,
            duration: Histogram::with_opts(
                HistogramOpts::new(
                    "export_duration_seconds",
                    "Claim to recorded success of a succeeded export",
                )
                .buckets(exponential_buckets(0.05, 2.0, 14)?),
            )?,
            rows: IntCounter::new(
                "export_rows_total",
                "Data rows written into succeeded exports",
            )?,
            expired: IntCounter::new(
                "export_expired_total",
                "Exports expired and their files removed",
            )?,
            waiting: IntGauge::new(
                "export_jobs_waiting",
                "Export jobs submitted and not finished (pending or processing)",
            )?,
            oldest_waiting: Gauge::new(
                "export_oldest_waiting_seconds",
                "Age of the oldest export job not finished, 0 when none",
            )?,
        })
    }

    /// Registers every metric on `registry`; fails if one of the same name is already there.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.jobs.clone()))?;
        registry.register(Box::new(self.duration.clone()))?;
        registry.register(Box::new(self.rows.clone()))?;
        registry.register(Box::new(self.expired.clone()))?;
        registry.register(Box::new(self.waiting.clone()))?;
        registry.register(Box::new(self.oldest_waiting.clone()))?;
        Ok(())
    }

    /// Counts one attempt's `outcome` (one of [`OUTCOMES`]).
    pub(crate) fn attempt(&self, outcome: &str) {
        self.jobs.with_label_values(&[outcome]).inc();
    }
}
