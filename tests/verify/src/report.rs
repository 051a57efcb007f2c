//! The run's report: JSON for machines, a table for people.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use super::checks::CheckResults;
use super::config::{
    BrokerKind, Profile, Settings, KAFKA_FAILOVER_BOUND_MS, KAFKA_SESSION_TIMEOUT_MS,
    SESSION_TIMEOUT_MS,
};
use super::driver::History;
use super::faults::FaultRecord;
use super::kafka_cluster::{MIN_INSYNC_REPLICAS, NODES, REPLICATION_FACTOR};
use super::schedule::FaultKind;

/// What the load driver did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct DriverSummary {
    pub seconds: f64,
    pub events_per_second: f64,
    pub orders: u64,
    pub retries: u64,
    pub failed_attempts: BTreeMap<String, u64>,
    pub unresolved_steps: u64,
    pub refused_steps: u64,
    pub step_problems: Vec<String>,
}

/// How the run was set up.
#[derive(Debug, Clone, Serialize)]
pub struct RunSettings {
    pub min_events: u64,
    pub target_events_per_second: f64,
    pub planned_faults: usize,
    pub skipped_kinds: Vec<FaultKind>,
    pub consumer_session_timeout_ms: u64,
    pub consumer_fetch_wait_max_ms: u64,
    /// The run's broker.
    pub broker: BrokerKind,
    /// With `--broker kafka`: the cluster's shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaShape>,
}

/// The run's Apache Kafka cluster.
#[derive(Debug, Clone, Serialize)]
pub struct KafkaShape {
    pub nodes: usize,
    pub replication_factor: usize,
    pub min_insync_replicas: usize,
    pub unclean_leader_election: bool,
    pub broker_session_timeout_ms: u64,
    pub bootstrap: String,
}

/// The report of one run. Check fields are `null` when the run did not get to the checks.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub seed: u64,
    pub profile: Profile,
    /// Settings of the run that are not the pipeline's defaults or that size it.
    pub settings: RunSettings,
    /// Lost, duplicate effects and reorders all 0.
    pub passed: bool,
    pub events_acknowledged: u64,
    pub unacknowledged_committed: Option<i64>,
    /// Injected faults by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Scheduled faults that did not happen, by kind (see `fault_log` for why).
    pub faults_not_injected: BTreeMap<FaultKind, u64>,
    pub lost: Option<i64>,
    pub duplicate_effects: Option<i64>,
    pub reorders: Option<i64>,
    pub dead_lettered: Option<i64>,
    pub kafka_duplicates: Option<u64>,
    /// Longest takeover after a frozen or cut-off relay, and its bound.
    pub takeover_seconds_max: Option<f64>,
    pub takeover_bound_seconds: Option<f64>,
    /// Longest failover after a killed or frozen Kafka node (until its partitions had new
    /// leaders), and its bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_seconds_max: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_bound_seconds: Option<f64>,
    pub recovery_seconds_p50: Option<f64>,
    pub recovery_seconds_max: Option<f64>,
    /// Everything the checks found, per group included.
    pub checks: Option<CheckResults>,
    pub fault_log: Vec<FaultRecord>,
    /// Process exits no fault caused (each was restarted), by process.
    pub unplanned_exits: BTreeMap<String, u32>,
    pub driver: DriverSummary,
    pub drain_seconds: Option<f64>,
    pub duration_seconds: f64,
    /// Logs of every process of the run.
    pub work_dir: Option<String>,
    /// What kept the run from completing (a run with errors fails even if `passed`).
    pub errors: Vec<String>,
}

