//! Retention's Prometheus metrics, registered on the caller's registry.

use prometheus::{
    exponential_buckets, register_counter_vec_with_registry, register_gauge_vec_with_registry,
    register_histogram_with_registry, register_int_counter_vec_with_registry, CounterVec, GaugeVec,
    Histogram, HistogramOpts, IntCounterVec, Opts, Registry,
};

/// Metrics of the retention runner of one process, labelled by table.
#[derive(Clone)]
pub struct RetentionMetrics {
    /// `retention_rows_removed_total`: rows removed, by table.
    pub removed: IntCounterVec,
    /// `retention_partitions_removed_total`: partitions of a table in time partitions dropped,
    /// by table.
    pub partitions_removed: IntCounterVec,
    /// `retention_run_duration_seconds`: one run over every table.
    pub run_duration: Histogram,
    /// `retention_oldest_row_age_seconds`: age of the oldest row a table keeps, after the last
    /// run (tables that cannot tell it cheaply have no series).
    pub oldest_age: GaugeVec,
    /// `retention_window_seconds`: how long a table keeps its rows.
    pub window: GaugeVec,
    /// `retention_last_caught_up_timestamp_seconds`: when a run last left a table with nothing
    /// older than its window but what is still needed (a swept table: when a pass ended).
    pub caught_up: GaugeVec,
    /// `retention_runs_skipped_total`: runs that found another runner at work on the database.
    pub skipped: prometheus::IntCounter,
    /// `retention_yielded_seconds_total`: time the runner waited before its steps, by `reason`:
    /// `backlog` (for the pipeline to catch up), `slow` (for its rounds to be quick again; see
    /// [`super::Backlog`]) or `pace` (to remove no faster than its pace; see [`super::pace`]).
    pub yielded: CounterVec,
}

impl RetentionMetrics {
    /// Registers the metrics on `registry`, each series labelled `runner` = `runner` (`relay`,
    /// `consumer`), so that a program running both runners registers both sets on one registry.
    pub fn register(registry: &Registry, runner: &str) -> prometheus::Result<Self> {
        let removed = register_int_counter_vec_with_registry!(
            Opts::new(
                "retention_rows_removed_total",
                "Rows removed by retention, by table.",
            )
            .const_label("runner", runner),
            &["table"],
            registry
        )?;
        let partitions_removed = register_int_counter_vec_with_registry!(
            Opts::new(
                "retention_partitions_removed_total",
                "Partitions of a table in time partitions that retention dropped, by table.",
            )
            .const_label("runner", runner),
            &["table"],
            registry
        )?;
        let run_duration = register_histogram_with_registry!(
            HistogramOpts::new(
                "retention_run_duration_seconds",
                "Time one retention run takes over every table.",
            )
            .const_label("runner", runner)
            .buckets(exponential_buckets(0.005, 2.0, 16)?),
            registry
        )?;
        let oldest_age = register_gauge_vec_with_registry!(
            Opts::new(
                "retention_oldest_row_age_seconds",
                "Age of the oldest row a table keeps, after the last retention run.",
            )
            .const_label("runner", runner),
            &["table"],
            registry
        )?;
        let window = register_gauge_vec_with_registry!(
            Opts::new(
                "retention_window_seconds",
                "How long a table keeps its rows.",
            )
            .const_label("runner", runner),
            &["table"],
            registry
        )?;
        let caught_up = register_gauge_vec_with_registry!(
            Opts::new(
                "retention_last_caught_up_timestamp_seconds",
                "When a retention run last left the table with nothing removable older than its window.",
            )
            .const_label("runner", runner),
            &["table"],
            registry
        )?;
        let skipped = prometheus::IntCounter::with_opts(
            Opts::new(
                "retention_runs_skipped_total",
                "Retention runs that found another runner at work on the database.",
            )
            .const_label("runner", runner),
        )?;
        let yielded = register_counter_vec_with_registry!(
            Opts::new(
                "retention_yielded_seconds_total",
                "Seconds retention waited before its steps for the relay or the consumer to catch up on a backlog (reason=backlog), to be quick again (reason=slow), or to remove rows no faster than its pace allows, a multiple of the rate the table gains rows (reason=pace).",
            )
            .const_label("runner", runner),
            &["reason"],
            registry
        )?;
        Ok(RetentionMetrics {
            removed,
            partitions_removed,
            run_duration,
            oldest_age,
            window,
            caught_up,
            skipped,
            yielded,
        })
    }
}
