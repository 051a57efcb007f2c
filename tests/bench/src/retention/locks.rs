//! Lock waits in one database, seen two ways:
//!
//! - [`LockWatch`]: every 50 ms, the backends of the database waiting for a heavyweight lock
//!   (`pg_stat_activity.wait_event_type = 'Lock'`) and how long each has waited
//!   (`pg_locks.waitstart`); the longest wait seen, and the statement that waited;
//! - [`ServerLog`]: with `log_lock_waits` on and `deadlock_timeout` at 100 ms for the database,
//!   PostgreSQL logs every wait longer than 100 ms ("still waiting for …", then "acquired …
//!   after N ms"); the lines the run appended to the server's log are counted.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::procstat::round1;

const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// The wait PostgreSQL is asked to log (`deadlock_timeout`, with `log_lock_waits`).
pub const LOGGED_WAIT_MS: u64 = 100;
/// Examples kept of each kind of line.
const EXAMPLES: usize = 5;

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
       a.backend_type || ': ' || l.locktype || ' ' || l.mode
       || coalesce(' on ' || l.relation::regclass::text, '') || ': '
       || left(regexp_replace(a.query, '\\s+', ' ', 'g'), 160)
       || coalesce(' | waits for: ' || (
              SELECT string_agg(b.backend_type || ': '
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

/// What the server log says about the database over the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoggedWaits {
    pub path: String,
    /// Bytes of log read (appended during the run, by every database of the server).
    pub bytes_read: u64,
    /// "still waiting for …" lines: waits longer than [`LOGGED_WAIT_MS`].
    pub still_waiting: u64,
    /// The longest wait an "acquired … after N ms" or "still waiting … after N ms" line gives.
    pub longest_ms: Option<f64>,
    pub deadlocks: u64,
    /// ERROR and FATAL lines of the database.
    pub errors: u64,
    /// A few of each: the wait lines with the statement that waited, the errors.
    pub wait_examples: Vec<String>,
    pub error_examples: Vec<String>,
}

/// The server's log.
pub struct ServerLog {
    path: PathBuf,
}

impl ServerLog {
    /// `path`, or the file the server logs to: its current log file when it runs a logging
    /// collector, else Debian's `/var/log/postgresql/postgresql-<version>-<cluster>.log`.
    pub async fn open(pool: &PgPool, path: Option<&Path>) -> anyhow::Result<ServerLog> {
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => server_log_path(pool).await?,
        };
        let log = ServerLog { path };
        let _ = log.position()?;
        Ok(log)
    }

    /// Its path.
    pub fn display(&self) -> String {
        self.path.display().to_string()
    }

    /// Where the log ends now.
    pub fn position(&self) -> anyhow::Result<u64> {
        Ok(std::fs::metadata(&self.path)
            .map_err(|e| anyhow::anyhow!("server log {}: {e}", self.path.display()))?
            .len())
    }

    /// Reads what was appended since `from` (a [`ServerLog::position`]) and picks out the lines
    /// of `database`; relations are named as `pool`'s database names them.
    pub async fn read_from(
        &self,
        from: u64,
        database: &str,
        pool: &PgPool,
    ) -> anyhow::Result<LoggedWaits> {
        let mut file = std::fs::File::open(&self.path)?;
        let len = file.metadata()?.len();
        // A log rotated in between is read from its beginning.
        let from = if len >= from { from } else { 0 };
        let _ = file.seek(SeekFrom::Start(from))?;
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes)?;
        let text = String::from_utf8_lossy(&bytes);
        let mut out = scan(&text, database);
        out.path = self.path.display().to_string();
        out.bytes_read = bytes.len() as u64;
        for line in out.wait_examples.iter_mut().chain(&mut out.error_examples) {
            *line = name_relations(line, pool).await;
        }
        Ok(out)
    }
}

