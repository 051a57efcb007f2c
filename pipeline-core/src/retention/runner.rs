//! Running a database's rules: one bounded step at a time, each its own short transaction
//! under a transaction-scoped advisory lock, so only one runner works on a set of tables at once
//! (whoever runs it: the relay, a consumer, or an operator by hand) and a runner that dies
//! holds nothing. A runner paces itself: after each step it pauses in proportion to the time the
//! step took, so a large backlog is worked through at a share of the database's capacity, and
//! more slowly when the database is busy; and in the runs its loop makes, it removes at most a
//! bounded multiple of the rows the table gains ([`super::pace`]).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::backlog::Backlog;
use super::metrics::RetentionMetrics;
use super::pace::Pace;
use super::partitions::{Removed, TimePartitions};
use super::rule::Rule;
use super::state::{self, Recorded};
use super::window::Window;

/// The advisory lock of the runners of the outbox's tables (the active relay's, or an
/// operator's): `retain` in ASCII, then 1.
pub const OUTBOX_LOCK: i64 = 0x0072_6574_6169_6e01;
/// The advisory lock of the runners of the groups' tables (one consumer of a database at a time,
/// or an operator's). Where the groups share the outbox's database, the two sets of tables are
/// worked on side by side.
pub const GROUPS_LOCK: i64 = 0x0072_6574_6169_6e02;

/// Longest a step waits for a row lock (a consumer's batch holding an order's progress row, say)
/// before it gives up; the next run tries again.
const STEP_LOCK_TIMEOUT: &str = "1s";

/// Longest a step's statement may run. Steps are small, so this is far above what one takes; it
/// only lifts the tight timeout of the session the runner shares with the pipeline's own work
/// (a consumer's is seconds), which a step may pass while the disk is saturated.
const STEP_STATEMENT_TIMEOUT: &str = "30s";

/// Added to the session's `application_name` for the length of a step, so `pg_stat_activity`
/// (and whoever watches lock waits) tells retention's steps from the pipeline's own work.
pub const STEP_APPLICATION_SUFFIX: &str = " (retention)";

// Each step also runs without JIT compilation. A step is a few milliseconds of index lookups,
// but its estimated cost (the more so under a consumer's key-lookup planner, which prices a scan
// it has disabled in the billions) passes `jit_above_cost`, and compiling it took some 280 ms of
// CPU, a hundred times the step. A step's COMMIT waits for the disk as the pipeline's own do:
// the time it takes, and so the pause after it, grows with the write load the pipeline's
// commits wait behind (without that wait, steps came faster than the disk took their WAL and
// the vacuums after them, and the pipeline's commits stalled for seconds).

/// Pause between runs while a table is not caught up yet (a large backlog is worked through in
/// runs of bounded size, back to back but for this pause).
const CATCHING_UP_PAUSE: Duration = Duration::from_secs(1);

/// The pipeline counts as behind for this long after its work last found a backlog.
const BEHIND_FOR: Duration = Duration::from_secs(2);

/// Longest a runner waits for the pipeline to catch up before a step: under a backlog that never
/// ends, retention still takes a step this often.
const MOST_YIELD: Duration = Duration::from_secs(30);

/// How often a yielding runner looks again.
const YIELD_POLL: Duration = Duration::from_millis(100);

/// Longest one table's part of a run may take in the runs the loop makes (steps, pauses and
/// yields): the run then goes on to the next table, and the table is taken up again in the next
/// run, a second later. A table with a long backlog (a large history, say, whose steps yield to a
/// busy pipeline for seconds each) would otherwise hold off every table after it for hours while
/// those grow.
const TABLE_SLICE: Duration = Duration::from_secs(60);

/// How often the loop goes over a table in time order from its start again instead of from
/// where it stopped: rows kept past the cursor because something still needed them (an open dead
/// letter, a parked event) are removed on such a pass once nothing needs them.
const FULL_PASS_EVERY: Duration = Duration::from_secs(3600);