impl Report {
    pub fn new(settings: &Settings) -> Report {
        Report {
            seed: settings.seed,
            profile: settings.profile,
            settings: RunSettings {
                min_events: settings.min_events,
                target_events_per_second: settings.rate,
                planned_faults: settings.faults,
                skipped_kinds: settings.skip.clone(),
                consumer_session_timeout_ms: SESSION_TIMEOUT_MS,
                consumer_fetch_wait_max_ms: settings.consumer_fetch_wait_ms,
                broker: settings.broker,
                kafka: settings.kafka.as_ref().map(|k| KafkaShape {
                    nodes: NODES,
                    replication_factor: REPLICATION_FACTOR,
                    min_insync_replicas: MIN_INSYNC_REPLICAS,
                    unclean_leader_election: false,
                    broker_session_timeout_ms: KAFKA_SESSION_TIMEOUT_MS,
                    bootstrap: (0..NODES as u16)
                        .map(|i| format!("127.0.0.1:{}", k.base_port + 100 * i))
                        .collect::<Vec<_>>()
                        .join(","),
                }),
            },
            passed: false,
            events_acknowledged: 0,
            unacknowledged_committed: None,
            faults: BTreeMap::new(),
            faults_not_injected: BTreeMap::new(),
            lost: None,
            duplicate_effects: None,
            reorders: None,
            dead_lettered: None,
            kafka_duplicates: None,
            takeover_seconds_max: None,
            takeover_bound_seconds: None,
            failover_seconds_max: None,
            failover_bound_seconds: (settings.broker == BrokerKind::Kafka)
                .then_some(KAFKA_FAILOVER_BOUND_MS as f64 / 1000.0),
            recovery_seconds_p50: None,
            recovery_seconds_max: None,
            checks: None,
            fault_log: Vec::new(),
            unplanned_exits: BTreeMap::new(),
            driver: DriverSummary::default(),
            drain_seconds: None,
            duration_seconds: 0.0,
            work_dir: None,
            errors: Vec::new(),
        }
    }

    pub fn set_history(&mut self, history: &History) {
        self.events_acknowledged = history.acknowledged.len() as u64;
        self.driver.seconds = round2(history.seconds);
        if history.seconds > 0.0 {
            self.driver.events_per_second =
                (self.events_acknowledged as f64 / history.seconds).round();
        }
        self.driver.orders = history.orders;
        self.driver.retries = history.retries;
        self.driver.failed_attempts = history.failed_attempts.clone();
        self.driver.unresolved_steps = history.unresolved_steps;
        self.driver.refused_steps = history.refused_steps;
        self.driver.step_problems = history.step_problems.clone();
    }

    pub fn set_faults(&mut self, log: Vec<FaultRecord>) {
        let mut recoveries = Vec::new();
        for record in &log {
            let tally = if record.injected {
                &mut self.faults
            } else {
                &mut self.faults_not_injected
            };
            *tally.entry(record.kind).or_default() += 1;
            if !record.takeover_within_bound() {
                self.errors.push(format!(
                    "fault {} ({}): no takeover within {:.1} s (took {})",
                    record.index + 1,
                    record.kind,
                    record.takeover_bound_seconds.unwrap_or_default(),
                    record
                        .takeover_seconds
                        .map_or("forever".to_owned(), |t| format!("{t:.1} s"))
                ));
            }
            if !record.failover_within_bound() {
                self.errors.push(format!(
                    "fault {} ({}): {} had no new leaders within {:.1} s (took {})",
                    record.index + 1,
                    record.kind,
                    record.target,
                    record.failover_bound_seconds.unwrap_or_default(),
                    record
                        .failover_seconds
                        .map_or("longer".to_owned(), |t| format!("{t:.1} s"))
                ));
            }
            if let Some(t) = record.failover_seconds {
                self.failover_seconds_max = Some(self.failover_seconds_max.unwrap_or(0.0).max(t));
            }
            if let Some(t) = record.takeover_seconds {
                self.takeover_seconds_max = Some(self.takeover_seconds_max.unwrap_or(0.0).max(t));
                self.takeover_bound_seconds = record.takeover_bound_seconds;
            }
            if record.injected {
                match record.recovery_seconds {
                    Some(s) => recoveries.push(s),
                    None => self.errors.push(format!(
                        "fault {} ({}) did not recover",
                        record.index + 1,
                        record.kind
                    )),
                }
            }
        }
        recoveries.sort_by(f64::total_cmp);
        self.recovery_seconds_p50 = recoveries.get(recoveries.len() / 2).copied();
        self.recovery_seconds_max = recoveries.last().copied();
        self.fault_log = log;
    }

    pub fn set_checks(&mut self, checks: CheckResults) {
        self.unacknowledged_committed = Some(checks.unacknowledged_committed);
        self.lost = Some(checks.lost);
        self.duplicate_effects = Some(checks.duplicate_effects);
        self.reorders = Some(checks.reorders);
        self.dead_lettered = Some(checks.dead_lettered);
        self.kafka_duplicates = Some(checks.kafka_duplicates);
        self.passed = checks.lost == 0 && checks.duplicate_effects == 0 && checks.reorders == 0;
        // With acks=all on three replicas and min.insync.replicas 2, whatever the relay saw
        // acknowledged is on two nodes: no loss of a node may take it out of the topic.
        if self.settings.broker == BrokerKind::Kafka && checks.published_missing_from_topic > 0 {
            self.errors.push(format!(
                "{} events marked published are missing from the topic (acknowledged by \
                 acks=all, then lost by the cluster)",
                checks.published_missing_from_topic
            ));
        }
        // Not failures of delivery, but the history or the data disagree: the run is not clean.
        if checks.sequence_type_mismatches > 0 {
            self.errors.push(format!(
                "{} acknowledged changes have another event type in the outbox at their sequence",
                checks.sequence_type_mismatches
            ));
        }
        if checks.stock_mismatched_products > 0 {
            self.errors.push(format!(
                "stock not conserved for {} products",
                checks.stock_mismatched_products
            ));
        }
        self.checks = Some(checks);
    }

