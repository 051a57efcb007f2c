//! The benchmark's report: every figure with the settings it was taken with, the targets checked
//! against them, and what bounded a missed one.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::broker::BrokerResult;
use super::config::Settings;
use super::consumer_drain::GroupDrain;
use super::database::DatabaseCeiling;
use super::dbprofile::DbActivity;
use super::delayed::DelayedResult;
use super::idle::IdleRun;
use super::latency::LatencyRun;
use super::procstat::{cores, peak_rss_mb, BrokerProcess, CpuUse, BROKER};
use super::relay_cost::RelayCost;
use super::relay_drain::RelayResult;
use super::retention::{self, RetentionResult, FLAT_GROWTH_PCT};
use super::sustained::SustainedResult;

/// Largest resident set a service may reach.
pub const RSS_TARGET_MB: f64 = 200.0;

#[derive(Debug, Serialize)]
pub struct Report {
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub host: Host,
    pub settings: Settings,
    /// Every service running with no traffic.
    pub idle: Option<IdleRun>,
    pub broker: Option<BrokerResult>,
    /// PostgreSQL alone.
    pub database: Option<DatabaseCeiling>,
    pub relay: Option<RelayResult>,
    pub consumer: Vec<GroupDrain>,
    pub latency: Vec<LatencyRun>,
    pub sustained: Option<SustainedResult>,
    /// The relay's claim with many delayed events waiting.
    pub delayed: Option<DelayedResult>,
    /// Retention under load over a large history.
    pub retention: Option<RetentionResult>,
    /// What each source of the relay costs PostgreSQL.
    pub relay_cost: Option<RelayCost>,
    /// Highest peak resident memory (VmHWM) of each service over every phase, MiB.
    pub peak_rss_mb: BTreeMap<String, f64>,
    pub targets: Vec<TargetCheck>,
    /// Pipeline figures over the database's ceiling of the same shape (measured in this run):
    /// drains over pg_batch_rows_per_s, the sustained rate over pg_commit_tps.
    pub vs_database: BTreeMap<String, f64>,
    /// Things seen along the way: unclean exits, dead letters, parked events, clean-up problems.
    pub notes: Vec<String>,
    /// Phases that failed.
    pub errors: Vec<String>,
}

/// Where the figures were taken.
#[derive(Debug, Default, Serialize)]
pub struct Host {
    pub cores: usize,
    /// /proc/loadavg when the run started and when it ended: a busy machine shows here.
    pub load_average: String,
    pub load_average_end: String,
    pub postgres: String,
    /// `KAFKA_BROKERS`: the cluster the benchmark uses.
    pub kafka_brokers: String,
    /// Brokers in the cluster's metadata (`None`: it did not answer).
    pub kafka_cluster_brokers: Option<usize>,
    /// The Apache Kafka broker serving `KAFKA_BROKERS` on this machine, whose CPU every phase
    /// measures (`None`: not found here, and the broker's CPU is not measured).
    pub broker: Option<BrokerProcess>,
    /// The broker process's peak resident memory (VmHWM) at the end of the run, MiB.
    pub broker_peak_rss_mb: Option<f64>,
    pub git_revision: String,
}

/// One target and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub name: String,
    pub target: String,
    pub value: Option<f64>,
    /// `None` when the phase did not run.
    pub pass: Option<bool>,
    /// For a miss: CPU of the processes in the phase, and what else explains it.
    pub bound_by: Option<String>,
}

