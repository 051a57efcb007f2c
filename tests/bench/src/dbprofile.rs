//! Where a phase's database time goes: a sampler reads `pg_stat_activity` of the phase's database
//! every 25 ms and tallies what each client connection is doing (running which statement,
//! waiting on a lock, or idle in a transaction while the client works), so the report can say
//! "the relay spends its time in the claim" or "inventory batches wait on stock row locks". It
//! also adds up the CPU of the server processes serving each client program (by the
//! connections' `application_name`), so PostgreSQL's share is split by who asked for the work.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Connection, PgConnection};

use super::procstat::{CpuUse, BENCH, POSTGRES};
use super::statements::{self, StatementProfile, StatementProfiler};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const SAMPLE_EVERY: Duration = Duration::from_millis(25);
/// Server processes' CPU is read every this many samples.
const CPU_EVERY: u64 = 8;
/// Characters of a statement kept to name it.
const HEAD: usize = 64;
/// Marks the statements the benchmark itself runs while it samples (a leading SQL comment), so
/// the tally leaves them out.
pub const OWN: &str = "/* bench */";

/// What the connections of one database were doing, on average over a phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DbActivity {
    pub samples: u64,
    /// (what, connections doing it on average), busiest first: `run: <statement>`,
    /// `lock wait: <statement>`, `idle in transaction after: <statement>`. Idle connections
    /// are left out.
    pub busy: Vec<(String, f64)>,
    /// CPU% (100 = one core) of the PostgreSQL backends serving each client program, by
    /// `application_name`, over the phase.
    pub cpu_by_client: BTreeMap<String, f64>,
    /// What each client asked of the database (`None`: `pg_stat_statements` not read).
    pub statements: Option<StatementProfile>,
    /// CPU seconds of the server process that ran this sampler's own queries: the benchmark's
    /// load on PostgreSQL, not the pipeline's ([`DbActivity::charge_sampler`]).
    pub sampler_cpu_seconds: f64,
}

impl DbActivity {
    /// `cpu` with the sampler's own server CPU moved from PostgreSQL to the benchmark.
    #[must_use]
    pub fn charge_sampler(&self, cpu: CpuUse) -> CpuUse {
        cpu.moved(POSTGRES, BENCH, self.sampler_cpu_seconds)
    }
}

impl DbActivity {
    /// The `n` busiest entries on one line.
    pub fn summary(&self, n: usize) -> String {
        let parts: Vec<String> = self
            .busy
            .iter()
            .take(n)
            .map(|(what, avg)| format!("{avg:.2} {what}"))
            .collect();
        let cpu: Vec<String> = self
            .cpu_by_client
            .iter()
            .map(|(client, p)| format!("{client} {p:.0}%"))
            .collect();
        format!(
            "{}; PostgreSQL CPU by client: {}",
            parts.join(" | "),
            cpu.join(", ")
        )
    }
}

/// A running sampler.
pub struct DbProfiler {
    stop: CancellationToken,
    task: JoinHandle<DbActivity>,
    statements: Option<StatementProfiler>,
}

impl DbProfiler {
    /// Starts sampling the database `database_url` names, on a connection of its own.
    pub async fn start(database_url: &str) -> anyhow::Result<DbProfiler> {
        let statements = match statements::enabled() {
            true => Some(StatementProfiler::start(super::envs::database_name(database_url)).await?),
            false => None,
        };
        let conn = PgConnection::connect(database_url).await?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(sample(conn, stop.clone()));
        Ok(DbProfiler {
            stop,
            task,
            statements,
        })
    }

    /// Stops and returns the tally (empty if the sampler failed).
    pub async fn finish(self) -> DbActivity {
        self.stop.cancel();
        let mut activity = self.task.await.unwrap_or_default();
        if let Some(profiler) = self.statements {
            activity.statements = profiler.finish().await.ok();
        }
        activity
    }
}

type Row = (
    Option<String>,
    Option<String>,
    Option<String>,
    i32,
    Option<String>,
);

