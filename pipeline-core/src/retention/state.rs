//! What the runners record per table in `retention_state` (a table of the outbox's database and
//! of each group's): the window in force, where a sweep stopped, the last run and what it
//! removed. `pipeline retention` reads it, and runs by hand with the windows it names.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::window::Window;

/// One table's row of `retention_state`.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct TableState {
    /// The table.
    pub table_name: String,
    /// Its window, in seconds, as the last runner had it.
    pub window_seconds: i64,
    /// Where a swept table's pass stopped.
    pub cursor: Option<String>,
    /// When a run last went over it.
    pub last_run_at: Option<DateTime<Utc>>,
    /// Rows that run removed.
    pub last_removed: i64,
    /// Rows removed since the table was first recorded.
    pub total_removed: i64,
    /// When a run last left it caught up.
    pub caught_up_at: Option<DateTime<Utc>>,
    /// The oldest row it kept after the last run, where that is cheap to tell.
    pub oldest_kept_at: Option<DateTime<Utc>>,
    /// Who ran it last (`relay`, `consumer`, or `pipeline retention run` with the actor).
    pub updated_by: Option<String>,
}

impl TableState {
    /// The window in force.
    pub fn window(&self) -> Window {
        Window::secs(u64::try_from(self.window_seconds).unwrap_or(0))
    }
}

/// Every table's state in `pool`'s database, by table name.
pub async fn read(pool: &PgPool) -> Result<Vec<TableState>, sqlx::Error> {
    sqlx::query_as(
        "SELECT table_name, window_seconds, cursor, last_run_at, last_removed, total_removed,
                caught_up_at, oldest_kept_at, updated_by
         FROM retention_state ORDER BY table_name",
    )
    .fetch_all(pool)
    .await
}

/// A table's outcome of one run, as recorded.
#[derive(Debug, Clone)]
pub struct Recorded<'a> {
    /// The table.
    pub table: &'a str,
    /// Its window.
    pub window: Window,
    /// Where a sweep stopped (None: start at the beginning next time).
    pub cursor: Option<&'a str>,
    /// Rows removed.
    pub removed: u64,
    /// Whether the run left it caught up.
    pub caught_up: bool,
    /// Its oldest row kept.
    pub oldest: Option<DateTime<Utc>>,
    /// Who ran it.
    pub by: &'a str,
}

/// Records one table's run.
pub async fn record(pool: &PgPool, r: &Recorded<'_>) -> Result<(), sqlx::Error> {
    let window = i64::try_from(r.window.duration().as_secs()).unwrap_or(i64::MAX);
    let removed = i64::try_from(r.removed).unwrap_or(i64::MAX);
    sqlx::query(
        "INSERT INTO retention_state AS s (table_name, window_seconds, cursor, last_run_at,
                                          last_removed, total_removed, caught_up_at,
                                          oldest_kept_at, updated_by)
         VALUES ($1, $2, $3, now(), $4, $4, CASE WHEN $5 THEN now() END, $6, $7)
         ON CONFLICT (table_name) DO UPDATE
         SET window_seconds = EXCLUDED.window_seconds,
             cursor = EXCLUDED.cursor,
             last_run_at = now(),
             last_removed = EXCLUDED.last_removed,
             total_removed = s.total_removed + EXCLUDED.last_removed,
             caught_up_at = COALESCE(EXCLUDED.caught_up_at, s.caught_up_at),
             oldest_kept_at = EXCLUDED.oldest_kept_at,
             updated_by = EXCLUDED.updated_by",
    )
    .bind(r.table)
    .bind(window)
    .bind(r.cursor)
    .bind(removed)
    .bind(r.caught_up)
    .bind(r.oldest)
    .bind(r.by)
    .execute(pool)
    .await?;
    Ok(())
}

/// Where a swept table's pass stopped, if recorded.
pub async fn cursor(pool: &PgPool, table: &str) -> Result<Option<String>, sqlx::Error> {
    Ok(sqlx::query_scalar::<_, Option<String>>(
        "SELECT cursor FROM retention_state WHERE table_name = $1",
    )
    .bind(table)
    .fetch_optional(pool)
    .await?
    .flatten())
}
