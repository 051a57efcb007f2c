//! The pace of a runner working through a backlog: at most `ratio` times as many rows a second
//! as the table gains, or [`FLOOR_ROWS_PER_SECOND`], whichever is more.
//!
//! A step's own time says little about what it costs: its deletes are written to the WAL, and
//! the pages they empty are written out and vacuumed later, while the pipeline's commits wait
//! behind that write load. On a fast machine the steps are quick, so a pause in proportion to
//! them let retention remove several times the rate rows arrived, and the pipeline's latency
//! paid for it. Bounding removal by the table's own insert rate keeps the tables flat (any ratio
//! above 1 removes more than arrives) and makes a backlog's cost a fixed share of the write load
//! the pipeline already puts on the database, whatever the machine: at 1.2, a backlog goes at a
//! fifth of the rate rows arrive, with the deletes at most a fifth more than the inserts, close
//! to what retention of a caught-up table removes anyway.
//!
//! The insert rate is the table's `n_tup_ins` in PostgreSQL's statistics, which counts every
//! session's inserts (every consumer's dedupe rows, not only the runner's process), as the
//! sessions report them (at least once a second while they work).

use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Removal rate allowed whatever the table gains: an idle pipeline's backlog still goes.
pub const FLOOR_ROWS_PER_SECOND: f64 = 1_000.0;

/// Longest one wait before the insert count is read again.
const MOST_WAIT: Duration = Duration::from_secs(1);

/// Parses a pace ratio given on a command line (`--retention-catch-up`): 0 (no bound), or a
/// number above 1 and at most 100.
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r == 0.0 || (r.is_finite() && r > 1.0 && r <= 100.0) => Ok(r),
        _ => Err(format!(
            "`{s}` is not 0 or a number above 1 and at most 100 (at 1 or below, retention would \
             remove no more than arrives and never catch up)"
        )),
    }
}

/// One table's pace over one part of a run.
pub(crate) struct Pace {
    ratio: f64,
    table: &'static str,
    started: Instant,
    /// The table's insert count when the part began; `None` where PostgreSQL keeps none (a
    /// partitioned table's parent): the floor alone bounds it.
    inserts_at_start: Option<i64>,
}

impl Pace {
    pub(crate) async fn start(
        pool: &PgPool,
        table: &'static str,
        ratio: f64,
    ) -> Result<Self, sqlx::Error> {
        Ok(Pace {
            ratio,
            table,
            started: Instant::now(),
            inserts_at_start: inserts(pool, table).await?,
        })
    }

    /// Waits until `removed` rows are within the pace, or `until` passes (then `false`).
    /// Returns how long it waited.
    pub(crate) async fn wait(
        &self,
        pool: &PgPool,
        removed: u64,
        until: Option<Instant>,
    ) -> Result<(bool, Duration), sqlx::Error> {
        let began = Instant::now();
        loop {
            let elapsed = self.started.elapsed().as_secs_f64();
            let gained = match (self.inserts_at_start, inserts(pool, self.table).await?) {
                (Some(start), Some(now)) => (now - start).max(0) as f64,
                _ => 0.0,
            };
            let allowed = (FLOOR_ROWS_PER_SECOND * elapsed).max(self.ratio * gained);
            let over = removed as f64 - allowed;
            if over <= 0.0 {
                return Ok((true, began.elapsed()));
            }
            // At the rate allowed so far, the time the excess takes to be earned.
            let rate = (allowed / elapsed.max(1e-3)).max(FLOOR_ROWS_PER_SECOND);
            let mut wait = Duration::from_secs_f64(over / rate).min(MOST_WAIT);
            if let Some(until) = until {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok((false, began.elapsed()));
                }
                wait = wait.min(left);
            }
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

/// Rows inserted into `table` since the statistics were reset, as far as sessions have reported
/// them.
async fn inserts(pool: &PgPool, table: &str) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relid = to_regclass($1)
           AND relid IN (SELECT oid FROM pg_class WHERE relkind = 'r')",
    )
    .bind(table)
    .fetch_optional(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::parse_ratio;

    #[test]
    fn a_ratio_at_or_below_one_would_never_catch_up_and_is_refused() {
        assert_eq!(parse_ratio("0"), Ok(0.0));
        assert_eq!(parse_ratio("1.5"), Ok(1.5));
        assert_eq!(parse_ratio("100"), Ok(100.0));
        for bad in ["1", "0.5", "-2", "101", "NaN", "inf", "fast"] {
            assert!(parse_ratio(bad).is_err(), "{bad} accepted");
        }
    }
}