/// One backend's CPU ticks: its client, and the first and latest reading.
struct BackendCpu {
    client: String,
    first: u64,
    last: u64,
}

async fn sample(mut conn: PgConnection, stop: CancellationToken) -> DbActivity {
    let own: Option<u32> = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .ok()
        .and_then(|pid| u32::try_from(pid).ok());
    let own_start = own.and_then(super::procstat::cpu_ticks);
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut backends: HashMap<u32, BackendCpu> = HashMap::new();
    let started = Instant::now();
    let mut samples = 0u64;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while !stop.is_cancelled() {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let rows: Vec<Row> = match sqlx::query_as(
            "/* bench */ SELECT state, wait_event_type, query, pid, application_name
             FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
               AND backend_type IN ('client backend', 'walsender')",
        )
        .fetch_all(&mut conn)
        .await
        {
            Ok(rows) => rows,
            Err(_) => break,
        };
        let read_cpu = samples.is_multiple_of(CPU_EVERY);
        samples += 1;
        for (state, wait, query, pid, client) in rows {
            if let Some(what) = classify(state.as_deref(), wait.as_deref(), query.as_deref()) {
                *counts.entry(what).or_insert(0) += 1;
            }
            let ticks = u32::try_from(pid)
                .ok()
                .and_then(|pid| Some((pid, super::procstat::cpu_ticks(pid)?)));
            if let (true, Some((pid, ticks))) = (read_cpu, ticks) {
                let b = backends.entry(pid).or_insert_with(|| BackendCpu {
                    client: client
                        .filter(|c| !c.is_empty())
                        .unwrap_or_else(|| "?".into()),
                    first: ticks,
                    last: ticks,
                });
                b.last = ticks;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-3);
    let mut cpu_by_client: BTreeMap<String, f64> = BTreeMap::new();
    for b in backends.values() {
        // USER_HZ ticks: 100 per second.
        *cpu_by_client.entry(b.client.clone()).or_insert(0.0) +=
            (b.last - b.first) as f64 / seconds;
    }
    for p in cpu_by_client.values_mut() {
        *p = super::procstat::round1(*p);
    }
    let mut busy: Vec<(String, f64)> = counts
        .into_iter()
        .map(|(what, n)| {
            (
                what,
                (n as f64 / samples.max(1) as f64 * 100.0).round() / 100.0,
            )
        })
        .filter(|(_, avg)| *avg > 0.0)
        .collect();
    busy.sort_by(|a, b| b.1.total_cmp(&a.1));
    busy.truncate(12);
    let sampler_cpu_seconds = match (own_start, own.and_then(super::procstat::cpu_ticks)) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / 100.0,
        _ => 0.0,
    };
    DbActivity {
        samples,
        busy,
        cpu_by_client,
        statements: None,
        sampler_cpu_seconds,
    }
}

/// What one connection is doing; `None` when idle or when it is the benchmark's own query.
fn classify(state: Option<&str>, wait: Option<&str>, query: Option<&str>) -> Option<String> {
    let query = query.unwrap_or("");
    if query.starts_with(OWN) {
        return None;
    }
    let head: String = query.split_whitespace().collect::<Vec<_>>().join(" ");
    let head: String = head.chars().take(HEAD).collect();
    match (state?, wait) {
        ("active", Some("Lock")) => Some(format!("lock wait: {head}")),
        ("active", _) => Some(format!("run: {head}")),
        ("idle in transaction", _) => Some(format!("idle in transaction after: {head}")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::classify;

    #[test]
    fn names_what_a_connection_does() {
        let q = Some("SELECT 1 FROM inventory_stock\n   WHERE product_id = ANY($1)");
        assert_eq!(
            classify(Some("active"), Some("Lock"), q).as_deref(),
            Some("lock wait: SELECT 1 FROM inventory_stock WHERE product_id = ANY($1)")
        );
        assert_eq!(classify(Some("idle"), None, q), None);
        assert_eq!(
            classify(
                Some("active"),
                None,
                Some("/* bench */ SELECT count(*) FROM outbox")
            ),
            None
        );
    }
}
