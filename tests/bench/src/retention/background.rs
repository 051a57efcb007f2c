//! What the server does beside the pipeline's statements, minute by minute: which tables
//! autovacuum works on (and in which phase), whether the checkpointer is writing or syncing,
//! what the database's busy backends wait on, and how much of the minute the machine's tasks
//! were stalled for CPU or for the disk (Linux's pressure figures, when the kernel has them).
//! Sampled once a second, on the minutes of the segment's latency figures, so a minute whose
//! end-to-end p99 jumps can be set beside what ran meanwhile.

use std::collections::BTreeMap;
use std::fs;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Seconds seen per activity in one minute of the measured part.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MinuteBackground {
    pub minute: u64,
    /// `vacuum <table> <phase>`, `checkpointer <wait event>` or `wait <type> <event>` (a
    /// backend of the database waiting), and the seconds it was seen.
    pub seconds: BTreeMap<String, u64>,
    /// Share of the minute some task waited for a CPU, in %.
    pub cpu_stalled_percent: Option<f64>,
    /// Share of the minute some task waited for the disk, in %.
    pub io_stalled_percent: Option<f64>,
    /// Share of the minute every runnable task waited for the disk at once, in %.
    pub io_full_percent: Option<f64>,
}

impl MinuteBackground {
    /// One line: `m3: vacuum processed_message vacuuming indexes 41s, …`.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        if let (Some(cpu), Some(io), Some(full)) = (
            self.cpu_stalled_percent,
            self.io_stalled_percent,
            self.io_full_percent,
        ) {
            parts.push(format!(
                "stalled: cpu {cpu:.0}%, io {io:.0}% (all {full:.0}%)"
            ));
        }
        parts.extend(self.seconds.iter().map(|(what, s)| format!("{what} {s}s")));
        if parts.is_empty() {
            return format!("m{}: neither", self.minute);
        }
        format!("m{}: {}", self.minute, parts.join(", "))
    }
}

/// Microseconds stalled since boot, from `/proc/pressure`: (cpu some, io some, io full).
fn pressure_totals() -> Option<(u64, u64, u64)> {
    let total = |file: &str, kind: &str| -> Option<u64> {
        let text = fs::read_to_string(format!("/proc/pressure/{file}")).ok()?;
        let line = text.lines().find(|l| l.starts_with(kind))?;
        line.split_whitespace()
            .find_map(|f| f.strip_prefix("total="))?
            .parse()
            .ok()
    };
    Some((
        total("cpu", "some")?,
        total("io", "some")?,
        total("io", "full")?,
    ))
}

/// Stalled microseconds and wall microseconds of one minute.
#[derive(Default)]
struct Stalls {
    cpu: u64,
    io: u64,
    io_full: u64,
    wall: u64,
}

impl Stalls {
    fn percent(&self, us: u64) -> Option<f64> {
        (self.wall > 0).then(|| (us as f64 / self.wall as f64 * 1000.0).round() / 10.0)
    }
}

/// Vacuums of the database and the checkpointer's work, as one sample sees them. A vacuumed
/// table is named through `pg_class`, not a `regclass` cast: a partition dropped meanwhile would
/// fail the cast, and the sample with it.
const SAMPLE_SQL: &str = "/* bench */
SELECT 'vacuum ' || COALESCE(c.relname, p.relid::text) || ' ' || p.phase
FROM pg_stat_progress_vacuum p LEFT JOIN pg_class c ON c.oid = p.relid
WHERE p.datname = current_database()
UNION ALL
SELECT 'checkpointer ' || a.wait_event
FROM pg_stat_activity a
WHERE a.backend_type = 'checkpointer' AND a.wait_event IS DISTINCT FROM 'CheckpointerMain'
UNION ALL
SELECT 'wait ' || a.wait_event_type || ' ' || a.wait_event
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.state = 'active' AND a.pid <> pg_backend_pid()
  AND a.wait_event_type IN ('IO', 'LWLock', 'Lock')";

/// A running sampler.
pub struct BackgroundWatch {
    stop: CancellationToken,
    task: JoinHandle<Vec<MinuteBackground>>,
}

impl BackgroundWatch {
    /// Samples the database `database_url` names from now; minute 0 starts after `warmup`, and
    /// samples before it are left out.
    pub async fn start(database_url: &str, warmup: Duration) -> anyhow::Result<BackgroundWatch> {
        let mut conn = PgConnection::connect(database_url).await?;
        let stop = CancellationToken::new();
        let token = stop.clone();
        let measured_from = Instant::now() + warmup;
        let task = tokio::spawn(async move {
            let mut minutes: BTreeMap<u64, BTreeMap<String, u64>> = BTreeMap::new();
            let mut stalls: BTreeMap<u64, Stalls> = BTreeMap::new();
            let mut last = (Instant::now(), pressure_totals());
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let now = (Instant::now(), pressure_totals());
                let before = std::mem::replace(&mut last, now);
                let Some(since) = now.0.checked_duration_since(measured_from) else {
                    continue;
                };
                let Ok(seen) = sqlx::query_scalar::<_, String>(SAMPLE_SQL)
                    .fetch_all(&mut conn)
                    .await
                else {
                    // One failed sample leaves its second out; a lost connection ends the record.
                    if conn.ping().await.is_err() {
                        break;
                    }
                    continue;
                };
                let index = since.as_secs() / 60;
                let minute = minutes.entry(index).or_default();
                for what in seen {
                    *minute.entry(what).or_insert(0) += 1;
                }
                if let (Some(b), Some(a)) = (before.1, now.1) {
                    let s = stalls.entry(index).or_default();
                    s.cpu += a.0.saturating_sub(b.0);
                    s.io += a.1.saturating_sub(b.1);
                    s.io_full += a.2.saturating_sub(b.2);
                    s.wall += u64::try_from(now.0.duration_since(before.0).as_micros())
                        .unwrap_or(u64::MAX);
                }
            }
            let _ = conn.close().await;
            minutes
                .into_iter()
                .map(|(minute, seconds)| {
                    let s = stalls.remove(&minute).unwrap_or_default();
                    MinuteBackground {
                        minute,
                        seconds,
                        cpu_stalled_percent: s.percent(s.cpu),
                        io_stalled_percent: s.percent(s.io),
                        io_full_percent: s.percent(s.io_full),
                    }
                })
                .collect()
        });
        Ok(BackgroundWatch { stop, task })
    }

    /// Stops and returns the minutes seen.
    pub async fn finish(self) -> Vec<MinuteBackground> {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}