    /// Whether the command succeeds: the checks passed and nothing kept the run from completing.
    pub fn success(&self) -> bool {
        self.passed && self.errors.is_empty()
    }

    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))
    }

    /// A summary for the terminal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let opt = |v: Option<i64>| v.map_or("-".to_owned(), |v| v.to_string());
        let secs = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} s"));
        let faults: u64 = self.faults.values().sum();
        let mut rows: Vec<(&str, String)> = vec![
            ("seed", self.seed.to_string()),
            (
                "broker",
                match &self.settings.kafka {
                    None => "nisshi".to_owned(),
                    Some(k) => format!(
                        "Apache Kafka, {} nodes, replication factor {}, min.insync.replicas {}",
                        k.nodes, k.replication_factor, k.min_insync_replicas
                    ),
                },
            ),
            (
                "events acknowledged",
                format!(
                    "{} ({} orders, {:.0}/s over {:.0} s)",
                    self.events_acknowledged,
                    self.driver.orders,
                    self.driver.events_per_second,
                    self.driver.seconds
                ),
            ),
            (
                "committed, not acknowledged",
                opt(self.unacknowledged_committed),
            ),
            ("faults injected", faults.to_string()),
        ];
        for (kind, n) in &self.faults {
            rows.push(("", format!("{n} × {kind}")));
        }
        for (kind, n) in &self.faults_not_injected {
            rows.push(("  not injected", format!("{n} × {kind}")));
        }
        rows.extend([
            (
                "recovery p50 / max",
                format!(
                    "{} / {}",
                    secs(self.recovery_seconds_p50),
                    secs(self.recovery_seconds_max)
                ),
            ),
            (
                "relay takeover max / bound",
                format!(
                    "{} / {}",
                    secs(self.takeover_seconds_max),
                    secs(self.takeover_bound_seconds)
                ),
            ),
        ]);
        if self.failover_bound_seconds.is_some() {
            rows.push((
                "Kafka failover max / bound",
                format!(
                    "{} / {}",
                    secs(self.failover_seconds_max),
                    secs(self.failover_bound_seconds)
                ),
            ));
        }
        rows.extend([
            ("lost", opt(self.lost)),
            ("duplicate effects", opt(self.duplicate_effects)),
            ("reorders", opt(self.reorders)),
            ("dead-lettered", opt(self.dead_lettered)),
            (
                "published, not in topic",
                self.checks.as_ref().map_or("-".to_owned(), |c| {
                    c.published_missing_from_topic.to_string()
                }),
            ),
            (
                "Kafka duplicates",
                self.kafka_duplicates
                    .map_or("-".to_owned(), |v| v.to_string()),
            ),
            ("drain after load", secs(self.drain_seconds)),
        ]);
        for (label, n) in &self.unplanned_exits {
            rows.push(("unplanned exit", format!("{label} × {n}")));
        }
        for e in &self.errors {
            rows.push(("error", e.clone()));
        }
        let verdict = match (self.passed, self.errors.is_empty()) {
            (true, true) => "PASSED",
            (true, false) => "INCOMPLETE (see errors)",
            (false, _) => "FAILED",
        };
        rows.push(("result", verdict.to_owned()));
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in rows {
            let _ = writeln!(out, "  {k:<width$}  {v}");
        }
        if let Some(checks) = &self.checks {
            if !checks.undrained_partitions.is_empty() {
                let _ = writeln!(out, "\n  not drained:");
                for line in &checks.undrained_partitions {
                    let _ = writeln!(out, "    {line}");
                }
            }
            for (kind, examples) in &checks.examples {
                let _ = writeln!(out, "\n  {kind} (examples):");
                for e in examples {
                    let _ = writeln!(out, "    {e}");
                }
            }
        }
        out
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
