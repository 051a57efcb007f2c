//! A table's retention rule: its window and the one SQL step that removes old rows from it.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::partitions::TimePartitions;
use super::window::Window;

/// How one table (with the tables that hang off its rows) sheds old rows.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The table the rule removes rows from: its name in status, state and metrics.
    pub table: &'static str,
    /// Rows older than this are removed, unless something still needs them.
    pub window: Window,
    /// What the step keeps whatever its age, for people (`pipeline retention status`).
    pub keeps: &'static str,
    /// One bounded step. Parameters: `$1` the cutoff (`timestamptz`: rows older may go), `$2`
    /// the cursor (`text`, NULL at the start: where the previous step stopped), `$3` the most
    /// rows the step examines (`bigint`). Returns one row: rows removed (`bigint`), the next
    /// cursor (`text`), and whether the table is done (`bool`: nothing older than the cutoff is
    /// left past the cursor).
    pub step_sql: &'static str,
    /// The time of the oldest row the table keeps past what retention has gone over, read at a
    /// bounded cost (one row, NULL when empty); `None` where the table cannot tell it cheaply. A
    /// rule in time order takes `$1`, its cursor (`text`, NULL: from the start), so the query
    /// starts past the rows already removed, whose index entries vacuum may not have cleared
    /// yet; a swept rule's query takes no parameter.
    pub oldest_sql: Option<&'static str>,
    /// The table is not in time order: each run examines at most a few batches from where the
    /// previous run stopped, and a full pass over the table takes several runs. Otherwise each
    /// run starts at the oldest row and goes until nothing older than the cutoff is left.
    pub sweep: bool,
    /// The advisory lock its runner takes for each step: runners of rules with the same lock
    /// exclude each other (see [`super::runner::OUTBOX_LOCK`], [`super::runner::GROUPS_LOCK`]).
    pub lock: i64,
    /// The table is partitioned by time: each run first drops its partitions older than the
    /// cutoff (copying out what must be kept), and the steps then only go over those kept rows.
    pub partitions: Option<TimePartitions>,
}

/// What one step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Rows removed.
    pub removed: u64,
    /// Where the next step starts.
    pub cursor: Option<String>,
    /// Nothing older than the cutoff is left past the cursor.
    pub done: bool,
}

impl Rule {
    /// Rows older than this are removed when the time is `now`.
    pub fn cutoff(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        now - self.window.chrono()
    }

    /// Runs one step on `conn` (in the caller's transaction).
    pub async fn step(
        &self,
        conn: &mut PgConnection,
        cutoff: DateTime<Utc>,
        cursor: Option<&str>,
        limit: i64,
    ) -> Result<Step, sqlx::Error> {
        let (removed, cursor, done): (i64, Option<String>, bool) = sqlx::query_as(self.step_sql)
            .bind(cutoff)
            .bind(cursor)
            .bind(limit)
            .fetch_one(conn)
            .await?;
        Ok(Step {
            removed: u64::try_from(removed).unwrap_or(0),
            cursor,
            done,
        })
    }

    /// The time of the oldest row kept past `cursor` (a rule in time order; a swept rule looks
    /// at the whole table), where the table tells it cheaply; in a partitioned table, the older
    /// of that and its oldest partition's.
    pub async fn oldest(
        &self,
        conn: &mut PgConnection,
        cursor: Option<&str>,
    ) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        let kept: Option<DateTime<Utc>> = match (self.oldest_sql, self.sweep) {
            (Some(sql), false) => {
                sqlx::query_scalar(sql)
                    .bind(cursor)
                    .fetch_one(&mut *conn)
                    .await?
            }
            (Some(sql), true) => sqlx::query_scalar(sql).fetch_one(&mut *conn).await?,
            (None, _) => None,
        };
        let partitioned = match &self.partitions {
            Some(p) => p.oldest(conn).await?,
            None => None,
        };
        Ok(kept.into_iter().chain(partitioned).min())
    }
}

/// The rule for `operator_action`, a table of every database of the pipeline (the outbox's and
/// each group's): actions older than `window` are removed, from the oldest on, by the runner
/// that holds `lock`.
pub fn operator_actions(window: Window, lock: i64) -> Rule {
    Rule {
        table: "operator_action",
        window,
        keeps: "nothing younger than the window",
        step_sql: OPERATOR_ACTIONS_STEP,
        oldest_sql: Some(
            "SELECT (SELECT acted_at FROM operator_action
                     WHERE id > COALESCE($1::bigint, 0) ORDER BY id LIMIT 1)",
        ),
        sweep: false,
        lock,
        partitions: None,
    }
}

const OPERATOR_ACTIONS_STEP: &str = "
WITH batch AS (
    SELECT id, acted_at FROM operator_action
    WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
old AS (
    SELECT id FROM batch WHERE acted_at < $1),
removed AS (
    DELETE FROM operator_action x USING old WHERE x.id = old.id RETURNING 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM old)::text,
       (SELECT count(*) FROM old) < $3";
