//! Injects the planned faults one after the other into the running pipeline and measures how
//! long the pipeline takes to recover from each (see [`super::recovery`]). The faults on Kafka
//! nodes are in [`super::broker_faults`].

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::future::join_all;
use nix::sys::signal::Signal;
use pipeline_testkit::wait_until;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::{KAFKA_FAILOVER_BOUND_MS, RELAY_TAKEOVER_BOUND_MS};
use super::environment::Environment;
use super::fault_plan::{FaultKind, PlannedFault};
use super::injection::{done, not_injected, Injected, WriteOutage, RECOVERY_DEADLINE};
use super::postgres::{foreign_sessions, PgCluster};
use super::progress::say;
use super::recovery::{wait_both_groups_apply, wait_pipeline_up};
use super::topology::{Member, Topology};

/// How long an armed crash point may wait for the next batch.
const TRIGGER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a PostgreSQL restart waits for other clients' sessions to end.
const SHARED_SERVER_WAIT: Duration = Duration::from_secs(60);

/// What happened to one fault.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    pub index: usize,
    pub kind: FaultKind,
    /// The process or service hit.
    pub target: String,
    /// Wall-clock time of the injection (UTC, as in the processes' logs).
    pub injected_at: String,
    /// Seconds since the load started.
    pub at_seconds: f64,
    pub down_seconds: f64,
    /// Whether the fault actually happened (a crash point may not be reached; a PostgreSQL
    /// restart is skipped while other clients use the server).
    pub injected: bool,
    /// Until the faulted part was back and every process ready again.
    pub back_seconds: Option<f64>,
    /// Until, after that, both groups applied events again (see [`super::recovery`]). For a
    /// fault others must take over from ([`FaultKind::needs_takeover`]), measured while the
    /// fault is still in place: until both groups applied events after the takeover.
    pub recovery_seconds: Option<f64>,
    /// For a frozen or cut-off relay: until the standby reported itself active.
    pub takeover_seconds: Option<f64>,
    /// The bound `takeover_seconds` must stay within.
    pub takeover_bound_seconds: Option<f64>,
    /// For a killed or frozen Kafka node: until every partition of the run's topic it led had a
    /// new leader (from the in-sync replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_seconds: Option<f64>,
    /// The bound `failover_seconds` must stay within.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_bound_seconds: Option<f64>,
    /// For a killed or frozen Kafka node, or two of them down: until an event committed after
    /// the fault began was marked published (see [`super::publishing`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_resumed_seconds: Option<f64>,
    /// For two Kafka nodes down at once: what the relay marked published meanwhile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_outage: Option<WriteOutage>,
    pub note: Option<String>,
}

impl FaultRecord {
    /// Whether a fault that needs a takeover got one within its bound (true for other kinds).
    pub fn takeover_within_bound(&self) -> bool {
        if !self.injected || !self.kind.needs_takeover() {
            return true;
        }
        match (self.takeover_seconds, self.takeover_bound_seconds) {
            (Some(t), Some(bound)) => t <= bound,
            _ => false,
        }
    }

    /// Whether a fault on a Kafka node was followed by new leaders within their bound (true
    /// for other faults).
    pub fn failover_within_bound(&self) -> bool {
        match (self.injected, self.failover_bound_seconds) {
            (true, Some(bound)) => self.failover_seconds.is_some_and(|t| t <= bound),
            _ => true,
        }
    }
}

/// The fault injector of one run.
pub struct Injector<'a> {
    pub topology: &'a Topology,
    pub env: &'a Environment,
    pub postgres: &'a PgCluster,
    /// When the load started: fault times are reported relative to it.
    pub started: Instant,
}

