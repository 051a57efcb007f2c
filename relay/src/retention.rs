//! Retention of the outbox's tables, run by the active relay: published events (with their
//! delivery and attempts) and operator actions older than their window are removed in bounded
//! steps. Events not published (pending, retrying, failed), delayed events and the relay's
//! queue are never removed; nor, where the groups share the outbox's database, an event an open
//! dead letter or a parked event points to.
//!
//! The outbox is removed from its old end in id order (ids follow creation time): each step
//! reads the next batch of ids past the last one it examined, and stops at the first row
//! younger than the window. Whole pages empty out at the old end, which vacuum returns for new
//! rows, so the table stays flat. Partitioning by time would drop old rows more cheaply still,
//! but the outbox's unique keys (event id, business fact, aggregate sequence) would each have
//! to include the partition key, and would no longer hold across partitions.

use pipeline_core::retention::{runner::OUTBOX_LOCK, BelowFloor, Rule, Window};
use sqlx::PgPool;

/// How long the outbox's database keeps what the relay does not need any more.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct RetentionSettings {
    /// How often the active relay runs retention on the outbox's database (`0s`: never; run
    /// it with `pipeline retention run` then).
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retention-interval",
            env = "RELAY_RETENTION_INTERVAL",
            default_value = "30s"
        )
    )]
    pub interval: Window,
    /// Most rows one retention step examines (each step is a transaction of its own).
    #[cfg_attr(
        feature = "cli",
        arg(id = "retention_batch_size", long = "retention-batch-size", env = "RELAY_RETENTION_BATCH_SIZE", default_value_t = 1000,
            value_parser = clap::value_parser!(i64).range(1..=100_000))
    )]
    pub batch_size: i64,
    /// After each retention step, a pause this many times as long as the step took: at 4 the
    /// runner works at most a fifth of the time, less when the database is slow; 0 lets a
    /// backlog be removed as fast as the database goes, at the cost of the pipeline's latency.
    #[cfg_attr(
        feature = "cli",
        arg(id = "retention_pause_ratio", long = "retention-pause-ratio", env = "RELAY_RETENTION_PAUSE_RATIO", default_value_t = 4.0,
            value_parser = pipeline_core::retention::runner::parse_pause_ratio)
    )]
    pub pause_ratio: f64,
    /// While a table is behind, remove at most this many times as many rows a second as it
    /// gains (or 1,000 rows a second, whichever is more), so a backlog costs a bounded share of
    /// the write load the pipeline already makes: at 1.2 it goes at a fifth of the rate rows
    /// arrive, with the deletes at most a fifth more than the inserts a caught-up table takes
    /// anyway. Above 1 (at 1 or below the table would never catch up); 0: no bound. A run by hand
    /// (`pipeline retention run`) is not bound.
    #[cfg_attr(
        feature = "cli",
        arg(id = "retention_catch_up", long = "retention-catch-up", env = "RELAY_RETENTION_CATCH_UP", default_value_t = 1.2,
            value_parser = pipeline_core::retention::pace::parse_ratio)
    )]
    pub catch_up: f64,
    /// How long a published event (its outbox row, delivery and attempts) is kept. Appending
    /// the same business fact (business key and event type) again within this window is a
    /// no-op; after it, a new event. Floor: 1m.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-published",
            env = "RELAY_RETAIN_PUBLISHED",
            default_value = "7d"
        )
    )]
    pub published: Window,
    /// How long operator actions are kept in the outbox's database (the audit trail). Floor: 30d.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-operator-actions",
            env = "RELAY_RETAIN_OPERATOR_ACTIONS",
            default_value = "365d"
        )
    )]
    pub operator_actions: Window,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        RetentionSettings {
            interval: Window::secs(30),
            batch_size: 1000,
            pause_ratio: 4.0,
            catch_up: 1.2,
            published: Window::days(7),
            operator_actions: Window::days(365),
        }
    }
}

/// Least `--retain-published`.
pub const PUBLISHED_FLOOR: Window = Window::secs(60);
/// Least `--retain-operator-actions`.
pub const OPERATOR_ACTIONS_FLOOR: Window = Window::days(30);

impl RetentionSettings {
    /// Refuses windows below their floors.
    pub fn validate(&self) -> Result<(), BelowFloor> {
        self.published.at_least(
            "--retain-published",
            PUBLISHED_FLOOR,
            "an append retried within a minute (a client's retry of the same request) must \
             still find its business fact and add nothing",
        )?;
        self.operator_actions.at_least(
            "--retain-operator-actions",
            OPERATOR_ACTIONS_FLOOR,
            "who did what to which event stays on record for at least a month",
        )?;
        Ok(())
    }

    /// Whether the relay runs retention at all.
    pub fn enabled(&self) -> bool {
        !self.interval.duration().is_zero()
    }
}

