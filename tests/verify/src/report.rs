//! The run's report: JSON for machines, a table for people.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use super::checks::CheckResults;
use super::config::{
    group_protocols, GroupProtocol, Profile, Settings, KAFKA_FAILOVER_BOUND_MS,
    KAFKA_SESSION_TIMEOUT_MS, SESSION_TIMEOUT_MS,
};
use super::driver::History;
use super::fault_plan::FaultKind;
use super::faults::FaultRecord;
use super::kafka_cluster::{MIN_INSYNC_REPLICAS, NODES, REPLICATION_FACTOR};
use super::topology::{member_label, MEMBERS_PER_GROUP};

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
    /// Where the relays read the outbox's events (`--source`).
    pub relay_source: crate::config::RelaySource,
    /// The consumers' dedupe window (`--retain-dedupe`) and how often they run retention.
    pub consumer_retain_dedupe: &'static str,
    pub consumer_retention_interval: &'static str,
    /// Each consumer group's protocol and processes.
    pub consumer_groups: Vec<ConsumerGroupSetup>,
    /// The run's Apache Kafka cluster.
    pub kafka: KafkaShape,
}

/// One consumer group of the run.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerGroupSetup {
    /// The group kind (the group id is the run's prefix and this).
    pub group: &'static str,
    pub protocol: GroupProtocol,
    /// Its processes' labels (the last one joins only for a rebalance).
    pub processes: Vec<String>,
}

