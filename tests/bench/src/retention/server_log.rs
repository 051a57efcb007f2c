//! PostgreSQL's server log, read for one database's lock waits: with `log_lock_waits` on and
//! `deadlock_timeout` at [`LOGGED_WAIT_MS`] for the database, the server logs every wait longer
//! than that ("still waiting for …", then "acquired … after N ms"), and the statement that
//! waited.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Serialize;
use sqlx::PgPool;

#[cfg(doc)]
use super::locks::LOGGED_WAIT_MS;
use crate::procstat::round1;

/// Examples kept of each kind of line.
const EXAMPLES: usize = 5;

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
    /// The longest of those whose statement was a partition's detach (retention's, waiting for
    /// the transactions reading the table to end).
    pub detach_longest_ms: Option<f64>,
    /// The longest of the others.
    pub pipeline_longest_ms: Option<f64>,
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
    // Waits (by backend) whose statement has not been seen yet: what they waited, ms.
    let mut unclassified: HashMap<String, f64> = HashMap::new();
    let classify = |out: &mut LoggedWaits, ms: f64, statement: &str| {
        let longest = if statement.contains("DETACH PARTITION") {
            &mut out.detach_longest_ms
        } else {
            &mut out.pipeline_longest_ms
        };
        *longest = Some(longest.map_or(ms, |l: f64| l.max(ms)));
    };
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
                if let Some(earlier) = unclassified.insert(pid.clone(), ms) {
                    classify(&mut out, earlier, "");
                }
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
            if let Some(ms) = unclassified.remove(&pid) {
                classify(&mut out, ms, statement);
            }
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
    for ms in unclassified.into_values() {
        classify(&mut out, ms, "");
    }
    out.longest_ms = longest.map(round1);
    out.detach_longest_ms = out.detach_longest_ms.map(round1);
    out.pipeline_longest_ms = out.pipeline_longest_ms.map(round1);
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
2026-11-26 05:03:09.350 UTC [3004] postgres@pt_ret LOG:  process 3004 acquired ShareLock on virtual transaction 17/8368 after 900.2 ms
2026-11-26 05:03:09.350 UTC [3004] postgres@pt_ret STATEMENT:  ALTER TABLE applied_effect DETACH PARTITION applied_effect_p20261128t030700 CONCURRENTLY
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
        assert_eq!(w.longest_ms, Some(900.2));
        assert_eq!(w.detach_longest_ms, Some(900.2));
        assert_eq!(w.pipeline_longest_ms, Some(301.5));
        assert_eq!(w.deadlocks, 1);
        assert_eq!(w.errors, 1);
        assert!(w.wait_examples[0].ends_with("STATEMENT: DELETE FROM processed_message WHERE true"));
        assert!(w.error_examples[0]
            .ends_with("STATEMENT: WITH batch AS ( SELECT id FROM applied_effect)"));
        assert_eq!(scan(LOG, "pt_none").still_waiting, 0);
    }
}
