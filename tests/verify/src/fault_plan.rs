//! The fault plan: a deterministic sequence of fault kinds and waits derived from the seed.
//!
//! Faults come in rounds; each round is a seeded shuffle of every kind (minus skipped ones), so
//! the first round already injects one fault of each kind and the same seed always gives the
//! same plan.

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL the active relay; the standby takes over, the killed one restarts.
    RelayKill,
    /// The active relay aborts after its delivery reports, before marking the batch published.
    RelayCrashAfterDelivery,
    /// SIGKILL a member of each group.
    ConsumerKill,
    /// A member of each group aborts after a batch's database commit, before its offset commit.
    ConsumerCrashAfterCommit,
    /// SIGKILL the Kafka node leading most partitions of the run's topic and start it again with
    /// its data.
    BrokerRestart,
    /// `pg_ctlcluster … stop -m immediate`, then start PostgreSQL again.
    PostgresRestart,
    /// A third member joins each group, then leaves with SIGTERM.
    Rebalance,
    /// SIGSTOP a member of each group past its session timeout, then SIGCONT.
    ConsumerFreeze,
    /// SIGSTOP the active relay past its lease, then SIGCONT: the standby takes over, the old
    /// relay wakes up fenced.
    RelayFreeze,
    /// Cut the paths to PostgreSQL of the active relay and of a member of each group past the
    /// lease and the session timeout, then restore them: others take over, the cut-off ones
    /// change nothing.
    DatabaseCut,
    /// SIGSTOP the Kafka node leading most partitions of the run's topic past its session
    /// timeout (it is fenced, its partitions get new leaders), then SIGCONT.
    BrokerFreeze,
    /// Restart the three Kafka nodes one after the other, each stopped with SIGTERM (a
    /// controlled shutdown), started again once it exited, and back in the ISR of every
    /// partition before the next.
    BrokerRollingRestart,
    /// SIGKILL two Kafka nodes at once: fewer than `min.insync.replicas` remain (and no
    /// controller quorum), so the cluster takes no writes. The relay must keep its events
    /// unpublished and retried, and publish them once one node is back; the other follows.
    BrokersBelowMinIsr,
    /// Replace every relay, consumer and the order service by a new release's binary, one at a
    /// time, each stopped with SIGTERM and its manifest's grace period (see `upgrade`).
    RollingUpgrade,
}

impl FaultKind {
    pub const ALL: [FaultKind; 14] = [
        FaultKind::RelayKill,
        FaultKind::RelayCrashAfterDelivery,
        FaultKind::ConsumerKill,
        FaultKind::ConsumerCrashAfterCommit,
        FaultKind::BrokerRestart,
        FaultKind::PostgresRestart,
        FaultKind::Rebalance,
        FaultKind::ConsumerFreeze,
        FaultKind::RelayFreeze,
        FaultKind::DatabaseCut,
        FaultKind::BrokerFreeze,
        FaultKind::BrokerRollingRestart,
        FaultKind::BrokersBelowMinIsr,
        FaultKind::RollingUpgrade,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::RelayKill => "relay_kill",
            FaultKind::RelayCrashAfterDelivery => "relay_crash_after_delivery",
            FaultKind::ConsumerKill => "consumer_kill",
            FaultKind::ConsumerCrashAfterCommit => "consumer_crash_after_commit",
            FaultKind::BrokerRestart => "broker_restart",
            FaultKind::PostgresRestart => "postgres_restart",
            FaultKind::Rebalance => "rebalance",
            FaultKind::ConsumerFreeze => "consumer_freeze",
            FaultKind::RelayFreeze => "relay_freeze",
            FaultKind::DatabaseCut => "database_cut",
            FaultKind::BrokerFreeze => "broker_freeze",
            FaultKind::BrokerRollingRestart => "broker_rolling_restart",
            FaultKind::BrokersBelowMinIsr => "brokers_below_min_isr",
            FaultKind::RollingUpgrade => "rolling_upgrade",
        }
    }

    /// Whether the pipeline must recover while the fault is still in place (a standby or another
    /// member takes over), within a bound.
    pub fn needs_takeover(self) -> bool {
        matches!(self, FaultKind::RelayFreeze | FaultKind::DatabaseCut)
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Seeded ranges of the fault plan's waits, in milliseconds (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Quiet time before each fault.
    pub gap_ms: (u64, u64),
    /// How long a killed or crashed process or PostgreSQL stays down, and how long each Kafka
    /// node of a rolling restart stays stopped.
    pub down_ms: (u64, u64),
    /// How long a killed Kafka node stays down: a few seconds, about its session timeout.
    pub broker_down_ms: (u64, u64),
    /// How long a frozen Kafka node stays stopped: past its session timeout and the failover
    /// bound, so that its partitions get new leaders meanwhile.
    pub broker_freeze_ms: (u64, u64),
    /// How long two Kafka nodes stay down together (the cluster takes no writes): shorter than
    /// the relay's delivery timeout, so that a batch it had in flight cannot end meanwhile.
    pub below_min_isr_ms: (u64, u64),
    /// How long a frozen consumer stays stopped: longer than its session timeout.
    pub freeze_ms: (u64, u64),
    /// How long the extra consumer of a rebalance stays after it got partitions.
    pub rebalance_dwell_ms: (u64, u64),
    /// How long a frozen relay stays stopped, or a cut path to PostgreSQL stays cut: past the
    /// relay's takeover bound and the consumers' limit.
    pub outage_ms: (u64, u64),
}