/// The outbox database's rules with these windows. `groups_here`: the groups' tables
/// (`dead_letter`, `parked_event`) are in the same database, so events they point to are kept.
pub fn rules(settings: &RetentionSettings, groups_here: bool) -> Vec<Rule> {
    vec![
        Rule {
            table: "outbox",
            window: settings.published,
            keeps: "events not published (pending, retrying, failed) and delayed events; where \
                    the groups share the database, events an open dead letter or a parked event \
                    points to",
            step_sql: if groups_here {
                PUBLISHED_STEP_WITH_GROUPS
            } else {
                PUBLISHED_STEP
            },
            oldest_sql: Some(
                "SELECT (SELECT created_at FROM outbox
                         WHERE id > COALESCE($1::bigint, 0) ORDER BY id LIMIT 1)",
            ),
            sweep: false,
            lock: OUTBOX_LOCK,
            partitions: None,
        },
        Rule {
            table: "outbox_schedule_occurrence",
            window: settings.published,
            keeps: "each schedule's latest occurrence",
            step_sql: OCCURRENCES_STEP,
            oldest_sql: Some("SELECT min(recorded_at) FROM outbox_schedule_occurrence"),
            sweep: true,
            lock: OUTBOX_LOCK,
            partitions: None,
        },
        pipeline_core::retention::rule::operator_actions(settings.operator_actions, OUTBOX_LOCK),
    ]
}

/// Whether `pool`'s database also holds the groups' tables.
pub async fn groups_here(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT to_regclass('dead_letter') IS NOT NULL AND to_regclass('parked_event') IS NOT NULL",
    )
    .fetch_one(pool)
    .await
}

/// Published events older than the cutoff, with their delivery and attempts, from the oldest
/// id on: those with a delivery record, and those published from the write-ahead log (no
/// delivery record, not queued, older than the streaming relay's horizon). An event that is not
/// published is passed over. The rows go by an array of ids, which is always planned as index
/// lookups; a join with the batch may be planned as a hash join over a whole table.
const PUBLISHED_STEP: &str = "
WITH batch AS (
    SELECT id, created_at FROM outbox WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
old AS (
    SELECT id, created_at FROM batch WHERE created_at < $1),
doomed AS (
    SELECT old.id FROM old LEFT JOIN outbox_delivery d USING (id)
    WHERE d.published_at < $1 OR (d.id IS NULL AND old.created_at < (SELECT max(horizon) FROM outbox_wal_source)
                                  AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = old.id))),
attempts AS (
    DELETE FROM outbox_attempt a WHERE a.event = ANY (ARRAY(SELECT id FROM doomed))),
deliveries AS (
    DELETE FROM outbox_delivery d WHERE d.id = ANY (ARRAY(SELECT id FROM doomed))),
removed AS (
    DELETE FROM outbox o WHERE o.id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING o.id)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM old)::text,
       (SELECT count(*) FROM old) < $3";

/// [`PUBLISHED_STEP`], keeping events an open dead letter or a parked event of a group in the
/// same database points to.
const PUBLISHED_STEP_WITH_GROUPS: &str = "
WITH batch AS (
    SELECT id, event_id, created_at FROM outbox
    WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
old AS (
    SELECT id, event_id, created_at FROM batch WHERE created_at < $1),
doomed AS (
    SELECT old.id FROM old LEFT JOIN outbox_delivery d USING (id)
    WHERE (d.published_at < $1 OR (d.id IS NULL AND old.created_at < (SELECT max(horizon) FROM outbox_wal_source)
                                  AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = old.id)))
      AND NOT EXISTS (SELECT 1 FROM dead_letter l
                      WHERE l.event_id = old.event_id AND l.status = 'open')
      AND NOT EXISTS (SELECT 1 FROM parked_event p WHERE p.event_id = old.event_id)),
attempts AS (
    DELETE FROM outbox_attempt a WHERE a.event = ANY (ARRAY(SELECT id FROM doomed))),
deliveries AS (
    DELETE FROM outbox_delivery d WHERE d.id = ANY (ARRAY(SELECT id FROM doomed))),
removed AS (
    DELETE FROM outbox o WHERE o.id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING o.id)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM old)::text,
       (SELECT count(*) FROM old) < $3";

/// Schedules' occurrences older than the cutoff, but each schedule's latest, swept in key order
/// (the cursor: the last key examined, as a JSON array [schedule, fire_at]). A schedule never
/// materialises a fire time before its next one, so a removed row is never needed again.
const OCCURRENCES_STEP: &str = "
WITH batch AS (
    SELECT schedule, fire_at FROM outbox_schedule_occurrence
    WHERE $2::jsonb IS NULL
       OR (schedule, fire_at) > ($2::jsonb ->> 0, ($2::jsonb ->> 1)::timestamptz)
    ORDER BY schedule, fire_at LIMIT $3),
doomed AS (
    SELECT b.schedule, b.fire_at FROM batch b
    WHERE b.fire_at < $1
      AND b.fire_at < (SELECT max(m.fire_at) FROM outbox_schedule_occurrence m
                       WHERE m.schedule = b.schedule)),
removed AS (
    DELETE FROM outbox_schedule_occurrence c USING doomed d
    WHERE c.schedule = d.schedule AND c.fire_at = d.fire_at RETURNING 1),
last AS (
    SELECT schedule, fire_at FROM batch ORDER BY schedule DESC, fire_at DESC LIMIT 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT jsonb_build_array(schedule, fire_at)::text FROM last),
       (SELECT count(*) FROM batch) < $3";