/// Parses a pause ratio given on a command line (`--retention-pause-ratio`): a number from 0 to
/// 100.
pub fn parse_pause_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && (0.0..=100.0).contains(&r) => Ok(r),
        _ => Err(format!("`{s}` is not a number from 0 to 100")),
    }
}

/// Applies a set of rules to one database.
#[derive(Clone)]
pub struct Runner {
    rules: Vec<Rule>,
    /// Most rows a step examines.
    batch_size: i64,
    /// Most steps a run takes per table in time order.
    max_steps: u32,
    /// Most steps a run takes per swept table.
    sweep_steps: u32,
    /// After each step, a pause this many times as long as the step took.
    pause_ratio: f64,
    /// Who runs it, as recorded.
    by: String,
    metrics: Option<RetentionMetrics>,
    /// The work it waits for while that is behind.
    backlog: Option<Backlog>,
    /// Longest one table's part of a run as the loop makes them.
    table_slice: Duration,
    /// In the runs the loop makes, most rows removed a second, as a multiple of the rows the
    /// table gains (see [`super::pace`]); `None`: no bound.
    catch_up: Option<f64>,
}

/// What one run did.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Another runner held the database: this run did nothing.
    pub skipped: bool,
    /// Removed nothing for good: every step was rolled back, and reported what it would remove.
    pub dry_run: bool,
    /// Each table's part.
    pub tables: Vec<TableReport>,
    /// Time the run took, in seconds.
    pub seconds: f64,
}

/// One table's part of a run.
#[derive(Debug, Clone, Serialize)]
pub struct TableReport {
    /// The table.
    pub table: String,
    /// Its window.
    pub window: String,
    /// Rows older than this were removable.
    pub cutoff: DateTime<Utc>,
    /// Rows removed (or, in a dry run, that would be); in a table in time partitions, the
    /// partitions' rows are the planner's estimate where a partition is large.
    pub removed: u64,
    /// Partitions dropped (or, in a dry run, that would be), in a table in time partitions.
    pub partitions_removed: u64,
    /// Nothing removable older than the cutoff is left (a swept table: its pass ended).
    pub caught_up: bool,
    /// The oldest row kept, where the table tells it cheaply.
    pub oldest_kept: Option<DateTime<Utc>>,
    /// The table is swept a few batches a run (see [`Rule::sweep`]).
    pub swept: bool,
}

impl Runner {
    /// A runner of `rules`, recorded as run by `by`, with batches of 1,000 rows and a pause four
    /// times as long as each step after it.
    pub fn new(rules: Vec<Rule>, by: impl Into<String>) -> Self {
        Runner {
            rules,
            batch_size: 1_000,
            max_steps: 200,
            sweep_steps: 20,
            pause_ratio: 4.0,
            by: by.into(),
            metrics: None,
            backlog: None,
            table_slice: TABLE_SLICE,
            catch_up: None,
        }
    }

    /// Most rows one step examines (and so removes).
    pub fn batch_size(mut self, rows: i64) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// Most steps one run takes per table (a swept table takes a tenth of it).
    pub fn max_steps(mut self, steps: u32) -> Self {
        self.max_steps = steps.max(1);
        self.sweep_steps = (steps / 10).max(1);
        self
    }

    /// After each step, pause `ratio` times as long as the step took (0: no pause). At 4 a
    /// runner works at most a fifth of the time, and yields more when the database is slow.
    pub fn pause_ratio(mut self, ratio: f64) -> Self {
        self.pause_ratio = if ratio.is_finite() {
            ratio.max(0.0)
        } else {
            0.0
        };
        self
    }

    /// Before each step, wait while `backlog` says the pipeline is behind (up to 30 s a step, so
    /// retention still advances under a backlog that never ends): the pipeline catches up
    /// faster with the database to itself. While the pipeline is only slow, wait at most as long
    /// as the last step and its pause took: a database that stays slow (a saturated one) still
    /// gets a step at least every other such interval, so retention keeps up a bounded share.
    pub fn yield_to(mut self, backlog: Backlog) -> Self {
        self.backlog = Some(backlog);
        self
    }

