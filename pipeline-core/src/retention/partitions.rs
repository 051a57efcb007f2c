//! Time partitions: a table partitioned by ranges of a timestamp column sheds its old rows by
//! detaching and dropping whole partitions, at the cost of a catalog change instead of a delete,
//! an index update and a vacuum per row.
//!
//! The partitions are created ahead of the time they cover ([`TimePartitions::ensure`], by the
//! table's writers, on a grid of [`span`]s), named `<table>_p<lower bound, UTC>`. Retention
//! removes a partition once every row in it is older than the window and its time is past by the
//! database's clock ([`TimePartitions::remove_old`]): `DETACH PARTITION … CONCURRENTLY` (which
//! blocks neither readers nor writers of the table, and needs the table to have no default
//! partition), then, in one transaction, the copy of the rows that must outlive it into a table
//! of their own and `DROP TABLE`. A detach waits for the transactions that were reading the table
//! when it began; one that waits longer than its bound, 2 s (a long report, a backup), is cut
//! short and left pending, the run goes on with its other work, and a later run finishes it
//! (`DETACH … FINALIZE`, under the same bound) once the readers are gone. A table detached but
//! not dropped yet (the runner died in between) is copied and dropped then too.
//!
//! A table that was not partitioned before is renamed `<table>_before` by its migration, with a
//! `<table>_before_bound` CHECK constraint on the column that is not validated yet;
//! [`TimePartitions::ensure`] validates it (reading the table without blocking its readers) and
//! attaches it as the partition of everything before the bound, which PostgreSQL then does
//! without reading it again.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sqlx::{PgConnection, PgPool};

/// Longest a partition change waits for a lock on the table (transactions that write it hold
/// a lock that attaching waits for briefly); the next attempt tries again.
const LOCK_TIMEOUT: &str = "2s";

/// A partition made ahead is narrowed (after the window was lowered) only if it starts at least
/// this long after the database's clock: no row can be on its way into it.
const NARROW_MARGIN: Duration = Duration::from_secs(60);

/// Longest the drop of a partition made ahead waits for the table's writers: it holds them off
/// once it has the lock, so it gives up soon and tries again at the next call.
const NARROW_LOCK_TIMEOUT: &str = "50ms";

/// Most partitions one run removes.
const MOST_REMOVED_PER_RUN: usize = 16;

/// Partitions of a table smaller than this (by the planner's estimate) are counted row by row
/// when removed; larger ones report the estimate.
const COUNT_EXACTLY_BELOW: f64 = 100_000.0;

/// How a table is partitioned by time, and what of a partition outlives it.
#[derive(Debug, Clone, Copy)]
pub struct TimePartitions {
    /// The partitioned table.
    pub table: &'static str,
    /// Its partition key, a `timestamptz` column.
    pub column: &'static str,
    /// Copies the rows of a detached partition that something still needs into the table that
    /// keeps them; `{partition}` stands for the partition's name (quoted). Runs in the
    /// transaction that drops the partition.
    pub keep_sql: Option<&'static str>,
}

/// One partition, as the catalog has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The partition's table.
    pub name: String,
    /// Its lower bound (`None`: MINVALUE).
    pub from: Option<DateTime<Utc>>,
    /// Its upper bound (exclusive).
    pub to: DateTime<Utc>,
}

/// What one removal did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Partitions dropped.
    pub partitions: u64,
    /// Rows they held (counted in a small partition, the planner's estimate in a large one).
    pub rows: u64,
    /// Rows copied out to be kept.
    pub kept: u64,
    /// A detach waited for a lock or a reader past its bound (2 s): it is left for a later run.
    pub cut_short: bool,
}

/// The partition span for a table kept for `window`: the longest of a minute, five minutes,
/// a quarter hour, an hour, six hours and a day that is at most a quarter of the window, so a
/// table holds between the window and a quarter more (a minute for the shortest windows).
pub fn span(window: Duration) -> Duration {
    const LADDER: [u64; 6] = [60, 300, 900, 3_600, 21_600, 86_400];
    let quarter = window.as_secs() / 4;
    let secs = LADDER
        .iter()
        .rev()
        .copied()
        .find(|s| *s <= quarter)
        .unwrap_or(LADDER[0]);
    Duration::from_secs(secs)
}

