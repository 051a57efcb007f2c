//! Lock waits in one database, seen two ways:
//!
//! - [`LockWatch`]: every 50 ms, the backends of the database waiting for a heavyweight lock
//!   (`pg_stat_activity.wait_event_type = 'Lock'`) and how long each has waited
//!   (`pg_locks.waitstart`); the longest wait seen, and the statement that waited;
//! - [`ServerLog`] (`server_log`): the waits longer than 100 ms the server logged.

use std::collections::HashMap;
use std::time::Duration;

use pipeline_core::retention::runner::STEP_APPLICATION_SUFFIX;
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use super::server_log::{LoggedWaits, ServerLog};
use crate::procstat::round1;

const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// The wait PostgreSQL is asked to log (`deadlock_timeout`, with `log_lock_waits`).
pub const LOGGED_WAIT_MS: u64 = 100;

/// Asks PostgreSQL to log every lock wait in `database` longer than [`LOGGED_WAIT_MS`], for the
/// sessions that start from now on.
pub async fn log_lock_waits(pool: &PgPool, database: &str) -> anyhow::Result<()> {
    for setting in [
        "log_lock_waits = on".to_owned(),
        format!("deadlock_timeout = '{LOGGED_WAIT_MS}ms'"),
    ] {
        sqlx::query(&format!("ALTER DATABASE \"{database}\" SET {setting}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// What the sampler saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SampledWaits {
    pub samples: u64,
    /// Distinct lock waits seen (a backend, from its wait start).
    pub waits: u64,
    /// Of those, seen at [`LOGGED_WAIT_MS`] or longer.
    pub waits_over_logged_ms: u64,
    /// The longest wait seen, ms (a sample lands at most 50 ms before its end).
    pub longest_ms: f64,
    /// What waited longest: backend type, lock type and mode (and relation), statement, and the
    /// statements of the backends it waited for.
    pub longest: Option<String>,
    /// The waits seen at [`LOGGED_WAIT_MS`] or longer (up to ten): ms, and what waited for what.
    pub long_waits: Vec<(f64, String)>,
    /// Waits in which a retention step waited or was waited for (its session's application name
    /// ends in the runner's mark while the step runs).
    pub retention_waits: u64,
    /// The longest of those, ms.
    pub retention_longest_ms: f64,
    /// The longest wait of a statement of the pipeline (any but a retention step's), ms.
    pub pipeline_longest_ms: f64,
    /// What waited longest of those.
    pub pipeline_longest: Option<String>,
    /// Waits of a statement of the pipeline for a retention step.
    pub held_by_retention: u64,
    /// The longest of those, ms.
    pub held_by_retention_longest_ms: f64,
}

/// Of a wait as the sampler describes it (`waiter | waits for: holders`), whether a retention
/// step waited and whether one was waited for.
fn retention_sides(what: &str) -> (bool, bool) {
    let (waiter, holders) = what.split_once(" | waits for: ").unwrap_or((what, ""));
    (
        waiter.contains(STEP_APPLICATION_SUFFIX),
        holders.contains(STEP_APPLICATION_SUFFIX),
    )
}

/// A running sampler.
pub struct LockWatch {
    stop: CancellationToken,
    task: JoinHandle<SampledWaits>,
}

type Waiting = (i32, Option<f64>, f64, String);

/// Backends of the database waiting for a heavyweight lock: since when, how long so far, and
/// what waits for what.
const WAITING_SQL: &str = "/* bench */
SELECT a.pid, extract(epoch FROM l.waitstart)::float8,
       coalesce(extract(epoch FROM clock_timestamp() - l.waitstart) * 1000, 0)::float8,
       a.backend_type || coalesce(' [' || nullif(a.application_name, '') || ']', '')
       || ': ' || l.locktype || ' ' || l.mode
       || coalesce(' on ' || l.relation::regclass::text, '') || ': '
       || left(regexp_replace(a.query, '\\s+', ' ', 'g'), 160)
       || coalesce(' | waits for: ' || (
              SELECT string_agg(b.backend_type
                                || coalesce(' [' || nullif(b.application_name, '') || ']', '')
                                || ': '
                                || left(regexp_replace(b.query, '\\s+', ' ', 'g'), 120), ' / ')
              FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids(a.pid))), '')
FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted
WHERE a.datname = current_database() AND a.wait_event_type = 'Lock'";

impl LockWatch {
    /// Starts sampling the database `database_url` names, on a connection of its own.
    pub async fn start(database_url: &str) -> anyhow::Result<LockWatch> {
        let mut conn = PgConnection::connect(database_url).await?;
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = SampledWaits::default();
            let mut waits: HashMap<(i32, u64), (f64, String)> = HashMap::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                seen.samples += 1;
                // pg_stat_activity first: reading pg_locks takes every lock-manager partition's
                // lock, so only when someone waits.
                let waiting: i64 = match sqlx::query_scalar(
                    "/* bench */ SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&mut conn)
                .await
                {
                    Ok(n) => n,
                    Err(_) => break,
                };
                if waiting == 0 {
                    continue;
                }
                let rows: Vec<Waiting> = sqlx::query_as(WAITING_SQL)
                    .fetch_all(&mut conn)
                    .await
                    .unwrap_or_default();
                for (pid, start, ms, what) in rows {
                    let key = (pid, start.map_or(0, |s| (s * 1e6) as u64));
                    let wait = waits.entry(key).or_insert((0.0, String::new()));
                    if ms >= wait.0 {
                        *wait = (ms, what.clone());
                    }
                    if ms > seen.longest_ms {
                        seen.longest_ms = round1(ms);
                        seen.longest = Some(what);
                    }
                }
            }
            seen.waits = waits.len() as u64;
            for (ms, what) in waits.values() {
                let (retention_waited, retention_held) = retention_sides(what);
                if retention_waited || retention_held {
                    seen.retention_waits += 1;
                    seen.retention_longest_ms = seen.retention_longest_ms.max(round1(*ms));
                }
                if !retention_waited {
                    if *ms > seen.pipeline_longest_ms {
                        seen.pipeline_longest_ms = round1(*ms);
                        seen.pipeline_longest = Some(what.clone());
                    }
                    if retention_held {
                        seen.held_by_retention += 1;
                        seen.held_by_retention_longest_ms =
                            seen.held_by_retention_longest_ms.max(round1(*ms));
                    }
                }
            }
            let mut long: Vec<(f64, String)> = waits
                .into_values()
                .filter(|(ms, _)| *ms >= LOGGED_WAIT_MS as f64)
                .map(|(ms, what)| (round1(ms), what))
                .collect();
            seen.waits_over_logged_ms = long.len() as u64;
            long.sort_by(|a, b| b.0.total_cmp(&a.0));
            long.truncate(10);
            seen.long_waits = long;
            let _ = conn.close().await;
            seen
        });
        Ok(LockWatch { stop, task })
    }

    /// Stops and returns what was seen.
    pub async fn finish(self) -> SampledWaits {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

/// Lock waits over one part of the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LockWaits {
    pub sampled: SampledWaits,
    /// `None` when the server's log could not be read.
    pub logged: Option<LoggedWaits>,
}

impl LockWaits {
    /// The longest wait either way of watching saw, ms.
    pub fn longest_ms(&self) -> f64 {
        self.logged_ms(|l| l.longest_ms)
            .max(self.sampled.longest_ms)
    }

    /// The longest wait of a statement of the pipeline either way of watching saw, ms: the
    /// sampler tells a retention step by its session's name, the log a partition's detach by
    /// its statement (a retention step's wait there counts as the pipeline's).
    pub fn pipeline_longest_ms(&self) -> f64 {
        self.logged_ms(|l| l.pipeline_longest_ms)
            .max(self.sampled.pipeline_longest_ms)
    }

    /// A figure of the server log, 0 where it was not read or has none.
    fn logged_ms(&self, figure: impl Fn(&LoggedWaits) -> Option<f64>) -> f64 {
        self.logged.as_ref().and_then(figure).unwrap_or(0.0)
    }
}

/// Watches lock waits in one database, part by part.
pub struct Locks<'a> {
    pub database_url: &'a str,
    pub database: &'a str,
    pub pool: &'a PgPool,
    pub log: Option<ServerLog>,
}

