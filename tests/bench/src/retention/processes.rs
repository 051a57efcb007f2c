//! The relay and consumer processes of the retention phase, started with retention off or on,
//! and what their `/metrics` pages say about it.

use std::collections::BTreeMap;
use std::time::Duration;

use pipeline_testkit::{scrape, scrape_sum, wait_until, Service, TestEnv};

use crate::config::Settings;
use crate::services::{self, GROUPS};

const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A relay or consumer, its metrics address and its arguments.
pub struct Process {
    pub service: Service,
    pub metrics: String,
    pub args: Vec<String>,
}

/// `0s`, `10s`: a duration as the binaries' flags take it.
fn flag_duration(d: Duration) -> String {
    format!("{}s", d.as_secs())
}

/// `--retention-interval`: the phase's interval when on, `0s` (never) when off.
fn interval_args(settings: &Settings, on: bool) -> Vec<String> {
    let interval = if on {
        flag_duration(settings.retention.interval)
    } else {
        "0s".into()
    };
    vec!["--retention-interval".into(), interval]
}

/// The relay's retention flags: the same windows on and off, only the interval differs.
fn relay_retention_args(settings: &Settings, on: bool) -> Vec<String> {
    let mut args = interval_args(settings, on);
    args.extend([
        "--retain-published".into(),
        flag_duration(settings.retention.window),
    ]);
    args
}

/// The consumer's retention flags; progress keeps its default window. The windows are the same
/// on and off: a consumer makes the effect history's partitions on the grid its history window
/// gives them even with retention off, and a segment "off" run with the 7-day default would
/// leave day-long partitions that the segment "on" could drop only once the day is over.
fn consumer_retention_args(settings: &Settings, on: bool) -> Vec<String> {
    let r = &settings.retention;
    let mut args = interval_args(settings, on);
    for flag in [
        "--retain-dedupe",
        "--retain-history",
        "--retain-dead-letters",
    ] {
        args.extend([flag.to_owned(), flag_duration(r.window)]);
    }
    args
}

/// Starts a relay and waits until it is active.
pub async fn start_relay(
    env: &TestEnv,
    settings: &Settings,
    retention: bool,
    label: &str,
) -> anyhow::Result<Process> {
    let mut args = services::relay_args(settings);
    args.extend(relay_retention_args(settings, retention));
    let (service, metrics) =
        services::start(env, "relay", label, &args, "relay metrics listening on ").await?;
    wait_until("relay active", START_TIMEOUT, || async {
        let active = scrape_sum(&metrics, "relay_active", &[]).await?;
        Ok((active >= 1.0).then_some(()))
    })
    .await?;
    Ok(Process {
        service,
        metrics,
        args,
    })
}

/// Starts a consumer running both groups; with `wait_assigned`, waits until they own every
/// partition.
pub async fn start_consumer(
    env: &TestEnv,
    settings: &Settings,
    retention: bool,
    label: &str,
    wait_assigned: bool,
) -> anyhow::Result<Process> {
    let mut args = services::consumer_args(env, &GROUPS, settings.consumer_max_batch);
    args.extend(consumer_retention_args(settings, retention));
    let (service, metrics) = services::start(
        env,
        "consumer",
        label,
        &args,
        "consumer metrics listening on ",
    )
    .await?;
    if wait_assigned {
        let partitions = f64::from(settings.partitions) * GROUPS.len() as f64;
        wait_until("partitions assigned", START_TIMEOUT, || async {
            let assigned = scrape_sum(&metrics, "consumer_assigned_partitions", &[]).await?;
            Ok((assigned >= partitions).then_some(()))
        })
        .await?;
    }
    Ok(Process {
        service,
        metrics,
        args,
    })
}

impl Process {
    /// The `/metrics` page.
    pub async fn page(&self) -> anyhow::Result<String> {
        scrape(&self.metrics).await
    }

    /// Stops it with SIGTERM; an unclean exit is a note.
    pub async fn stop(self) -> Option<String> {
        services::stop(self.service).await
    }
}

/// Every `retention_*` series on a page, by its name and labels.
pub fn retention_series(page: &str) -> BTreeMap<String, f64> {
    page.lines()
        .filter(|l| l.starts_with("retention_"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// `retention_rows_removed_total` on a page, by its `table` label.
pub fn rows_removed(page: &str) -> BTreeMap<String, f64> {
    let mut by_table = BTreeMap::new();
    for (series, value) in retention_series(page) {
        if !series.starts_with("retention_rows_removed_total") {
            continue;
        }
        let table = series
            .split("table=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?")
            .to_owned();
        *by_table.entry(table).or_insert(0.0) += value;
    }
    by_table
}

/// Rows removed per table between two readings of the same processes.
pub fn removed_since(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(t, n)| (t.clone(), n - before.get(t).copied().unwrap_or(0.0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_removed_are_summed_by_table() {
        let page = "# HELP retention_rows_removed_total Rows\n\
                    retention_rows_removed_total{group=\"a\",table=\"processed_message\"} 10\n\
                    retention_rows_removed_total{group=\"b\",table=\"processed_message\"} 5\n\
                    retention_rows_removed_total{table=\"applied_effect\"} 7\n\
                    retention_run_duration_seconds_count 3\n\
                    consumer_messages_total{group=\"a\"} 9\n";
        let removed = rows_removed(page);
        assert_eq!(removed.get("processed_message"), Some(&15.0));
        assert_eq!(removed.get("applied_effect"), Some(&7.0));
        assert_eq!(retention_series(page).len(), 4);
    }
}