/// `line` with "relation <oid> of database <oid>" replaced by the relation's name.
async fn name_relations(line: &str, pool: &PgPool) -> String {
    let Some(start) = line.find("relation ") else {
        return line.to_owned();
    };
    let rest = &line[start + 9..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let Ok(oid) = digits.parse::<i64>() else {
        return line.to_owned();
    };
    let after = &rest[digits.len()..];
    let after = match after.strip_prefix(" of database ") {
        Some(a) => a.trim_start_matches(|c: char| c.is_ascii_digit()),
        None => after,
    };
    let name: Option<String> = sqlx::query_scalar("SELECT $1::oid::regclass::text")
        .bind(oid)
        .fetch_one(pool)
        .await
        .ok();
    match name {
        Some(name) => format!("{}relation {name}{after}", &line[..start]),
        None => line.to_owned(),
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
        let logged = self
            .logged
            .as_ref()
            .and_then(|l| l.longest_ms)
            .unwrap_or(0.0);
        logged.max(self.sampled.longest_ms)
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

async fn server_log_path(pool: &PgPool) -> anyhow::Result<PathBuf> {
    let (current, data_dir, cluster, version): (Option<String>, String, String, String) =
        sqlx::query_as(
            "SELECT pg_current_logfile(), current_setting('data_directory'),
                    current_setting('cluster_name'), current_setting('server_version_num')",
        )
        .fetch_one(pool)
        .await?;
    if let Some(current) = current {
        return Ok(Path::new(&data_dir).join(current));
    }
    let major = version.parse::<u32>().unwrap_or(0) / 10_000;
    let cluster = cluster.rsplit('/').next().unwrap_or("main").to_owned();
    Ok(PathBuf::from(format!(
        "/var/log/postgresql/postgresql-{major}-{cluster}.log"
    )))
}

/// The lines of `database` in `text`, a stretch of a log whose line prefix names the database
/// (`%u@%d`, as Debian's default `%m [%p] %q%u@%d ` does). Each example kept is followed by the
/// statement the server logs after it.
fn scan(text: &str, database: &str) -> LoggedWaits {
    let tag = format!("@{database} ");
    let mut out = LoggedWaits::default();
    // Backends ([pid]) whose kept example waits for its STATEMENT line: (an error?, its index).
    let mut open: HashMap<String, (bool, usize)> = HashMap::new();
    let mut longest: Option<f64> = None;
    // The example whose statement runs on over the lines that follow (a statement's own line
    // breaks are logged as they are, without the prefix).
    let mut continued: Option<(bool, usize)> = None;
    for line in text.lines() {
        if !starts_with_timestamp(line) {
            if let Some((error, i)) = continued {
                let examples = if error {
                    &mut out.error_examples
                } else {
                    &mut out.wait_examples
                };
                append_statement(&mut examples[i], line);
            }
            continue;
        }
        continued = None;
        if !line.contains(&tag) {
            continue;
        }
        let pid = line
            .split('[')
            .nth(1)
            .and_then(|r| r.split(']').next())
            .unwrap_or("")
            .to_owned();
        let message = line.split_once(&tag).map_or(line, |(_, m)| m);
        let is_wait = message.contains("still waiting for") || message.contains(" acquired ");
        let is_error = message.starts_with("ERROR:") || message.starts_with("FATAL:");
        if is_wait {
            if message.contains("still waiting for") {
                out.still_waiting += 1;
            }
            if let Some(ms) = after_ms(message) {
                longest = Some(longest.map_or(ms, |l: f64| l.max(ms)));
            }
            if out.wait_examples.len() < EXAMPLES * 2 {
                let _ = open.insert(pid, (false, out.wait_examples.len()));
                out.wait_examples.push(message.to_owned());
            }
        } else if is_error {
            if message.contains("deadlock detected") {
                out.deadlocks += 1;
            }
            out.errors += 1;
            if out.error_examples.len() < EXAMPLES {
                let _ = open.insert(pid, (true, out.error_examples.len()));
                out.error_examples.push(message.to_owned());
            }
        } else if let Some(statement) = message.strip_prefix("STATEMENT:") {
            let Some((error, i)) = open.remove(&pid) else {
                continue;
            };
            let examples = if error {
                &mut out.error_examples
            } else {
                &mut out.wait_examples
            };
            examples[i].push_str(" | STATEMENT:");
            append_statement(&mut examples[i], statement);
            continued = Some((error, i));
        }
    }
    out.longest_ms = longest.map(round1);
    out
}

/// Adds a line of a statement to an example, its white space collapsed, up to a length.
fn append_statement(example: &mut String, line: &str) {
    const LONGEST: usize = 400;
    for word in line.split_whitespace() {
        if example.len() + word.len() + 1 > LONGEST {
            return;
        }
        example.push(' ');
        example.push_str(word);
    }
}

/// Whether a log line begins with a timestamp (`%m`: 2026-11-26 05:03:08.797 UTC): the first
/// line of a message rather than the continuation of a statement.
fn starts_with_timestamp(line: &str) -> bool {
    let b = line.as_bytes();
    b.len() > 10
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b' '
}

/// N of "… after N ms".
fn after_ms(message: &str) -> Option<f64> {
    let rest = &message[message.rfind("after ")? + 6..];
    rest.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
2026-11-26 05:03:08.797 UTC [2547] LOG:  checkpoint starting: time
2026-11-26 05:03:09.100 UTC [3001] postgres@pt_ret LOG:  process 3001 still waiting for ShareLock on transaction 812 after 100.155 ms
2026-11-26 05:03:09.100 UTC [3001] postgres@pt_ret DETAIL:  Process holding the lock: 3002. Wait queue: 3001.
2026-11-26 05:03:09.100 UTC [3001] postgres@pt_ret STATEMENT:  DELETE FROM processed_message WHERE true
2026-11-26 05:03:09.300 UTC [3001] postgres@pt_ret LOG:  process 3001 acquired ShareLock on transaction 812 after 301.5 ms
2026-11-26 05:03:09.400 UTC [4001] postgres@pt_other LOG:  process 4001 still waiting for ShareLock on transaction 9 after 5000.1 ms
2026-11-26 05:03:09.500 UTC [3003] postgres@pt_ret ERROR:  deadlock detected
2026-11-26 05:03:09.500 UTC [3003] postgres@pt_ret STATEMENT:  
	WITH batch AS (
	    SELECT id FROM applied_effect)
2026-11-26 05:03:09.600 UTC [2547] LOG:  checkpoint complete
";

    #[test]
    fn counts_the_databases_waits_and_the_longest() {
        let w = scan(LOG, "pt_ret");
        assert_eq!(w.still_waiting, 1);
        assert_eq!(w.longest_ms, Some(301.5));
        assert_eq!(w.deadlocks, 1);
        assert_eq!(w.errors, 1);
        assert!(w.wait_examples[0].ends_with("STATEMENT: DELETE FROM processed_message WHERE true"));
        assert!(w.error_examples[0]
            .ends_with("STATEMENT: WITH batch AS ( SELECT id FROM applied_effect)"));
        assert_eq!(scan(LOG, "pt_none").still_waiting, 0);
    }
}