/// Recovery figures of one fault kind.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KindFigures {
    pub injected: u64,
    pub recovery_seconds_p50: Option<f64>,
    pub recovery_seconds_max: Option<f64>,
    /// Kafka faults: until the relay published events committed after the fault began.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_resumed_seconds_max: Option<f64>,
    /// Two Kafka nodes down: from the first one's return until publishing resumed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_after_return_seconds_max: Option<f64>,
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
    /// Planned faults that did not happen, by kind (see `fault_log` for why).
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
    pub failover_seconds_max: Option<f64>,
    pub failover_bound_seconds: f64,
    pub recovery_seconds_p50: Option<f64>,
    pub recovery_seconds_max: Option<f64>,
    /// Recovery figures by fault kind.
    pub by_kind: BTreeMap<FaultKind, KindFigures>,
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
                relay_source: settings.relay_source,
                consumer_retain_dedupe: crate::topology::RETAIN_DEDUPE,
                consumer_retention_interval: crate::topology::RETENTION_INTERVAL,
                consumer_groups: group_protocols(settings.seed)
                    .into_iter()
                    .map(|(group, protocol)| ConsumerGroupSetup {
                        group,
                        protocol,
                        processes: (1..=MEMBERS_PER_GROUP + 1)
                            .map(|n| member_label(group, n))
                            .collect(),
                    })
                    .collect(),
                kafka: KafkaShape {
                    nodes: NODES,
                    replication_factor: REPLICATION_FACTOR,
                    min_insync_replicas: MIN_INSYNC_REPLICAS,
                    unclean_leader_election: false,
                    broker_session_timeout_ms: KAFKA_SESSION_TIMEOUT_MS,
                    bootstrap: (0..NODES as u16)
                        .map(|i| format!("127.0.0.1:{}", settings.kafka.base_port + 100 * i))
                        .collect::<Vec<_>>()
                        .join(","),
                },
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
            failover_bound_seconds: KAFKA_FAILOVER_BOUND_MS as f64 / 1000.0,
            recovery_seconds_p50: None,
            recovery_seconds_max: None,
            by_kind: BTreeMap::new(),
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
            if let Some(outage) = record.write_outage.as_ref().filter(|o| !o.held()) {
                self.errors.push(format!(
                    "fault {} ({}): the relay marked {} events published while the cluster could \
                     take no writes ({} of them committed during the outage)",
                    record.index + 1,
                    record.kind,
                    outage.published_during,
                    outage.published_early
                ));
            }
            if record.kind == FaultKind::BrokersBelowMinIsr
                && record.injected
                && record.publish_resumed_seconds.is_none()
            {
                self.errors.push(format!(
                    "fault {} ({}): publishing did not resume once a node was back",
                    record.index + 1,
                    record.kind
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
        (self.recovery_seconds_p50, self.recovery_seconds_max) = p50_and_max(recoveries);
        self.by_kind = figures_by_kind(&log);
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
        if checks.published_missing_from_topic > 0 {
            self.errors.push(format!(
                "{} events marked published are missing from the topic (acknowledged by \
                 acks=all, then lost by the cluster)",
                checks.published_missing_from_topic
            ));
        }
        // The delivery records say where each event is, or that its offset is unknown; never a
        // position that does not hold it.
        if checks.deliveries_at_wrong_position > 0 {
            self.errors.push(format!(
                "{} delivery records name a partition and offset that do not hold their event",
                checks.deliveries_at_wrong_position
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
                format!(
                    "Apache Kafka, {} nodes, replication factor {}, min.insync.replicas {}",
                    self.settings.kafka.nodes,
                    self.settings.kafka.replication_factor,
                    self.settings.kafka.min_insync_replicas
                ),
            ),
            (
                "consumer groups",
                self.settings
                    .consumer_groups
                    .iter()
                    .map(|g| format!("{} on {}", g.group, g.protocol.as_str()))
                    .collect::<Vec<_>>()
                    .join(", "),
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
            let figures = self.by_kind.get(kind).cloned().unwrap_or_default();
            let mut line = format!(
                "{n} × {kind}: recovery p50 {} max {}",
                secs(figures.recovery_seconds_p50),
                secs(figures.recovery_seconds_max)
            );
            if let Some(s) = figures.publish_resumed_seconds_max {
                let _ = write!(line, ", publishing again within {s:.1} s");
            }
            if let Some(s) = figures.resumed_after_return_seconds_max {
                let _ = write!(line, " ({s:.1} s after a node was back)");
            }
            rows.push(("", line));
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
        rows.push((
            "Kafka failover max / bound",
            format!(
                "{} / {}",
                secs(self.failover_seconds_max),
                secs(Some(self.failover_bound_seconds))
            ),
        ));
        rows.extend([
            ("lost", opt(self.lost)),
            ("duplicate effects", opt(self.duplicate_effects)),
            ("reorders", opt(self.reorders)),
            ("dead-lettered", opt(self.dead_lettered)),
            (
                "by group: lost / parked / applied",
                self.checks.as_ref().map_or("-".to_owned(), |c| {
                    c.by_group
                        .iter()
                        .map(|(group, n)| {
                            format!("{group} {} / {} / {}", n.lost, n.parked, n.applied)
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                }),
            ),
            (
                "acknowledged, not in the outbox",
                self.checks
                    .as_ref()
                    .map_or("-".to_owned(), |c| c.acknowledged_not_in_outbox.to_string()),
            ),
            (
                "published, not in topic",
                self.checks.as_ref().map_or("-".to_owned(), |c| {
                    c.published_missing_from_topic.to_string()
                }),
            ),
            (
                "deliveries at a wrong position / offset unknown",
                self.checks.as_ref().map_or("-".to_owned(), |c| {
                    format!(
                        "{} / {}",
                        c.deliveries_at_wrong_position, c.deliveries_offset_unknown
                    )
                }),
            ),
            (
                "Kafka duplicates",
                self.kafka_duplicates
                    .map_or("-".to_owned(), |v| v.to_string()),
            ),
            ("drain after load", secs(self.drain_seconds)),
            (
                "retention: dedupe rows removed / stale",
                self.checks.as_ref().map_or("-".to_owned(), |c| {
                    format!(
                        "{} (window {}) / {}",
                        c.retention_removed
                            .get("processed_message")
                            .copied()
                            .unwrap_or(0),
                        self.settings.consumer_retain_dedupe,
                        c.stale
                    )
                }),
            ),
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

/// The median and the largest of `values`.
fn p50_and_max(mut values: Vec<f64>) -> (Option<f64>, Option<f64>) {
    values.sort_by(f64::total_cmp);
    (
        values.get(values.len() / 2).copied(),
        values.last().copied(),
    )
}

fn max(values: impl Iterator<Item = f64>) -> Option<f64> {
    values.reduce(f64::max)
}

/// Recovery figures of each injected fault kind.
fn figures_by_kind(log: &[FaultRecord]) -> BTreeMap<FaultKind, KindFigures> {
    let mut kinds: BTreeMap<FaultKind, Vec<&FaultRecord>> = BTreeMap::new();
    for record in log.iter().filter(|r| r.injected) {
        kinds.entry(record.kind).or_default().push(record);
    }
    kinds
        .into_iter()
        .map(|(kind, records)| {
            let (p50, max_recovery) =
                p50_and_max(records.iter().filter_map(|r| r.recovery_seconds).collect());
            let figures = KindFigures {
                injected: records.len() as u64,
                recovery_seconds_p50: p50,
                recovery_seconds_max: max_recovery,
                publish_resumed_seconds_max: max(records
                    .iter()
                    .filter_map(|r| r.publish_resumed_seconds)),
                resumed_after_return_seconds_max: max(records.iter().filter_map(|r| {
                    r.write_outage
                        .as_ref()
                        .and_then(|o| o.resumed_after_return_seconds)
                })),
            };
            (kind, figures)
        })
        .collect()
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::injection::WriteOutage;

    fn record(index: usize, kind: FaultKind, recovery: f64) -> FaultRecord {
        FaultRecord {
            index,
            kind,
            target: String::new(),
            injected_at: String::new(),
            at_seconds: 0.0,
            down_seconds: 0.0,
            injected: true,
            back_seconds: Some(recovery),
            recovery_seconds: Some(recovery),
            takeover_seconds: None,
            takeover_bound_seconds: None,
            failover_seconds: None,
            failover_bound_seconds: None,
            publish_resumed_seconds: None,
            write_outage: None,
            note: None,
        }
    }

    fn outage(published_during: i64, resumed: Option<f64>) -> WriteOutage {
        WriteOutage {
            seconds: 10.0,
            published_during,
            published_early: 0,
            unpublished_at_return: 5_000,
            resumed_after_return_seconds: resumed,
        }
    }

    #[test]
    fn figures_are_kept_by_kind() {
        let mut below = record(2, FaultKind::BrokersBelowMinIsr, 30.0);
        below.publish_resumed_seconds = Some(25.0);
        below.write_outage = Some(outage(0, Some(9.5)));
        let log = vec![
            record(0, FaultKind::RelayKill, 1.0),
            record(1, FaultKind::RelayKill, 3.0),
            below,
        ];
        let figures = figures_by_kind(&log);
        let relay = &figures[&FaultKind::RelayKill];
        assert_eq!(relay.injected, 2);
        assert_eq!(relay.recovery_seconds_max, Some(3.0));
        assert_eq!(relay.publish_resumed_seconds_max, None);
        let below = &figures[&FaultKind::BrokersBelowMinIsr];
        assert_eq!(below.publish_resumed_seconds_max, Some(25.0));
        assert_eq!(below.resumed_after_return_seconds_max, Some(9.5));
    }

    #[test]
    fn an_outage_that_published_or_never_resumed_is_an_error() {
        let mut held = record(0, FaultKind::BrokersBelowMinIsr, 30.0);
        held.publish_resumed_seconds = Some(20.0);
        held.write_outage = Some(outage(0, Some(8.0)));
        let mut published = held.clone();
        published.index = 1;
        published.write_outage = Some(outage(3, Some(8.0)));
        let mut stuck = held.clone();
        stuck.index = 2;
        stuck.publish_resumed_seconds = None;
        let errors = |log: Vec<FaultRecord>| {
            let mut report = Report {
                errors: Vec::new(),
                ..report()
            };
            report.set_faults(log);
            report.errors
        };
        assert!(errors(vec![held.clone()]).is_empty());
        let found = errors(vec![held, published, stuck]);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("marked 3 events published"));
        assert!(found[1].contains("did not resume"));
    }

    fn report() -> Report {
        let args = <crate::config::VerifyArgs as clap::Parser>::parse_from([
            "verify",
            "--report",
            "/tmp/r.json",
            "--kafka-jars",
            "/tmp",
            "--kafka-config-dir",
            "/tmp",
            "--seed",
            "4",
        ]);
        let settings = Settings::resolve(args).expect("settings");
        let report = Report::new(&settings);
        assert_eq!(report.settings.consumer_groups[0].group, "inventory");
        assert_eq!(
            report.settings.consumer_groups[0].protocol,
            GroupProtocol::Classic
        );
        assert_eq!(
            report.settings.consumer_groups[1].processes,
            ["notification-1", "notification-2", "notification-3"]
        );
        report
    }
}
