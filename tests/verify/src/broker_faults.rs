//! The faults on the Kafka nodes: one killed and started again with its data, one frozen past
//! its session, all three restarted one after the other, and two down at once (the cluster then
//! takes no writes: fewer than `min.insync.replicas` and no controller quorum).
//!
//! For a node killed or frozen the run measures the failover (until every partition the node led
//! has a new leader from the in-sync replicas) and, like for two nodes down, how long the relay
//! took to publish again (see [`super::publishing`]).

use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::Signal;
use pipeline_testkit::wait_until;
use tokio::time::Instant;

use super::fault_plan::PlannedFault;
use super::faults::Injector;
use super::injection::{done, Injected, WriteOutage, OUTAGE_GRACE, RECOVERY_DEADLINE};
use super::kafka_cluster::{self, NODES};
use super::progress::say;
use super::publishing::{self, OutboxMark};

/// How long a node stopped with SIGTERM may take to exit (a controlled shutdown moves its
/// leaderships away first) before it is killed.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(60);
/// Events committed this long after a fault began were claimed by the relay after it.
const COMMITTED_AFTER: Duration = Duration::from_secs(1);
/// A node killed for good until the fault starts it again ([`Supervisor::restart_now`]).
///
/// [`Supervisor::restart_now`]: super::processes::Supervisor::restart_now
const HELD_DOWN: Duration = Duration::from_secs(24 * 3600);