/// How far ahead partitions are created for a `span`: four spans, and at least ten minutes.
pub fn runway(span: Duration) -> Duration {
    (span * 4).max(Duration::from_secs(600))
}

/// The grid slot of `span` that holds `at`: its lower bound.
fn slot_start(at: DateTime<Utc>, span: Duration) -> DateTime<Utc> {
    let span = i64::try_from(span.as_secs()).unwrap_or(i64::MAX).max(1);
    let secs = at.timestamp().div_euclid(span) * span;
    Utc.timestamp_opt(secs, 0).single().unwrap_or(at)
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl TimePartitions {
    /// The table's partitions, oldest first (a detach cut short included: see
    /// [`TimePartitions::remove_old`]).
    pub async fn list(&self, conn: &mut PgConnection) -> Result<Vec<Partition>, sqlx::Error> {
        let rows: Vec<(String, Option<DateTime<Utc>>, DateTime<Utc>)> = sqlx::query_as(
            "SELECT c.relname::text,
                    CASE WHEN b.expr LIKE '%FROM (MINVALUE)%' THEN NULL
                         ELSE substring(b.expr FROM 'FROM \\(''([^'']+)''\\)')::timestamptz END,
                    substring(b.expr FROM 'TO \\(''([^'']+)''\\)')::timestamptz
             FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid
             CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS expr) b
             WHERE i.inhparent = $1::regclass
             ORDER BY 3",
        )
        .bind(self.table)
        .fetch_all(conn)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(name, from, to)| Partition { name, from, to })
            .collect())
    }

    /// The name of the partition whose lower bound is `from`.
    fn name_at(&self, from: DateTime<Utc>) -> String {
        format!("{}_p{}", self.table, from.format("%Y%m%dt%H%M%S"))
    }

    /// Makes sure partitions cover the database's time from now until `runway` ahead, on a grid
    /// of `span` (a slot that meets an existing partition is cut short to fit), and attaches the
    /// table's rows from before it was partitioned once they are checked. Returns the
    /// partitions created. Writers call it at start and every so often; a batch that finds no
    /// partition for its rows waits and tries again until the next call has made one.
    pub async fn ensure(
        &self,
        pool: &PgPool,
        span: Duration,
        runway: Duration,
    ) -> Result<u32, sqlx::Error> {
        self.attach_before(pool).await?;
        let mut conn = pool.acquire().await?;
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *conn)
            .await?;
        let until = now + chrono::Duration::from_std(runway).unwrap_or_default();
        self.narrow_ahead(&mut conn, now, span).await?;
        let mut created = 0;
        // The last attempt found the partition's name taken: another writer made it then, or
        // something else holds the name.
        let mut stalled = false;
        let mut at = slot_start(now, span);
        while at < until {
            let slot_end = at + chrono::Duration::from_std(span).unwrap_or_default();
            let partitions = self.list(&mut conn).await?;
            // The first gap in [at, slot_end), if any.
            let mut from = at;
            for p in &partitions {
                if p.from.is_none_or(|f| f <= from) && p.to > from {
                    from = p.to;
                }
            }
            if from < slot_end {
                let to = partitions
                    .iter()
                    .filter_map(|p| p.from)
                    .filter(|f| *f > from)
                    .min()
                    .map_or(slot_end, |f| f.min(slot_end));
                if self.create(&mut conn, from, to).await? {
                    created += 1;
                    stalled = false;
                } else if stalled {
                    // The name is taken by a table that is not the partition (one detached and
                    // not yet dropped): retention's next run drops it.
                    return Err(sqlx::Error::Protocol(format!(
                        "cannot create the partition of {} from {from}: a table named {} exists \
                         and is not its partition",
                        self.table,
                        self.name_at(from)
                    )));
                } else {
                    stalled = true;
                }
                continue;
            }
            at = slot_end;
            stalled = false;
        }
        Ok(created)
    }

    /// Drops the partitions made ahead that are wider than `span` and start more than
    /// [`NARROW_MARGIN`] after `now`, so that [`TimePartitions::ensure`] makes them again on the
    /// grid of `span` as their time comes: after the window was lowered, the time to come is
    /// partitioned for the new window, not for the old one (the partition that holds `now`
    /// stays as it is, and goes once all of it is past the window). Such a partition is empty
    /// (its time has not come); it is dropped under a lock that holds off the table's writers,
    /// taken for at most [`NARROW_LOCK_TIMEOUT`] (the next call tries again), and only if still
    /// empty. Writers of one table that disagree on its window would undo each other's
    /// partitions ahead: each drop is logged.
    async fn narrow_ahead(
        &self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
        span: Duration,
    ) -> Result<(), sqlx::Error> {
        let span = chrono::Duration::from_std(span).unwrap_or_default();
        let margin = chrono::Duration::from_std(NARROW_MARGIN).unwrap_or_default();
        let wide: Vec<Partition> = self
            .list(conn)
            .await?
            .into_iter()
            .filter(|p| {
                p.from
                    .is_some_and(|from| from > now + margin && p.to - from > span)
            })
            .collect();
        for p in wide {
            let mut tx = self.begin_change(conn, NARROW_LOCK_TIMEOUT).await?;
            let locked = simple(
                &mut tx,
                &format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", quote(self.table)),
            )
            .await;
            match locked {
                Ok(_) => {}
                Err(e) if is_lock_timeout(&e) => {
                    tx.rollback().await?;
                    tracing::debug!(table = self.table, partition = %p.name,
                                    "partition ahead left for now: the table is busy");
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            let empty: bool = sqlx::query_scalar(&format!(
                "SELECT NOT EXISTS (SELECT 1 FROM {})",
                quote(&p.name)
            ))
            .fetch_one(&mut *tx)
            .await?;
            if !empty {
                tx.rollback().await?;
                tracing::warn!(table = self.table, partition = %p.name,
                               "a partition ahead of the database's clock has rows; kept");
                continue;
            }
            simple(&mut tx, &format!("DROP TABLE {}", quote(&p.name))).await?;
            tx.commit().await?;
            tracing::info!(table = self.table, partition = %p.name, from = ?p.from, to = %p.to,
                           "partition ahead dropped: wider than the window now asks for");
        }
        Ok(())
    }

    /// A transaction that changes the table's partitions: the table's writers change them one
    /// at a time, and it waits at most `lock_timeout` for a lock on a table.
    async fn begin_change<'c>(
        &self,
        conn: &'c mut PgConnection,
        lock_timeout: &str,
    ) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
        let mut tx = sqlx::Connection::begin(conn).await?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(lock_timeout)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('partitions of ' || $1))")
            .bind(self.table)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// Creates and attaches the partition [from, to): the table made apart with the CHECK
    /// constraint its bounds imply, then attached, which takes a lock that lets the table's
    /// readers and writers go on (creating it as a partition outright would block them).
    /// `false` when another writer made it first.
    async fn create(
        &self,
        conn: &mut PgConnection,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<bool, sqlx::Error> {
        let name = self.name_at(from);
        let (table, column, quoted) = (quote(self.table), quote(self.column), quote(&name));
        let mut tx = self.begin_change(conn, LOCK_TIMEOUT).await?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&quoted)
            .fetch_one(&mut *tx)
            .await?;
        if exists {
            tx.rollback().await?;
            return Ok(false);
        }
        let (from_lit, to_lit) = (literal(from), literal(to));
        for statement in [
            format!("CREATE TABLE {quoted} (LIKE {table} INCLUDING DEFAULTS)"),
            format!(
                "ALTER TABLE {quoted} ADD CONSTRAINT {} CHECK ({column} >= {from_lit} AND {column} < {to_lit})",
                quote(&format!("{name}_bound"))
            ),
            format!(
                "ALTER TABLE {table} ATTACH PARTITION {quoted} FOR VALUES FROM ({from_lit}) TO ({to_lit})"
            ),
            format!(
                "ALTER TABLE {quoted} DROP CONSTRAINT {}",
                quote(&format!("{name}_bound"))
            ),
        ] {
            simple(&mut tx, &statement).await?;
        }
        tx.commit().await?;
        tracing::info!(table = self.table, partition = %name, %from, %to, "partition created");
        Ok(true)
    }

    /// Attaches `<table>_before`, the table's rows from before it was partitioned, if its
    /// migration left it apart: validates its bound first (a read that blocks no one), so the
    /// attach need not read it again.
    async fn attach_before(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let before = format!("{}_before", self.table);
        let pending: Option<String> = sqlx::query_scalar(
            "SELECT pg_get_constraintdef(k.oid)
             FROM pg_class c JOIN pg_constraint k ON k.conrelid = c.oid
             WHERE c.relname = $1 AND c.relnamespace = to_regnamespace(current_schema())
               AND NOT c.relispartition AND k.conname = $1 || '_bound'",
        )
        .bind(&before)
        .fetch_optional(pool)
        .await?;
        let Some(definition) = pending else {
            return Ok(());
        };
        let bound: DateTime<Utc> =
            sqlx::query_scalar("SELECT substring($1 FROM '''([^'']+)''')::timestamptz")
                .bind(&definition)
                .fetch_one(pool)
                .await?;
        let started = std::time::Instant::now();
        let (table, quoted) = (quote(self.table), quote(&before));
        // Validating reads the whole table (the session's statement timeout, a consumer's
        // seconds, does not apply) under a lock that lets everyone else go on.
        let mut tx = pool.begin().await?;
        simple(&mut tx, "SET LOCAL statement_timeout = 0").await?;
        simple(
            &mut tx,
            &format!(
                "ALTER TABLE {quoted} VALIDATE CONSTRAINT {}",
                quote(&format!("{before}_bound"))
            ),
        )
        .await?;
        tx.commit().await?;
        self.index_before(pool, &before).await?;
        let mut tx = pool.begin().await?;
        simple(
            &mut tx,
            &format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"),
        )
        .await?;
        simple(
            &mut tx,
            &format!(
                "ALTER TABLE {table} ATTACH PARTITION {quoted} FOR VALUES FROM (MINVALUE) TO ({})",
                literal(bound)
            ),
        )
        .await?;
        tx.commit().await?;
        tracing::info!(table = self.table, partition = %before, %bound,
            seconds = started.elapsed().as_secs_f64(), "rows from before partitioning attached");
        Ok(())
    }

    /// Builds on `before` each index of the partitioned table it has no match for, without
    /// blocking its readers (`CREATE INDEX CONCURRENTLY`), so attaching it builds none while it
    /// holds its locks. A build cut short leaves an invalid index, dropped by the next attempt.
    async fn index_before(&self, pool: &PgPool, before: &str) -> Result<(), sqlx::Error> {
        let missing: Vec<(i64, String)> = sqlx::query_as(
            "SELECT row_number() OVER (ORDER BY pi.indexrelid),
                    substring(pg_get_indexdef(pi.indexrelid) FROM ' USING .*$')
             FROM pg_index pi
             WHERE pi.indrelid = $1::regclass
               AND NOT EXISTS (
                   SELECT 1 FROM pg_index bi
                   WHERE bi.indrelid = $2::regclass AND bi.indisvalid
                     AND bi.indkey::text = pi.indkey::text
                     AND bi.indclass::text = pi.indclass::text
                     AND bi.indisunique = pi.indisunique
                     AND bi.indpred IS NULL AND bi.indexprs IS NULL)",
        )
        .bind(quote(self.table))
        .bind(quote(before))
        .fetch_all(pool)
        .await?;
        if missing.is_empty() {
            return Ok(());
        }
        // A session of its own, without the pool's statement timeout, closed afterwards.
        let mut conn = pool.acquire().await?.detach();
        simple(&mut conn, "SET statement_timeout = 0").await?;
        for (n, using) in missing {
            let index = quote(&format!("{before}_attach_{n}"));
            let invalid: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass($1)
                                AND NOT indisvalid)",
            )
            .bind(&index)
            .fetch_one(&mut conn)
            .await?;
            if invalid {
                simple(&mut conn, &format!("DROP INDEX CONCURRENTLY {index}")).await?;
            }
            simple(
                &mut conn,
                &format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {}{using}",
                    quote(before)
                ),
            )
            .await?;
        }
        let _ = sqlx::Connection::close(conn).await;
        Ok(())
    }

    /// Removes the partitions whose every row is older than `cutoff` and whose time is past by
    /// the database's clock, oldest first, at most a few a run; a dry run only counts them.
    /// Needs a connection of its own: a detach that does not block the table's users runs
    /// outside any transaction. The caller holds the table's retention lock on `conn`'s
    /// session.
    pub async fn remove_old(
        &self,
        conn: &mut PgConnection,
        cutoff: DateTime<Utc>,
        dry_run: bool,
    ) -> Result<Removed, sqlx::Error> {
        let mut removed = Removed::default();
        if !dry_run {
            self.finish_cut_short(conn, &mut removed).await?;
            if removed.cut_short {
                return Ok(removed);
            }
        }
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *conn)
            .await?;
        let old: Vec<Partition> = self
            .list(conn)
            .await?
            .into_iter()
            .filter(|p| p.to <= cutoff && p.to <= now)
            .take(MOST_REMOVED_PER_RUN)
            .collect();
        for p in old {
            if dry_run {
                removed.partitions += 1;
                removed.rows += rows_of(conn, &p.name).await?;
                continue;
            }
            if !self
                .detach(conn, &p.name, "CONCURRENTLY", &mut removed)
                .await?
            {
                break;
            }
            self.drop_detached(conn, &p.name, &mut removed).await?;
        }
        Ok(removed)
    }

    /// `ALTER TABLE … DETACH PARTITION name <how>`, waiting at most [`LOCK_TIMEOUT`] for a lock
    /// or for the table's readers; `false` (and [`Removed::cut_short`]) when it waited that long.
    async fn detach(
        &self,
        conn: &mut PgConnection,
        name: &str,
        how: &str,
        removed: &mut Removed,
    ) -> Result<bool, sqlx::Error> {
        // Alone in its statement: a detach cannot run in a transaction block.
        simple(&mut *conn, &format!("SET lock_timeout = '{LOCK_TIMEOUT}'")).await?;
        let detached = simple(
            &mut *conn,
            &format!(
                "ALTER TABLE {} DETACH PARTITION {} {how}",
                quote(self.table),
                quote(name)
            ),
        )
        .await;
        simple(&mut *conn, "RESET lock_timeout").await?;
        match detached {
            Ok(_) => Ok(true),
            Err(e) if is_lock_timeout(&e) => {
                tracing::warn!(
                    table = self.table,
                    partition = %name,
                    waited = LOCK_TIMEOUT,
                    how,
                    "the partition's detach waited for a lock, or for transactions reading the \
                     table since before it began, longer than its bound; a later run finishes it"
                );
                removed.cut_short = true;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Finishes what an earlier run left: a detach cut short (by its bound, or by the runner's
    /// death), a partition detached but not dropped.
    async fn finish_cut_short(
        &self,
        conn: &mut PgConnection,
        removed: &mut Removed,
    ) -> Result<(), sqlx::Error> {
        let pending: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = $1::regclass AND i.inhdetachpending",
        )
        .bind(self.table)
        .fetch_all(&mut *conn)
        .await?;
        for name in pending {
            if !self.detach(conn, &name, "FINALIZE", removed).await? {
                // The readers it waits for are still there: nothing more is detached before it
                // is finished (the table allows one pending detach). Those detached in full are
                // still dropped below.
                break;
            }
            // Dropped by name: the scan below knows a detached table by the name partitions are
            // made with, which the partition of the rows before the migration does not have.
            self.drop_detached(conn, &name, removed).await?;
        }
        let detached: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c
             WHERE c.relnamespace = to_regnamespace(current_schema()) AND c.relkind = 'r'
               AND NOT c.relispartition AND c.relname ~ ('^' || $1 || '_p[0-9]{8}t[0-9]{6}$')",
        )
        .bind(self.table)
        .fetch_all(&mut *conn)
        .await?;
        for name in detached {
            self.drop_detached(conn, &name, removed).await?;
        }
        Ok(())
    }

    /// Copies what must be kept out of the detached partition `name` and drops it, in one
    /// transaction.
    async fn drop_detached(
        &self,
        conn: &mut PgConnection,
        name: &str,
        removed: &mut Removed,
    ) -> Result<(), sqlx::Error> {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // The table is no one's but this transaction's now: counting or copying from it may
        // take longer than the session's statement timeout (a consumer's seconds) allows.
        simple(&mut tx, "SET LOCAL statement_timeout = 0").await?;
        let rows = rows_of(&mut tx, name).await?;
        let kept = match self.keep_sql {
            Some(sql) => simple(&mut tx, &sql.replace("{partition}", &quote(name))).await?,
            None => 0,
        };
        simple(&mut tx, &format!("DROP TABLE {}", quote(name))).await?;
        tx.commit().await?;
        removed.partitions += 1;
        removed.rows += rows.saturating_sub(kept);
        removed.kept += kept;
        tracing::info!(table = self.table, partition = %name, rows, kept, "partition dropped");
        Ok(())
    }

    /// The time of the oldest row in the table's oldest partition that has rows, read from the
    /// first rows of that partition (in a table only ever appended to, its oldest).
    pub async fn oldest(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        for p in self.list(conn).await? {
            let oldest: Option<DateTime<Utc>> = sqlx::query_scalar(&format!(
                "SELECT min({column}) FROM (SELECT {column} FROM {} LIMIT 1000) x",
                quote(&p.name),
                column = quote(self.column)
            ))
            .fetch_one(&mut *conn)
            .await?;
            if oldest.is_some() {
                return Ok(oldest);
            }
        }
        Ok(None)
    }
}

/// Whether `e` is PostgreSQL's `lock_timeout` (55P03).
fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// Rows in the table `name`: counted when the planner estimates it small (or has not estimated
/// it yet), its estimate otherwise.
async fn rows_of(conn: &mut PgConnection, name: &str) -> Result<u64, sqlx::Error> {
    let estimate: f64 =
        sqlx::query_scalar("SELECT reltuples::float8 FROM pg_class WHERE oid = $1::regclass")
            .bind(quote(name))
            .fetch_one(&mut *conn)
            .await?;
    if estimate >= COUNT_EXACTLY_BELOW {
        return Ok(estimate as u64);
    }
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", quote(name)))
        .fetch_one(&mut *conn)
        .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Runs one statement of SQL made here (names and literals quoted), unprepared; the rows it
/// changed.
async fn simple(conn: &mut PgConnection, sql: &str) -> Result<u64, sqlx::Error> {
    Ok(sqlx::Executor::execute(conn, sql).await?.rows_affected())
}

/// A `timestamptz` literal of `at`.
fn literal(at: DateTime<Utc>) -> String {
    format!("'{}'::timestamptz", at.format("%Y-%m-%d %H:%M:%S%.6f+00"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_a_quarter_of_the_window_or_less_on_a_ladder() {
        let s = |secs: u64| span(Duration::from_secs(secs)).as_secs();
        assert_eq!(s(60), 60);
        assert_eq!(s(600), 60);
        assert_eq!(s(1_200), 300);
        assert_eq!(s(3_600), 900);
        assert_eq!(s(86_400), 21_600);
        assert_eq!(s(7 * 86_400), 86_400);
        assert_eq!(s(365 * 86_400), 86_400);
    }

    #[test]
    fn slots_start_on_the_grid() {
        let at = Utc.with_ymd_and_hms(2026, 11, 27, 17, 41, 13).unwrap();
        assert_eq!(
            slot_start(at, Duration::from_secs(900)),
            Utc.with_ymd_and_hms(2026, 11, 27, 17, 30, 0).unwrap()
        );
        assert_eq!(
            slot_start(at, Duration::from_secs(86_400)),
            Utc.with_ymd_and_hms(2026, 11, 27, 0, 0, 0).unwrap()
        );
    }
}
