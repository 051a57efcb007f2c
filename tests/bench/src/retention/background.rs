//! What the server does beside the pipeline's statements, minute by minute: which tables
//! autovacuum works on (and in which phase), and whether the checkpointer is writing or
//! syncing. Sampled once a second, on the minutes of the segment's latency figures, so a minute
//! whose end-to-end p99 jumps can be set beside what ran meanwhile.

use std::collections::BTreeMap;
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
    /// `vacuum <table> <phase>` or `checkpointer <wait event>`, and the seconds it was seen.
    pub seconds: BTreeMap<String, u64>,
}

impl MinuteBackground {
    /// One line: `m3: vacuum processed_message vacuuming indexes 41s, …`.
    pub fn summary(&self) -> String {
        if self.seconds.is_empty() {
            return format!("m{}: neither", self.minute);
        }
        let parts: Vec<String> = self
            .seconds
            .iter()
            .map(|(what, s)| format!("{what} {s}s"))
            .collect();
        format!("m{}: {}", self.minute, parts.join(", "))
    }
}

/// Vacuums of the database and the checkpointer's work, as one sample sees them.
const SAMPLE_SQL: &str = "/* bench */
SELECT 'vacuum ' || p.relid::regclass::text || ' ' || p.phase
FROM pg_stat_progress_vacuum p
WHERE p.datname = current_database()
UNION ALL
SELECT 'checkpointer ' || a.wait_event
FROM pg_stat_activity a
WHERE a.backend_type = 'checkpointer' AND a.wait_event IS DISTINCT FROM 'CheckpointerMain'";

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
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let Some(since) = Instant::now().checked_duration_since(measured_from) else {
                    continue;
                };
                let Ok(seen) = sqlx::query_scalar::<_, String>(SAMPLE_SQL)
                    .fetch_all(&mut conn)
                    .await
                else {
                    break;
                };
                let minute = minutes.entry(since.as_secs() / 60).or_default();
                for what in seen {
                    *minute.entry(what).or_insert(0) += 1;
                }
            }
            let _ = conn.close().await;
            minutes
                .into_iter()
                .map(|(minute, seconds)| MinuteBackground { minute, seconds })
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