impl Report {
    pub fn new(settings: &Settings, host: Host) -> Report {
        Report {
            started_at: Utc::now(),
            finished_at: None,
            host,
            settings: settings.clone(),
            idle: None,
            broker: None,
            database: None,
            relay: None,
            consumer: Vec::new(),
            latency: Vec::new(),
            sustained: None,
            delayed: None,
            retention: None,
            relay_cost: None,
            peak_rss_mb: BTreeMap::new(),
            targets: Vec::new(),
            vs_database: BTreeMap::new(),
            notes: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Gathers peak memory and checks the targets.
    pub fn finish(&mut self) {
        self.finished_at = Some(Utc::now());
        self.host.load_average_end = load_average();
        self.host.broker_peak_rss_mb = self.host.broker.as_ref().and_then(|b| peak_rss_mb(b.pid));
        let mut peaks: Vec<&BTreeMap<String, f64>> = Vec::new();
        peaks.extend(self.relay.iter().map(|r| &r.peak_rss_mb));
        for g in &self.consumer {
            peaks.extend([&g.batched.peak_rss_mb, &g.per_message.peak_rss_mb]);
        }
        peaks.extend(self.latency.iter().map(|l| &l.peak_rss_mb));
        if let Some(s) = &self.sustained {
            peaks.extend(s.steps.iter().map(|s| &s.peak_rss_mb));
        }
        if let Some(r) = &self.retention {
            peaks.extend([&r.off.peak_rss_mb, &r.on.peak_rss_mb]);
        }
        for map in peaks {
            for (name, &mb) in map {
                let e = self.peak_rss_mb.entry(name.clone()).or_insert(0.0);
                *e = e.max(mb);
            }
        }
        self.targets = self.check_targets();
        self.vs_database = self.database_ratios();
    }

    fn database_ratios(&self) -> BTreeMap<String, f64> {
        let mut ratios = BTreeMap::new();
        let Some(d) = &self.database else {
            return ratios;
        };
        let ratio = |x: f64, ceiling: f64| (x / ceiling.max(1.0) * 1000.0).round() / 1000.0;
        if let Some(r) = &self.relay {
            let _ = ratios.insert(
                "relay_drain_eps / pg_batch_rows_per_s".to_owned(),
                ratio(r.relay_drain_eps, d.batch_rows_per_s),
            );
        }
        for g in &self.consumer {
            let _ = ratios.insert(
                format!("consumer_drain_eps[{}] / pg_batch_rows_per_s", g.group),
                ratio(g.batched.eps, d.batch_rows_per_s),
            );
        }
        if let Some(sus) = &self.sustained {
            let _ = ratios.insert(
                "sustained_events_per_s / pg_commit_tps".to_owned(),
                ratio(sus.events_per_s, d.commit_tps),
            );
        }
        ratios
    }

    fn check_targets(&self) -> Vec<TargetCheck> {
        let mut t = Vec::new();
        let relay_cpu = self
            .relay
            .as_ref()
            .map(|r| cpu_line("relay drain", &r.cpu, &r.db_activity));
        t.push(at_least(
            "relay_drain_eps",
            25_000.0,
            self.relay.as_ref().map(|r| r.relay_drain_eps),
            relay_cpu.clone(),
        ));
        let relay_cost = match (&self.relay, &self.broker) {
            (Some(r), Some(b)) => cpu_cost_bound(r, b, self.host.cores),
            _ => String::new(),
        };
        t.push(at_least(
            "relay_vs_broker",
            RELAY_VS_BROKER_TARGET,
            self.relay.as_ref().and_then(|r| r.relay_vs_broker),
            relay_cpu.map(|c| format!("{c}{relay_cost}")),
        ));
        for g in &self.consumer {
            let why = Some(format!(
                "{}; avg batch {} events in {} ms",
                cpu_line("batched drain", &g.batched.cpu, &g.batched.db_activity),
                g.batched.avg_batch_size,
                g.batched.avg_batch_ms
            ));
            t.push(at_least(
                &format!("consumer_drain_eps[{}]", g.group),
                15_000.0,
                Some(g.batched.eps),
                why.clone(),
            ));
            t.push(at_least(
                &format!("consumer_drain_eps[{}] / consumer_per_message_eps", g.group),
                5.0,
                Some(g.batched_vs_per_message),
                why,
            ));
        }
        match self.latency.iter().find(|l| (l.rate - 1000.0).abs() < 0.5) {
            Some(run) => {
                let broker = run.broker.as_ref().map_or(String::new(), |b| {
                    let broker_cpu = b.cpu.percent.get(BROKER).map_or(String::new(), |pct| {
                        let per_event = b
                            .cpu
                            .per_event
                            .as_ref()
                            .and_then(|p| p.broker_us)
                            .map_or(String::new(), |us| format!(", {us:.1} µs per event"));
                        format!(", broker CPU {pct:.0}%{per_event}")
                    });
                    format!(
                        "; the broker alone at 1000/s, no database: read p50/p99 {}/{} ms, ack p50 {}/{} ms (first/last fifth of the run){broker_cpu}",
                        b.read_p50_ms,
                        b.read_p99_ms,
                        b.ack_p50_by_part_ms.first().copied().unwrap_or_default(),
                        b.ack_p50_by_part_ms.last().copied().unwrap_or_default()
                    )
                });
                for (group, lat) in &run.groups {
                    let why = Some(format!(
                        "stages p50/p99 ms: service {}/{}, relay {}/{}, outbox→applied {}/{}; {}{broker}",
                        lat.service_p50_ms,
                        lat.service_p99_ms,
                        lat.relay_p50_ms,
                        lat.relay_p99_ms,
                        lat.outbox_to_applied_p50_ms,
                        lat.outbox_to_applied_p99_ms,
                        cpu_line("1000/s", &run.cpu, &run.db_activity)
                    ));
                    t.push(at_most(
                        &format!("e2e_p50_ms@1000[{group}]"),
                        10.0,
                        Some(lat.e2e_p50_ms),
                        why.clone(),
                    ));
                    t.push(at_most(
                        &format!("e2e_p99_ms@1000[{group}]"),
                        25.0,
                        Some(lat.e2e_p99_ms),
                        why,
                    ));
                }
            }
            None => t.push(at_most("e2e_p50_ms@1000", 10.0, None, None)),
        }
        let sustained = self.sustained.as_ref();
        let first_miss = sustained.and_then(|s| s.steps.iter().find(|s| !s.held));
        t.push(at_least(
            "sustained_events_per_s",
            4_000.0,
            sustained.map(|s| s.events_per_s),
            first_miss.map(|s| {
                format!(
                    "{}/s not held: {}; {}",
                    s.rate,
                    s.reasons.join("; "),
                    cpu_line("that step", &s.cpu, &s.db_activity)
                )
            }),
        ));
        if let Some(r) = &self.retention {
            let (on_ms, on_what) = r.longest_lock_wait_on();
            let (off_ms, _) = r.longest_lock_wait_off();
            let (steps_waits, steps_ms) = r.retention_step_waits();
            let (held, held_ms) = r.held_by_retention();
            t.push(at_most(
                "retention_pipeline_longest_lock_wait_ms",
                retention::LOCK_WAIT_TARGET_MS,
                Some(r.pipeline_longest_lock_wait_on()),
                Some(format!(
                    "with retention off the longest was {} ms; waits of the pipeline for a \
                     retention step: {held}, longest {held_ms} ms; the longest wait of any \
                     statement, retention's own included: {on_ms} ms, {} (off: {off_ms} ms); \
                     waits with a retention step on either side: {steps_waits}, longest \
                     {steps_ms} ms",
                    r.pipeline_longest_lock_wait_off(),
                    on_what.unwrap_or("(seen only in the server log)")
                )),
            ));
            let gaining: Vec<String> = r
                .trimmed_tables_gaining()
                .into_iter()
                .map(|(t, n)| format!("{t} {n:+} rows"))
                .collect();
            t.push(at_most(
                "retention_trimmed_tables_gaining_rows",
                0.0,
                Some(gaining.len() as f64),
                (!gaining.is_empty()).then(|| {
                    format!(
                        "{} from the middle to the end of the segment on: retention removes \
                         fewer rows than arrive",
                        gaining.join(", ")
                    )
                }),
            ));
            t.push(at_most(
                "retention_growth_on_mid_to_end_pct",
                FLAT_GROWTH_PCT,
                Some(r.growth_on_mid_to_end_pct),
                Some(format!(
                    "with retention off the tables grew {:+.1}%",
                    r.growth_off_pct
                )),
            ));
        }
        for (name, &mb) in &self.peak_rss_mb {
            t.push(at_most(
                &format!("peak_rss_mb[{name}]"),
                RSS_TARGET_MB,
                Some(mb),
                None,
            ));
        }
        t
    }

    /// Writes the report as pretty JSON, creating the folder.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
    }
}

/// relay_drain_eps / broker_produce_eps the relay should reach.
const RELAY_VS_BROKER_TARGET: f64 = 0.7;

/// The relay's drain against the plain producer in CPU time per event (every watched process:
/// PostgreSQL, relay, broker), the highest relay_vs_broker `cores` fully busy at the relay's
/// cost per event would give, and each process's cost per event against the most the whole
/// drain may spend per event for the target on those cores.
fn cpu_cost_bound(relay: &RelayResult, broker: &BrokerResult, cores: usize) -> String {
    let relay_us = cpu_us_per_event(relay.cpu.total(), relay.relay_drain_eps);
    let plain_us = cpu_us_per_event(broker.cpu_produce.total(), broker.produce_eps);
    let all_cores_eps = eps_on_cores(cores, relay_us);
    let budget_us = us_budget_per_event(cores, RELAY_VS_BROKER_TARGET * broker.produce_eps);
    let mut by_process: Vec<(&String, f64)> = relay
        .cpu
        .percent
        .iter()
        .map(|(name, &pct)| (name, cpu_us_per_event(pct, relay.relay_drain_eps)))
        .filter(|(_, us)| *us >= 0.05)
        .collect();
    by_process.sort_by(|a, b| b.1.total_cmp(&a.1));
    let by_process: Vec<String> = by_process
        .iter()
        .map(|(name, us)| format!("{name} {us:.1}"))
        .collect();
    format!(
        "; CPU per event, all watched processes: relay drain {relay_us:.1} µs, plain producer {plain_us:.1} µs; at the relay's cost {cores} fully busy cores would drain {:.0} ev/s, relay_vs_broker {:.2}; for {RELAY_VS_BROKER_TARGET} the drain may spend at most {budget_us:.1} µs per event on {cores} cores, and it spent (µs per event) {}",
        all_cores_eps,
        all_cores_eps / broker.produce_eps.max(1.0),
        by_process.join(", ")
    )
}

/// CPU µs per event that `cores` fully busy cores can spend to carry `eps` events/s.
fn us_budget_per_event(cores: usize, eps: f64) -> f64 {
    cores as f64 * 1e6 / eps.max(1.0)
}

/// CPU µs spent per event by processes using `percent` (100 = one core) at `eps` events/s.
fn cpu_us_per_event(percent: f64, eps: f64) -> f64 {
    percent / 100.0 * 1e6 / eps.max(1.0)
}

/// Events/s that `cores` fully busy cores carry at `us_per_event` CPU µs each.
fn eps_on_cores(cores: usize, us_per_event: f64) -> f64 {
    cores as f64 * 1e6 / us_per_event.max(0.001)
}

/// CPU of the phase's processes, whether the machine was saturated, and what the database
/// connections were busy with.
fn cpu_line(phase: &str, cpu: &CpuUse, db: &DbActivity) -> String {
    let busy = cpu.total() + cpu.other_percent.unwrap_or(0.0);
    let saturated = if busy >= 0.9 * (cores() * 100) as f64 {
        ": the machine's cores are saturated"
    } else {
        ""
    };
    format!(
        "CPU during {phase}: {}{saturated}; DB connections busy (avg): {}",
        cpu.summary(),
        db.summary(2)
    )
}

fn check(
    name: &str,
    target: String,
    value: Option<f64>,
    pass: Option<bool>,
    why: Option<String>,
) -> TargetCheck {
    TargetCheck {
        name: name.to_owned(),
        target,
        value,
        bound_by: if pass == Some(false) { why } else { None },
        pass,
    }
}

fn at_least(name: &str, min: f64, value: Option<f64>, why: Option<String>) -> TargetCheck {
    check(
        name,
        format!(">= {min}"),
        value,
        value.map(|v| v >= min),
        why,
    )
}

fn at_most(name: &str, max: f64, value: Option<f64>, why: Option<String>) -> TargetCheck {
    check(
        name,
        format!("<= {max}"),
        value,
        value.map(|v| v <= max),
        why,
    )
}

/// What can be learnt about the machine and the broker; best effort.
pub async fn host() -> Host {
    let kafka_brokers = pipeline_testkit::kafka::brokers();
    let address = kafka_brokers.clone();
    let kafka_cluster_brokers = tokio::task::spawn_blocking(move || cluster_brokers(&address))
        .await
        .ok()
        .flatten();
    let git_revision = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    Host {
        cores: cores(),
        load_average: load_average(),
        load_average_end: String::new(),
        postgres: super::envs::postgres_version().await.unwrap_or_default(),
        kafka_brokers,
        kafka_cluster_brokers,
        broker: super::procstat::broker_process(),
        broker_peak_rss_mb: None,
        git_revision,
    }
}

/// Brokers in the metadata of the cluster at `brokers`.
fn cluster_brokers(brokers: &str) -> Option<usize> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .ok()?;
    let metadata = client
        .fetch_metadata(None, std::time::Duration::from_secs(10))
        .ok()?;
    Some(metadata.brokers().len())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_cost_per_event_and_the_rate_busy_cores_would_carry() {
        // 1.5 cores for 100,000 events/s is 15 µs an event; two cores carry 133,333 of those.
        let us = cpu_us_per_event(150.0, 100_000.0);
        assert!((us - 15.0).abs() < 1e-9);
        assert!((eps_on_cores(2, us) - 133_333.3).abs() < 1.0);
        // Nothing measured yet does not divide by zero.
        assert!(cpu_us_per_event(10.0, 0.0).is_finite());
        assert!(eps_on_cores(2, 0.0).is_finite());
    }

    #[test]
    fn cpu_budget_per_event_for_a_target_rate() {
        // 0.7 of a 300,000 ev/s ceiling on two cores leaves 9.5 µs an event, all processes.
        let budget = us_budget_per_event(2, 0.7 * 300_000.0);
        assert!((budget - 9.524).abs() < 1e-3, "{budget}");
        // Spending exactly the budget carries exactly the rate.
        assert!((eps_on_cores(2, budget) - 210_000.0).abs() < 1e-6);
        assert!(us_budget_per_event(2, 0.0).is_finite());
    }
}