    /// The longest one table's part of a run may take in the runs [`Runner::run_every`] and
    /// [`Runner::resume_once`] make (a minute); a run to the end ([`Runner::run_once`]) takes
    /// each table as far as its steps go.
    pub fn table_slice(mut self, slice: Duration) -> Self {
        self.table_slice = slice;
        self
    }

    /// In the runs [`Runner::run_every`] and [`Runner::resume_once`] make, remove at most `ratio`
    /// times as many rows a second as the table gains, or
    /// [`super::pace::FLOOR_ROWS_PER_SECOND`], whichever is more (0: no bound). A run to the end
    /// ([`Runner::run_once`], an operator's) is not bound.
    pub fn catch_up(mut self, ratio: f64) -> Self {
        self.catch_up = (ratio.is_finite() && ratio > 1.0).then_some(ratio);
        self
    }

    /// Report on `metrics`.
    pub fn with_metrics(mut self, metrics: RetentionMetrics) -> Self {
        for rule in &self.rules {
            metrics
                .window
                .with_label_values(&[rule.table])
                .set(rule.window.duration().as_secs_f64());
        }
        self.metrics = Some(metrics);
        self
    }

    /// The rules.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// One run over every rule as if the time were `now`: each table until it is caught up or
    /// its steps for this run are spent, a table in time order from its start. A dry run rolls
    /// every step back.
    pub async fn run_once(
        &self,
        pool: &PgPool,
        now: DateTime<Utc>,
        dry_run: bool,
    ) -> Result<Report, sqlx::Error> {
        self.run(pool, now, dry_run, false, None).await
    }

    /// One run as [`Runner::run_every`] makes most of them: a table in time order is taken up
    /// where the last run left it (rows it kept behind then, because something still needed
    /// them, wait for a run from the start), and each table's part ends after
    /// [`Runner::table_slice`].
    pub async fn resume_once(
        &self,
        pool: &PgPool,
        now: DateTime<Utc>,
    ) -> Result<Report, sqlx::Error> {
        self.run(pool, now, false, true, Some(self.table_slice))
            .await
    }