/// Lock waits being watched over one part.
pub struct PartWatch<'l, 'a> {
    locks: &'l Locks<'a>,
    sampler: LockWatch,
    log_from: Option<u64>,
}

impl<'a> Locks<'a> {
    /// Starts watching a part.
    pub async fn watch(&self) -> anyhow::Result<PartWatch<'_, 'a>> {
        Ok(PartWatch {
            locks: self,
            sampler: LockWatch::start(self.database_url).await?,
            log_from: self.log.as_ref().and_then(|l| l.position().ok()),
        })
    }
}

impl PartWatch<'_, '_> {
    /// Stops watching; the log's part is read now.
    pub async fn finish(self) -> LockWaits {
        let sampled = self.sampler.finish().await;
        let logged = match (&self.locks.log, self.log_from) {
            (Some(log), Some(from)) => log
                .read_from(from, self.locks.database, self.locks.pool)
                .await
                .ok(),
            _ => None,
        };
        LockWaits { sampled, logged }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_tells_which_side_was_a_retention_step() {
        let step = format!("client backend [consumer{STEP_APPLICATION_SUFFIX}]");
        let detach = format!(
            "{step}: virtualxid ShareLock: ALTER TABLE \"applied_effect\" DETACH PARTITION \
             \"applied_effect_p1\" CONCURRENTLY | waits for: client backend [consumer]: COMMIT"
        );
        assert_eq!(retention_sides(&detach), (true, false));
        let held = format!(
            "client backend [consumer]: transactionid ShareLock: INSERT INTO processed_message \
             | waits for: client backend [relay]: COMMIT / {step}: WITH state AS"
        );
        assert_eq!(retention_sides(&held), (false, true));
        let neither = "client backend [consumer]: tuple ExclusiveLock: UPDATE inventory_stock \
                       | waits for: client backend [consumer]: COMMIT";
        assert_eq!(retention_sides(neither), (false, false));
        assert_eq!(
            retention_sides("client backend [consumer]: extend"),
            (false, false)
        );
    }
}