impl Injector<'_> {
    /// Runs the plan; stops early on `abort`.
    pub async fn run(&self, plan: &[PlannedFault], abort: &CancellationToken) -> Vec<FaultRecord> {
        let mut records = Vec::with_capacity(plan.len());
        for fault in plan {
            tokio::select! {
                () = abort.cancelled() => break,
                () = tokio::time::sleep(fault.gap) => {}
            }
            let at = Instant::now();
            let injected_at = chrono::Utc::now().to_rfc3339();
            say(&format!(
                "fault {}/{}: {} (down {:.1} s)",
                fault.index + 1,
                plan.len(),
                fault.kind,
                fault.down.as_secs_f64()
            ));
            let outcome = tokio::select! {
                () = abort.cancelled() => break,
                outcome = self.inject_and_recover(fault) => outcome,
            };
            let (injected, back, recovered) = match outcome {
                Ok(outcome) => outcome,
                Err(e) => (
                    Injected {
                        note: Some(format!("{e:#}")),
                        ..not_injected(String::new())
                    },
                    None,
                    None,
                ),
            };
            let since = |t: Instant| round2((t - at).as_secs_f64());
            let record = FaultRecord {
                index: fault.index,
                kind: fault.kind,
                target: injected.target,
                injected_at,
                at_seconds: round2((at - self.started).as_secs_f64()),
                down_seconds: round2(fault.down.as_secs_f64()),
                injected: injected.happened,
                back_seconds: back.map(since),
                recovery_seconds: recovered.map(since),
                takeover_seconds: injected.takeover.map(|t| round2(t.as_secs_f64())),
                takeover_bound_seconds: fault
                    .kind
                    .needs_takeover()
                    .then_some(RELAY_TAKEOVER_BOUND_MS as f64 / 1000.0),
                failover_seconds: injected.failover.flatten().map(since),
                failover_bound_seconds: injected
                    .failover
                    .map(|_| KAFKA_FAILOVER_BOUND_MS as f64 / 1000.0),
                publish_resumed_seconds: injected.publish_resumed.map(since),
                write_outage: injected.write_outage,
                note: injected.note,
            };
            let outcome = match (record.injected, record.recovery_seconds) {
                (false, _) => "not injected".to_owned(),
                (true, None) => "not recovered".to_owned(),
                (true, Some(s)) => match (record.takeover_seconds, record.failover_seconds) {
                    (Some(t), _) => format!(
                        "taken over in {t:.1} s (bound {:.1} s), recovered in {s:.1} s",
                        record.takeover_bound_seconds.unwrap_or_default()
                    ),
                    (None, Some(f)) => format!(
                        "new leaders in {f:.1} s (bound {:.1} s), recovered in {s:.1} s (back \
                         after {:.1} s)",
                        record.failover_bound_seconds.unwrap_or_default(),
                        record.back_seconds.unwrap_or(s)
                    ),
                    (None, None) => format!(
                        "recovered in {s:.1} s (back after {:.1} s)",
                        record.back_seconds.unwrap_or(s)
                    ),
                },
            };
            say(&format!(
                "fault {}: {} {} → {outcome}{}",
                fault.index + 1,
                record.kind,
                record.target,
                record
                    .note
                    .as_deref()
                    .map_or(String::new(), |n| format!(" ({n})"))
            ));
            records.push(record);
        }
        records
    }

    async fn inject_and_recover(
        &self,
        fault: &PlannedFault,
    ) -> anyhow::Result<(Injected, Option<Instant>, Option<Instant>)> {
        let injected = self.inject(fault).await?;
        if !injected.happened {
            return Ok((injected, None, None));
        }
        // From the end of the fault: a rolling restart of the three nodes alone takes some three
        // minutes on a small machine (each back in every ISR before the next goes).
        let deadline = Instant::now() + RECOVERY_DEADLINE;
        if wait_pipeline_up(self.topology, RECOVERY_DEADLINE)
            .await
            .is_err()
        {
            return Ok((injected, None, None));
        }
        let back = Instant::now();
        let recovered = match injected.recovered {
            Some(recovered) => Some(recovered),
            None if fault.kind.needs_takeover() => None,
            None => wait_both_groups_apply(&self.env.pool, deadline).await,
        };
        Ok((injected, Some(back), recovered))
    }

    /// Injects one fault and waits until the faulted part is back up.
    async fn inject(&self, fault: &PlannedFault) -> anyhow::Result<Injected> {
        let supervisor = &self.topology.supervisor;
        let consumers = &self.consumer_targets(fault.consumer).await;
        match fault.kind {
            FaultKind::RelayKill => {
                let relay = self.active_relay().await?;
                let starts = supervisor.starts(&relay.label)?;
                supervisor.kill(&relay.label, fault.down)?;
                self.wait_restarted(&relay.label, starts).await?;
                Ok(done(&relay.label))
            }
            FaultKind::RelayCrashAfterDelivery => {
                let relay = self.active_relay().await?;
                self.crash_at_point(&relay, fault.down).await
            }
            FaultKind::ConsumerKill => {
                let mut starts = Vec::new();
                for consumer in consumers {
                    starts.push(supervisor.starts(&consumer.label)?);
                    supervisor.kill(&consumer.label, fault.down)?;
                }
                for (consumer, starts) in consumers.iter().zip(starts) {
                    self.wait_restarted(&consumer.label, starts).await?;
                }
                Ok(done(&labels(consumers)))
            }
            FaultKind::ConsumerCrashAfterCommit => {
                let crashes = consumers.iter().map(|c| self.crash_at_point(c, fault.down));
                let mut injected = done(&labels(consumers));
                let mut notes = Vec::new();
                for (consumer, crash) in consumers.iter().zip(join_all(crashes).await) {
                    let crash = crash?;
                    if !crash.happened {
                        injected.happened = false;
                    }
                    notes.extend(crash.note.map(|n| format!("{}: {n}", consumer.label)));
                }
                injected.note = (!notes.is_empty()).then(|| notes.join("; "));
                Ok(injected)
            }
            FaultKind::BrokerRestart => self.fault_kafka_node(fault, false).await,
            FaultKind::BrokerFreeze => self.fault_kafka_node(fault, true).await,
            FaultKind::BrokerRollingRestart => self.rolling_restart(fault).await,
            FaultKind::BrokersBelowMinIsr => self.below_min_isr(fault).await,
            FaultKind::RollingUpgrade => self.rolling_upgrade().await,
            FaultKind::PostgresRestart => self.restart_postgres(fault.down).await,
            FaultKind::Rebalance => self.rebalance(fault.down).await,
            FaultKind::ConsumerFreeze => {
                for consumer in consumers {
                    supervisor.signal(&consumer.label, Signal::SIGSTOP)?;
                }
                tokio::time::sleep(fault.down).await;
                for consumer in consumers {
                    supervisor.signal(&consumer.label, Signal::SIGCONT)?;
                }
                Ok(done(&labels(consumers)))
            }
            FaultKind::RelayFreeze => {
                let started = Instant::now();
                let relay = self.active_relay().await?;
                let standby = self.standby_of(&relay)?;
                supervisor.signal(&relay.label, Signal::SIGSTOP)?;
                let mut injected = self
                    .await_takeover(&standby, &[], Instant::now(), started + fault.down)
                    .await;
                tokio::time::sleep_until(started + fault.down).await;
                supervisor.signal(&relay.label, Signal::SIGCONT)?;
                self.note_step_down(&relay, &mut injected).await;
                injected.target = relay.label;
                Ok(injected)
            }
            FaultKind::DatabaseCut => {
                let started = Instant::now();
                let relay = self.active_relay().await?;
                let standby = self.standby_of(&relay)?;
                let topology = self.topology;
                let cut = std::iter::once(&relay).chain(consumers);
                if !cut.clone().all(|m| topology.cut_database(&m.label)) {
                    topology.restore_databases();
                    bail!("one of {} has no database proxy", labels(cut));
                }
                let mut injected = self
                    .await_takeover(&standby, consumers, Instant::now(), started + fault.down)
                    .await;
                tokio::time::sleep_until(started + fault.down).await;
                topology.restore_databases();
                self.note_step_down(&relay, &mut injected).await;
                injected.target = labels(std::iter::once(&relay).chain(consumers));
                Ok(injected)
            }
        }
    }

    /// Waits for the relay that froze or was cut off to report itself standing by, and notes
    /// what it counted: leases lost (by reason) and writes refused.
    async fn note_step_down(&self, relay: &Member, injected: &mut Injected) {
        let topology = self.topology;
        let stood_by = wait_until(
            &format!("{} to stand by", relay.label),
            Duration::from_secs(30),
            || async {
                let active = topology.scrape(relay.ops, "relay_active").await.ok();
                Ok((active == Some(0.0)).then_some(()))
            },
        )
        .await;
        let count = |metric: &'static str| async move {
            topology.scrape(relay.ops, metric).await.unwrap_or(f64::NAN)
        };
        let summary = format!(
            "{} stood by{}: leases lost {}, writes refused {}",
            relay.label,
            if stood_by.is_ok() {
                ""
            } else {
                " NOT within 30 s"
            },
            count("relay_lease_lost_total").await,
            count("relay_fenced_total").await,
        );
        injected.note = Some(match injected.note.take() {
            Some(note) => format!("{note}; {summary}"),
            None => summary,
        });
    }

    /// The relay other than `active`.
    pub(crate) fn standby_of(&self, active: &Member) -> anyhow::Result<Member> {
        self.topology
            .relays
            .iter()
            .find(|r| r.label != active.label)
            .cloned()
            .context("no standby relay")
    }

    /// Waits, until `until`, for `standby` to report itself active (timed from `in_place`, when
    /// the fault took hold) and for the cut-off `consumers` to have handed over their
    /// partitions; then for both groups to apply events. Reads the standby alone: the frozen
    /// relay would answer no probe.
    async fn await_takeover(
        &self,
        standby: &Member,
        consumers: &[Member],
        in_place: Instant,
        until: Instant,
    ) -> Injected {
        let topology = self.topology;
        let mut injected = done("");
        let relay_active = async {
            while Instant::now() < until {
                if topology.scrape(standby.ops, "relay_active").await.ok() == Some(1.0) {
                    return Some(in_place.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None
        };
        injected.takeover = relay_active.await;
        let mut notes = Vec::new();
        if injected.takeover.is_none() {
            notes.push(format!(
                "{} did not take over while the fault lasted",
                standby.label
            ));
        }
        for consumer in consumers {
            let handed_over = wait_until(
                &format!("{} to hand over its partitions", consumer.label),
                until.saturating_duration_since(Instant::now()),
                || async {
                    let assigned = topology
                        .scrape(consumer.ops, "consumer_assigned_partitions")
                        .await
                        .unwrap_or(f64::NAN);
                    Ok((assigned == 0.0).then_some(()))
                },
            )
            .await;
            if let Err(e) = handed_over {
                notes.push(format!("{e:#}"));
            }
        }
        if injected.takeover.is_some() {
            injected.recovered = wait_both_groups_apply(&self.env.pool, until).await;
            if injected.recovered.is_none() {
                notes.push("the groups applied nothing while the fault lasted".to_owned());
            }
        }
        injected.note = (!notes.is_empty()).then(|| notes.join("; "));
        injected
    }

    /// The planned member of each group, unless it has no partitions and the group's other
    /// member has: a crash point fires only in a consumer that processes batches.
    async fn consumer_targets(&self, planned: usize) -> Vec<Member> {
        let topology = self.topology;
        let mut targets = Vec::new();
        for preferred in topology.member_of_each_group(planned) {
            let mut target = preferred;
            for member in std::iter::once(preferred).chain(topology.group_members(preferred)) {
                let assigned = topology
                    .scrape(member.ops, "consumer_assigned_partitions")
                    .await
                    .unwrap_or(0.0);
                if assigned > 0.0 {
                    target = member;
                    break;
                }
            }
            targets.push(target.clone());
        }
        targets
    }

    pub(crate) async fn active_relay(&self) -> anyhow::Result<Member> {
        wait_until("an active relay", Duration::from_secs(60), || async {
            Ok(self.topology.active_relay().await.cloned())
        })
        .await
    }

    /// Waits until the supervisor has started `label` again after `starts` starts.
    pub(crate) async fn wait_restarted(&self, label: &str, starts: u32) -> anyhow::Result<()> {
        let supervisor = &self.topology.supervisor;
        wait_until(&format!("{label} restarted"), RECOVERY_DEADLINE, || async {
            Ok((supervisor.starts(label)? > starts && supervisor.is_up(label)).then_some(()))
        })
        .await
    }

    /// Arms a process's crash point, waits for it to fire (the process aborts) and for the
    /// process to be started again.
    async fn crash_at_point(&self, member: &Member, down: Duration) -> anyhow::Result<Injected> {
        let supervisor = &self.topology.supervisor;
        let starts = supervisor.starts(&member.label)?;
        supervisor.expect_exit(&member.label, down)?;
        std::fs::write(&member.trigger, b"crash\n")
            .with_context(|| format!("writing {}", member.trigger.display()))?;
        let fired = wait_until(
            &format!("{}'s crash point", member.label),
            TRIGGER_TIMEOUT,
            || async { Ok((!member.trigger.exists()).then_some(())) },
        )
        .await
        .is_ok()
            || !disarm(&member.trigger)?;
        if !fired {
            supervisor.unexpect_exit(&member.label)?;
            return Ok(Injected {
                note: Some(format!(
                    "crash point not reached within {TRIGGER_TIMEOUT:?}"
                )),
                ..not_injected(member.label.clone())
            });
        }
        self.wait_restarted(&member.label, starts).await?;
        Ok(done(&member.label))
    }

    async fn restart_postgres(&self, down: Duration) -> anyhow::Result<Injected> {
        let target = format!("postgresql {}", self.postgres.id());
        let own = self.env.databases();
        let server = &self.env.server_url;
        let others = wait_until(
            "other clients to leave PostgreSQL",
            SHARED_SERVER_WAIT,
            || async {
                let others = foreign_sessions(server, &own).await?;
                Ok(others.is_empty().then_some(()))
            },
        )
        .await;
        if others.is_err() {
            let sessions = foreign_sessions(server, &own).await.unwrap_or_default();
            return Ok(Injected {
                note: Some(format!(
                    "skipped: PostgreSQL is shared with other clients ({})",
                    sessions.join(", ")
                )),
                ..not_injected(target)
            });
        }
        self.postgres.stop_immediate().await?;
        tokio::time::sleep(down).await;
        self.postgres.start().await?;
        Ok(done(&target))
    }

    /// A third member joins each group, gets partitions, stays a while and leaves with SIGTERM.
    async fn rebalance(&self, dwell: Duration) -> anyhow::Result<Injected> {
        let topology = self.topology;
        let extras = &topology.extra_consumers;
        for extra in extras {
            topology.supervisor.start(topology.consumer_spec(extra)?)?;
        }
        let mut notes = Vec::new();
        for extra in extras {
            let joined = wait_until(
                &format!("{} to get partitions", extra.label),
                Duration::from_secs(60),
                || async {
                    let assigned = topology
                        .scrape(extra.ops, "consumer_assigned_partitions")
                        .await
                        .unwrap_or(0.0);
                    Ok((assigned > 0.0).then_some(()))
                },
            )
            .await;
            if let Err(e) = joined {
                notes.push(format!("{e:#}"));
            }
        }
        tokio::time::sleep(dwell).await;
        let stops = extras.iter().map(|extra| {
            topology
                .supervisor
                .stop(&extra.label, Duration::from_secs(30))
        });
        for (extra, status) in extras.iter().zip(join_all(stops).await) {
            match status? {
                Some(s) if s.success() => {}
                Some(s) => notes.push(format!("{} exited with {s} after SIGTERM", extra.label)),
                None => notes.push(format!("{} had to be killed after SIGTERM", extra.label)),
            }
        }
        Ok(Injected {
            note: (!notes.is_empty()).then(|| notes.join("; ")),
            ..done(&labels(extras))
        })
    }
}

/// `a and b`, `a, b and c`: the labels of the processes a fault hit.
fn labels<'a>(members: impl IntoIterator<Item = &'a Member>) -> String {
    let labels: Vec<&str> = members.into_iter().map(|m| m.label.as_str()).collect();
    match labels.split_last() {
        None => String::new(),
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// Removes an unfired trigger; `false` when it was already gone (it fired after all).
fn disarm(trigger: &Path) -> anyhow::Result<bool> {
    match std::fs::remove_file(trigger) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => bail!("removing {}: {e}", trigger.display()),
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