    /// One run; `resume`: a table in time order is taken up where the last run left it;
    /// `slice`: each table's part ends once it took that long.
    async fn run(
        &self,
        pool: &PgPool,
        now: DateTime<Utc>,
        dry_run: bool,
        resume: bool,
        slice: Option<Duration>,
    ) -> Result<Report, sqlx::Error> {
        let started = Instant::now();
        let mut tables = Vec::with_capacity(self.rules.len());
        for rule in &self.rules {
            match self
                .run_rule(pool, rule, now, dry_run, resume, slice)
                .await?
            {
                Some(t) => tables.push(t),
                None => {
                    if let Some(m) = &self.metrics {
                        m.skipped.inc();
                    }
                    return Ok(Report {
                        skipped: true,
                        dry_run,
                        tables,
                        seconds: started.elapsed().as_secs_f64(),
                    });
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        if let (Some(m), false) = (&self.metrics, dry_run) {
            m.run_duration.observe(seconds);
        }
        Ok(Report {
            skipped: false,
            dry_run,
            tables,
            seconds,
        })
    }

    /// One table's part of a run; `None` when another runner holds its tables.
    async fn run_rule(
        &self,
        pool: &PgPool,
        rule: &Rule,
        now: DateTime<Utc>,
        dry_run: bool,
        resume: bool,
        slice: Option<Duration>,
    ) -> Result<Option<TableReport>, sqlx::Error> {
        let started = Instant::now();
        let cutoff = rule.cutoff(now);
        let mut cursor = if rule.sweep || resume {
            state::cursor(pool, rule.table).await?
        } else {
            None
        };
        let steps = if rule.sweep {
            self.sweep_steps
        } else {
            self.max_steps
        };
        let mut removed = 0u64;
        let mut partitions_removed = 0u64;
        if let Some(partitions) = &rule.partitions {
            let Some(dropped) = self
                .remove_partitions(pool, rule, partitions, cutoff, dry_run)
                .await?
            else {
                return Ok(None);
            };
            removed += dropped.rows;
            partitions_removed = dropped.partitions;
        }
        let mut caught_up = false;
        // What the last step and its pause took: the most a step waits for a slow pipeline.
        let mut last_step = Duration::ZERO;
        let pace = match (self.catch_up, slice, dry_run) {
            (Some(ratio), Some(_), false) => Some(Pace::start(pool, rule.table, ratio).await?),
            _ => None,
        };
        // Rows the steps removed (a partition's rows are not paced: its drop is no delete).
        let mut stepped = 0u64;
        for taken in 0..steps {
            if taken > 0 && slice.is_some_and(|slice| started.elapsed() >= slice) {
                break;
            }
            if let Some(pace) = &pace {
                let (within, waited) = pace
                    .wait(pool, stepped, slice.map(|slice| started + slice))
                    .await?;
                if let (Some(m), false) = (&self.metrics, waited.is_zero()) {
                    m.yielded
                        .with_label_values(&["pace"])
                        .inc_by(waited.as_secs_f64());
                }
                if !within {
                    break;
                }
            }
            self.give_way(last_step).await;
            let step_started = Instant::now();
            let mut tx = pool.begin().await?;
            let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                .bind(rule.lock)
                .fetch_one(&mut *tx)
                .await?;
            if !held {
                return Ok(None);
            }
            sqlx::query(
                "SELECT set_config('lock_timeout', $1, true),
                        set_config('statement_timeout', $2, true),
                        set_config('jit', 'off', true),
                        set_config('application_name',
                                   left(current_setting('application_name') || $3, 63), true)",
            )
            .bind(STEP_LOCK_TIMEOUT)
            .bind(STEP_STATEMENT_TIMEOUT)
            .bind(STEP_APPLICATION_SUFFIX)
            .execute(&mut *tx)
            .await?;
            let step = rule
                .step(&mut tx, cutoff, cursor.as_deref(), self.batch_size)
                .await?;
            if dry_run {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
                if let Some(m) = &self.metrics {
                    m.removed
                        .with_label_values(&[rule.table])
                        .inc_by(step.removed);
                }
            }
            removed += step.removed;
            stepped += step.removed;
            let pause = step_started.elapsed().mul_f64(self.pause_ratio);
            if step.done {
                caught_up = true;
                // A swept table's pass ends; a table in time order keeps its place, the furthest
                // row removable so far (the last step may have found none).
                cursor = if rule.sweep {
                    None
                } else {
                    step.cursor.or(cursor)
                };
                break;
            }
            cursor = step.cursor;
            tokio::time::sleep(pause).await;
            last_step = step_started.elapsed();
        }
        let oldest = rule
            .oldest(&mut *pool.acquire().await?, cursor.as_deref())
            .await?;
        if !dry_run {
            state::record(
                pool,
                &Recorded {
                    table: rule.table,
                    window: rule.window,
                    cursor: cursor.as_deref(),
                    removed,
                    caught_up,
                    oldest,
                    by: &self.by,
                },
            )
            .await?;
            if let Some(m) = &self.metrics {
                if caught_up {
                    m.caught_up
                        .with_label_values(&[rule.table])
                        .set(Utc::now().timestamp_millis() as f64 / 1000.0);
                }
                if let Some(at) = oldest {
                    let age = (Utc::now() - at).num_milliseconds().max(0) as f64 / 1000.0;
                    m.oldest_age.with_label_values(&[rule.table]).set(age);
                }
            }
        }
        if removed > 0 {
            tracing::info!(
                table = rule.table,
                removed,
                caught_up,
                dry_run,
                window = %rule.window,
                "retention removed old rows"
            );
        }
        Ok(Some(TableReport {
            table: rule.table.to_owned(),
            window: rule.window.to_string(),
            cutoff,
            removed,
            partitions_removed,
            caught_up,
            oldest_kept: oldest,
            swept: rule.sweep,
        }))
    }

    /// Drops `partitions`' partitions older than `cutoff` under the rule's lock, held by a
    /// session of its own for the length of it (a detach that blocks no one cannot run in a
    /// transaction); `None` when another runner holds the lock.
    async fn remove_partitions(
        &self,
        pool: &PgPool,
        rule: &Rule,
        partitions: &TimePartitions,
        cutoff: DateTime<Utc>,
        dry_run: bool,
    ) -> Result<Option<Removed>, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(rule.lock)
            .fetch_one(&mut *conn)
            .await?;
        if !held {
            return Ok(None);
        }
        // The session is marked as a step's is, for the length of it: a detach that waits for
        // the table's readers shows in pg_stat_activity as retention's.
        let mut marked = false;
        let removed = async {
            let name: String = sqlx::query_scalar("SELECT current_setting('application_name')")
                .fetch_one(&mut *conn)
                .await?;
            sqlx::query("SELECT set_config('application_name', left($1 || $2, 63), false)")
                .bind(&name)
                .bind(STEP_APPLICATION_SUFFIX)
                .execute(&mut *conn)
                .await?;
            marked = true;
            let removed = partitions.remove_old(&mut conn, cutoff, dry_run).await;
            sqlx::query("SELECT set_config('application_name', $1, false)")
                .bind(&name)
                .execute(&mut *conn)
                .await?;
            marked = false;
            removed
        }
        .await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(rule.lock)
            .execute(&mut *conn)
            .await;
        if unlocked.is_err() || marked {
            // A session whose lock state or name is unknown goes, rather than back to the pool.
            let _ = conn.detach();
        }
        let removed = removed?;
        if let (Some(m), false) = (&self.metrics, dry_run) {
            m.partitions_removed
                .with_label_values(&[rule.table])
                .inc_by(removed.partitions);
            m.removed
                .with_label_values(&[rule.table])
                .inc_by(removed.rows);
        }
        Ok(Some(removed))
    }

    /// Waits before a step: while the work this runner yields to is behind, up to
    /// [`MOST_YIELD`]; while it is only slow, up to `slow_bound` (what the last step and its
    /// pause took), so a database that stays slow still gets a bounded share of steps.
    async fn give_way(&self, slow_bound: Duration) {
        let Some(backlog) = &self.backlog else {
            return;
        };
        let started = Instant::now();
        let (mut for_backlog, mut for_slowness) = (Duration::ZERO, Duration::ZERO);
        loop {
            let waited = started.elapsed();
            if waited >= MOST_YIELD {
                break;
            }
            let (wait, until) = if backlog.behind_within(BEHIND_FOR) {
                (&mut for_backlog, MOST_YIELD)
            } else if backlog.slow_within(BEHIND_FOR) && waited < slow_bound {
                (&mut for_slowness, slow_bound)
            } else {
                break;
            };
            let polled = Instant::now();
            tokio::time::sleep(YIELD_POLL.min(until - waited)).await;
            *wait += polled.elapsed();
        }
        if let Some(m) = &self.metrics {
            for (reason, waited) in [("backlog", for_backlog), ("slow", for_slowness)] {
                if !waited.is_zero() {
                    m.yielded
                        .with_label_values(&[reason])
                        .inc_by(waited.as_secs_f64());
                }
            }
        }
    }

    /// Runs every `every` until `shutdown`; again after a short pause while a table is not
    /// caught up. A table in time order is taken up where the last run left it, and gone over
    /// from its start once an hour. A failed run is logged and tried again next time.
    pub async fn run_every(self, pool: PgPool, every: Window, shutdown: CancellationToken) {
        let mut pause = Duration::ZERO;
        let mut full_pass = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            let resume = full_pass.elapsed() < FULL_PASS_EVERY;
            let run = tokio::select! {
                _ = shutdown.cancelled() => return,
                run = self.run(&pool, Utc::now(), false, resume, Some(self.table_slice)) => run,
            };
            if !resume && matches!(&run, Ok(r) if !r.skipped) {
                full_pass = Instant::now();
            }
            pause = match run {
                Ok(r) if !r.skipped && r.tables.iter().any(|t| !t.caught_up && !t.swept) => {
                    CATCHING_UP_PAUSE
                }
                Ok(_) => every.duration(),
                Err(e) => {
                    tracing::warn!(error = %e, "retention run failed; trying again next time");
                    every.duration()
                }
            };
        }
    }
}