impl Injector<'_> {
    /// Kills (or freezes) the Kafka node leading most partitions of the run's topic, measures
    /// until those partitions all have new leaders, starts it again with its data after
    /// `fault.down` (or wakes it), and waits until it is back in every partition's ISR.
    pub(crate) async fn fault_kafka_node(
        &self,
        fault: &PlannedFault,
        freeze: bool,
    ) -> anyhow::Result<Injected> {
        let (topic, cluster) = (&self.env.topic, &self.topology.cluster);
        let supervisor = &self.topology.supervisor;
        let view = cluster.view(None).await?;
        let (node, led) = view
            .busiest_leader(topic, fault.index)
            .context("no partition of the run's topic has a leader")?;
        let partitions = view.topic(topic).count();
        let label = kafka_cluster::label(node);
        let starts = supervisor.starts(&label)?;
        let started = Instant::now();
        if freeze {
            supervisor.signal(&label, Signal::SIGSTOP)?;
        } else {
            supervisor.kill(&label, fault.down)?;
        }
        let resumed = self.publish_resumed(started);
        let fault_and_back = async {
            let until = if freeze {
                started + fault.down
            } else {
                started + RECOVERY_DEADLINE
            };
            let failover = cluster.wait_failover(topic, node, until).await;
            if freeze {
                tokio::time::sleep_until(started + fault.down).await;
                supervisor.signal(&label, Signal::SIGCONT)?;
            } else {
                self.wait_restarted(&label, starts).await?;
            }
            let in_sync = cluster.wait_in_sync(node, RECOVERY_DEADLINE).await;
            anyhow::Ok((failover, in_sync))
        };
        let (outcome, resumed) = tokio::join!(fault_and_back, resumed);
        let (failover, in_sync) = outcome?;
        let mut notes = vec![format!(
            "{label} led {led} of the topic's {partitions} partitions"
        )];
        if failover.is_none() {
            notes.push(format!(
                "its partitions had no new leaders {}",
                if freeze {
                    "while it was stopped"
                } else {
                    "in time"
                }
            ));
        }
        match in_sync {
            Ok(()) => notes.push(format!(
                "in every ISR again {:.1} s after the fault",
                started.elapsed().as_secs_f64()
            )),
            Err(e) => anyhow::bail!("{label} {}: {e:#}", notes.join("; ")),
        }
        Ok(Injected {
            note: Some(notes.join("; ")),
            failover: Some(failover),
            publish_resumed: resumed,
            ..done(&label)
        })
    }

    /// When, after a fault that began at `started`, an event committed after it was marked
    /// published (`None` past the recovery deadline).
    async fn publish_resumed(&self, started: Instant) -> Option<Instant> {
        let pool = &self.env.pool;
        tokio::time::sleep_until(started + COMMITTED_AFTER).await;
        let since = publishing::mark_by(pool, started + RECOVERY_DEADLINE).await?;
        publishing::wait_published_after(pool, &since, started + RECOVERY_DEADLINE).await
    }

    /// Restarts the three nodes one after the other, starting from a different one each time:
    /// SIGTERM, its exit awaited (a controlled shutdown), started again after `fault.down`, and
    /// back in the ISR of every partition before the next.
    pub(crate) async fn rolling_restart(&self, fault: &PlannedFault) -> anyhow::Result<Injected> {
        let (cluster, supervisor) = (&self.topology.cluster, &self.topology.supervisor);
        let mut notes = Vec::new();
        for turn in 0..NODES {
            let node = cluster.nodes[(fault.index + turn) % NODES].id;
            let label = kafka_cluster::label(node);
            let starts = supervisor.starts(&label)?;
            let stopping = Instant::now();
            supervisor.terminate(&label, fault.down)?;
            let exited = wait_until(
                &format!("{label} to exit after SIGTERM"),
                SHUTDOWN_TIMEOUT,
                || async {
                    let gone = !supervisor.is_up(&label) || supervisor.starts(&label)? > starts;
                    Ok(gone.then_some(()))
                },
            )
            .await;
            let stopped = stopping.elapsed().as_secs_f64();
            if exited.is_err() {
                supervisor.kill(&label, fault.down)?;
                notes.push(format!(
                    "{label} had to be killed {stopped:.0} s after SIGTERM"
                ));
            }
            self.wait_restarted(&label, starts).await?;
            cluster
                .wait_in_sync(node, RECOVERY_DEADLINE)
                .await
                .with_context(|| format!("{label} after its restart"))?;
            let note = format!(
                "{label} exited {stopped:.1} s after SIGTERM, in every ISR again after {:.1} s",
                stopping.elapsed().as_secs_f64()
            );
            say(&note);
            notes.push(note);
        }
        Ok(Injected {
            note: Some(notes.join("; ")),
            ..done("kafka-1, kafka-2 and kafka-3")
        })
    }

    /// SIGKILLs the node leading most partitions of the run's topic and the next one, keeps
    /// both down for `fault.down` while checking that the relay marks nothing published, then
    /// starts the first again, measures until the relay publishes events committed during the
    /// outage, starts the second, and waits until both are in every ISR again.
    pub(crate) async fn below_min_isr(&self, fault: &PlannedFault) -> anyhow::Result<Injected> {
        let (topic, cluster) = (&self.env.topic, &self.topology.cluster);
        let (supervisor, pool) = (&self.topology.supervisor, &self.env.pool);
        let view = cluster.view(None).await?;
        let (first, _) = view
            .busiest_leader(topic, fault.index)
            .context("no partition of the run's topic has a leader")?;
        let second = first % NODES as i32 + 1;
        let down = [first, second].map(kafka_cluster::label);
        let starts = [supervisor.starts(&down[0])?, supervisor.starts(&down[1])?];
        let started = Instant::now();
        for label in &down {
            supervisor.kill(label, HELD_DOWN)?;
        }
        let outage = self.watch_outage(started, fault.down).await;
        let returned = Instant::now();
        supervisor.restart_now(&down[0])?;
        let resumed = match &outage {
            Ok((since, _)) => {
                publishing::wait_published_after(pool, since, returned + RECOVERY_DEADLINE).await
            }
            Err(_) => None,
        };
        supervisor.restart_now(&down[1])?;
        for (label, starts) in down.iter().zip(starts) {
            self.wait_restarted(label, starts).await?;
        }
        for node in [first, second] {
            cluster
                .wait_in_sync(node, RECOVERY_DEADLINE)
                .await
                .with_context(|| format!("{} after the outage", kafka_cluster::label(node)))?;
        }
        let (_, mut outage) = outage?;
        outage.resumed_after_return_seconds = resumed.map(|t| round2((t - returned).as_secs_f64()));
        let note = format!(
            "marked published during the outage {} (committed during it {}); {} unpublished when \
             {} came back; publishing resumed {}; both in every ISR again {:.1} s after the fault",
            outage.published_during,
            outage.published_early,
            outage.unpublished_at_return,
            down[0],
            outage
                .resumed_after_return_seconds
                .map_or("never".to_owned(), |s| format!("{s:.1} s after that")),
            started.elapsed().as_secs_f64()
        );
        Ok(Injected {
            note: Some(note),
            publish_resumed: resumed,
            write_outage: Some(outage),
            ..done(&format!("{} and {}", down[0], down[1]))
        })
    }

    /// Watches the outbox while two nodes are down, until `down` after `started`: returns the
    /// mark after which events count as committed during the outage, and what was marked
    /// published meanwhile.
    async fn watch_outage(
        &self,
        started: Instant,
        down: Duration,
    ) -> anyhow::Result<(OutboxMark, WriteOutage)> {
        let pool = &self.env.pool;
        let until = started + down.max(OUTAGE_GRACE + COMMITTED_AFTER);
        tokio::time::sleep_until(started + COMMITTED_AFTER).await;
        let since = publishing::mark_by(pool, until)
            .await
            .context("reading the outbox during the outage")?;
        tokio::time::sleep_until(started + OUTAGE_GRACE).await;
        let after_grace = publishing::mark_by(pool, until)
            .await
            .context("reading the outbox during the outage")?;
        tokio::time::sleep_until(until).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let at_return = publishing::mark_by(pool, deadline)
            .await
            .context("reading the outbox at the end of the outage")?;
        let published_early = publishing::published_between(pool, &since, &at_return).await?;
        let unpublished_at_return = publishing::unpublished(pool).await?;
        Ok((
            since,
            WriteOutage {
                seconds: round2(started.elapsed().as_secs_f64()),
                published_during: at_return.published - after_grace.published,
                published_early,
                unpublished_at_return,
                resumed_after_return_seconds: None,
            },
        ))
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