/// One fault of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedFault {
    pub index: usize,
    pub kind: FaultKind,
    /// Quiet time before the fault.
    pub gap: Duration,
    /// How long the faulted part stays down (killed, crashed, stopped, frozen, each node of a
    /// rolling restart, or the extra members' stay for a rebalance).
    pub down: Duration,
    /// Which of each group's two members a consumer fault hits (0 or 1).
    pub consumer: usize,
}

/// The first `count` faults of the plan of `seed`, leaving out the `skip` kinds.
pub fn plan(seed: u64, count: usize, timing: &Timing, skip: &[FaultKind]) -> Vec<PlannedFault> {
    let kinds: Vec<FaultKind> = FaultKind::ALL
        .into_iter()
        .filter(|k| !skip.contains(k))
        .collect();
    if kinds.is_empty() {
        return Vec::new();
    }
    // A stream of its own, so the plan does not depend on how the order mix uses the seed.
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6661_756c_7473);
    let mut faults = Vec::with_capacity(count);
    while faults.len() < count {
        let mut round = kinds.clone();
        round.shuffle(&mut rng);
        for kind in round.into_iter().take(count - faults.len()) {
            let down = match kind {
                FaultKind::ConsumerFreeze => timing.freeze_ms,
                FaultKind::RelayFreeze | FaultKind::DatabaseCut => timing.outage_ms,
                FaultKind::Rebalance => timing.rebalance_dwell_ms,
                FaultKind::BrokerRestart => timing.broker_down_ms,
                FaultKind::BrokerFreeze => timing.broker_freeze_ms,
                FaultKind::BrokersBelowMinIsr => timing.below_min_isr_ms,
                _ => timing.down_ms,
            };
            faults.push(PlannedFault {
                index: faults.len(),
                kind,
                gap: millis(&mut rng, timing.gap_ms),
                down: millis(&mut rng, down),
                consumer: rng.random_range(0..2),
            });
        }
    }
    faults
}

fn millis(rng: &mut StdRng, (low, high): (u64, u64)) -> Duration {
    Duration::from_millis(rng.random_range(low..=high.max(low)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const TIMING: Timing = Timing {
        gap_ms: (1_000, 3_000),
        down_ms: (500, 2_500),
        broker_down_ms: (500, 2_500),
        broker_freeze_ms: (9_000, 12_000),
        below_min_isr_ms: (8_000, 12_000),
        freeze_ms: (9_000, 11_000),
        rebalance_dwell_ms: (500, 2_000),
        outage_ms: (12_000, 15_000),
    };

    #[test]
    fn same_seed_same_plan() {
        assert_eq!(plan(7, 50, &TIMING, &[]), plan(7, 50, &TIMING, &[]));
        assert_ne!(plan(7, 50, &TIMING, &[]), plan(8, 50, &TIMING, &[]));
    }

    #[test]
    fn the_first_round_has_every_kind_once() {
        for seed in 0..20 {
            let kinds: HashSet<FaultKind> = plan(seed, FaultKind::ALL.len(), &TIMING, &[])
                .iter()
                .map(|f| f.kind)
                .collect();
            assert_eq!(kinds.len(), FaultKind::ALL.len());
        }
    }

    #[test]
    fn waits_stay_in_their_ranges_and_skipped_kinds_never_come() {
        let faults = plan(3, 40, &TIMING, &[FaultKind::PostgresRestart]);
        assert_eq!(faults.len(), 40);
        for f in &faults {
            assert_ne!(f.kind, FaultKind::PostgresRestart);
            assert!(f.gap >= Duration::from_secs(1) && f.gap <= Duration::from_secs(3));
            if f.kind == FaultKind::ConsumerFreeze {
                assert!(f.down >= Duration::from_secs(9));
            }
            assert!(f.consumer < 2);
        }
        assert!(plan(3, 5, &TIMING, &FaultKind::ALL).is_empty());
    }

    #[test]
    fn broker_faults_wait_in_their_own_ranges() {
        for f in plan(5, 60, &TIMING, &[]) {
            match f.kind {
                FaultKind::BrokerFreeze => {
                    assert!(f.down >= Duration::from_secs(9) && f.down <= Duration::from_secs(12));
                }
                FaultKind::BrokersBelowMinIsr => {
                    assert!(f.down >= Duration::from_secs(8) && f.down <= Duration::from_secs(12));
                }
                _ => {}
            }
        }
    }
}
