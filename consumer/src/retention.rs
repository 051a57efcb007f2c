//! Retention of the groups' tables, run by the consumers of a database (one at a time): dedupe
//! rows, the effect history, resolved dead letters, operator actions and the progress of orders
//! long silent are removed in bounded steps once older than their windows. Never removed: open
//! dead letters, parked events (and their dedupe rows), the history of an order that has an open
//! dead letter or parked events, and partition ownership.
//!
//! The effect history (`applied_effect`) is in time partitions, dropped whole once past the
//! history window ([`EFFECT_PARTITIONS`]); what an order with an open dead letter or parked events
//! still needs is copied into `applied_effect_held` first, and removed from there in steps once
//! nothing needs them. Other tables in time order (dedupe rows by event id, which the outbox makes
//! time-ordered; the transitions by id) are removed from their old end in bounded steps. `aggregate_progress` is one row per order, in no
//! time order: it is swept, a few batches a run.
//!
//! The dedupe window may be short without an event ever being applied twice: a redelivery
//! whose dedupe row is gone is recognised by its order's progress as stale. An order's progress
//! is removed once the order has been silent for the progress window; its events that occurred
//! before then are flagged stale too (the group's progress horizon, `progress_horizon`).

use pipeline_core::retention::{
    partitions, rule, runner::GROUPS_LOCK, BelowFloor, Rule, TimePartitions, Window,
};

/// How long a group's database keeps what exactly-once and the history need.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct RetentionSettings {
    /// How often a consumer runs retention on its database (one consumer of a database at a
    /// time; `0s`: never, run it with `pipeline retention run` then).
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retention-interval",
            env = "CONSUMER_RETENTION_INTERVAL",
            default_value = "30s"
        )
    )]
    pub interval: Window,
    /// Most rows one retention step examines (each step is a transaction of its own); of the
    /// dedupe rows, this many of each group's. A step's cost under load is mostly its commit, so
    /// larger steps remove more in the same share of the database's time.
    #[cfg_attr(
        feature = "cli",
        arg(id = "retention_batch_size", long = "retention-batch-size", env = "CONSUMER_RETENTION_BATCH_SIZE", default_value_t = 5000,
            value_parser = clap::value_parser!(i64).range(1..=100_000))
    )]
    pub batch_size: i64,
    /// After each retention step, a pause this many times as long as the step took: at 4 the
    /// runner works at most a fifth of the time, less when the database is slow; 0 lets a
    /// backlog be removed as fast as the database goes, at the cost of the pipeline's latency.
    #[cfg_attr(
        feature = "cli",
        arg(id = "retention_pause_ratio", long = "retention-pause-ratio", env = "CONSUMER_RETENTION_PAUSE_RATIO", default_value_t = 4.0,
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
        arg(id = "retention_catch_up", long = "retention-catch-up", env = "CONSUMER_RETENTION_CATCH_UP", default_value_t = 1.2,
            value_parser = pipeline_core::retention::pace::parse_ratio)
    )]
    pub catch_up: f64,
    /// How long a dedupe row (`processed_message`) is kept: at least as long as Kafka keeps the
    /// topic plus the furthest back an operator may reprocess. A redelivery within it is
    /// recognised as a duplicate; after it, as stale by its order's progress. Floor: 1m.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-dedupe",
            env = "CONSUMER_RETAIN_DEDUPE",
            default_value = "8d"
        )
    )]
    pub dedupe: Window,
    /// How long an order's progress (`aggregate_progress`) is kept after its last applied event.
    /// Past it the group forgets the order: an event that occurred before is flagged stale,
    /// and the order's next new event waits (parked) for predecessors the group no longer
    /// knows it applied. Floor: 1d, and at least --retain-dedupe.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-progress",
            env = "CONSUMER_RETAIN_PROGRESS",
            default_value = "365d"
        )
    )]
    pub progress: Window,
    /// How long the effect history (`applied_effect`, `group_transition`) is kept for
    /// `pipeline trace`. Floor: 1m.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-history",
            env = "CONSUMER_RETAIN_HISTORY",
            default_value = "7d"
        )
    )]
    pub history: Window,
    /// How long a dead letter is kept once resolved (replayed, skipped or discarded); open ones
    /// are kept until resolved. Floor: 1m.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-dead-letters",
            env = "CONSUMER_RETAIN_DEAD_LETTERS",
            default_value = "30d"
        )
    )]
    pub dead_letters: Window,
    /// How long operator actions are kept in the group's database (the audit trail). Floor: 30d.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "retain-operator-actions",
            env = "CONSUMER_RETAIN_OPERATOR_ACTIONS",
            default_value = "365d"
        )
    )]
    pub operator_actions: Window,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        RetentionSettings {
            interval: Window::secs(30),
            batch_size: 5000,
            pause_ratio: 4.0,
            catch_up: 1.2,
            dedupe: Window::days(8),
            progress: Window::days(365),
            history: Window::days(7),
            dead_letters: Window::days(30),
            operator_actions: Window::days(365),
        }
    }
}

/// Least `--retain-dedupe`, `--retain-history` and `--retain-dead-letters`.
pub const SHORT_FLOOR: Window = Window::secs(60);
/// Least `--retain-progress`.
pub const PROGRESS_FLOOR: Window = Window::days(1);
/// Least `--retain-operator-actions`.
pub const OPERATOR_ACTIONS_FLOOR: Window = Window::days(30);

impl RetentionSettings {
    /// Refuses windows below their floors.
    pub fn validate(&self) -> Result<(), BelowFloor> {
        self.dedupe.at_least(
            "--retain-dedupe",
            SHORT_FLOOR,
            "a batch retried within a minute must still find its dedupe rows",
        )?;
        self.progress.at_least(
            "--retain-progress",
            PROGRESS_FLOOR,
            "an order silent for less than a day must keep its place in sequence",
        )?;
        self.progress.at_least(
            "--retain-progress",
            self.dedupe,
            "past the dedupe window only an order's progress recognises a redelivery; it must \
             be kept at least as long as the dedupe rows (--retain-dedupe)",
        )?;
        self.history.at_least(
            "--retain-history",
            SHORT_FLOOR,
            "a minute of history is the least `pipeline trace` shows",
        )?;
        self.dead_letters.at_least(
            "--retain-dead-letters",
            SHORT_FLOOR,
            "a resolved letter stays visible for at least a minute",
        )?;
        self.operator_actions.at_least(
            "--retain-operator-actions",
            OPERATOR_ACTIONS_FLOOR,
            "who did what to which event stays on record for at least a month",
        )?;
        Ok(())
    }

    /// Whether consumers run retention at all.
    pub fn enabled(&self) -> bool {
        !self.interval.duration().is_zero()
    }
}

/// A group database's rules with these windows.
pub fn rules(settings: &RetentionSettings) -> Vec<Rule> {
    vec![
        Rule {
            table: "processed_message",
            window: settings.dedupe,
            keeps: "dedupe rows of parked events and of events an open dead letter holds",
            step_sql: DEDUPE_STEP,
            oldest_sql: Some(
                "SELECT min(x.processed_at)
                 FROM (SELECT DISTINCT group_name FROM partition_owner) g
                 CROSS JOIN LATERAL (
                     SELECT processed_at FROM processed_message m
                     WHERE m.group_name = g.group_name
                       AND m.event_id > COALESCE(($1::jsonb ->> g.group_name)::uuid,
                                                 '00000000-0000-0000-0000-000000000000')
                     ORDER BY m.event_id LIMIT 1) x",
            ),
            sweep: false,
            lock: GROUPS_LOCK,
            partitions: None,
        },
        Rule {
            table: "applied_effect",
            window: settings.history,
            keeps: "the history of aggregates with an open dead letter or parked events",
            step_sql: HELD_EFFECTS_STEP,
            oldest_sql: Some(
                "SELECT (SELECT applied_at FROM applied_effect_held
                         WHERE id > COALESCE($1::bigint, 0) ORDER BY id LIMIT 1)",
            ),
            sweep: false,
            lock: GROUPS_LOCK,
            partitions: Some(EFFECT_PARTITIONS),
        },
        Rule {
            table: "group_transition",
            window: settings.history,
            keeps: "the history of aggregates with an open dead letter or parked events",
            step_sql: TRANSITIONS_STEP,
            oldest_sql: Some(
                "SELECT (SELECT at FROM group_transition
                         WHERE id > COALESCE($1::bigint, 0) ORDER BY id LIMIT 1)",
            ),
            sweep: false,
            lock: GROUPS_LOCK,
            partitions: None,
        },
        Rule {
            table: "dead_letter",
            window: settings.dead_letters,
            keeps: "open letters, whatever their age",
            step_sql: DEAD_LETTERS_STEP,
            oldest_sql: Some("SELECT (SELECT created_at FROM dead_letter ORDER BY id LIMIT 1)"),
            sweep: true,
            lock: GROUPS_LOCK,
            partitions: None,
        },
        Rule {
            table: "aggregate_progress",
            window: settings.progress,
            keeps: "aggregates with parked events or an open dead letter",
            step_sql: PROGRESS_STEP,
            oldest_sql: None,
            sweep: true,
            lock: GROUPS_LOCK,
            partitions: None,
        },
        rule::operator_actions(settings.operator_actions, GROUPS_LOCK),
    ]
}

/// Dedupe rows older than the cutoff, per group, in event-id order (UUIDv7: time order) up to
/// the first id of the cutoff's millisecond. The cursor is a JSON object of each group's last
/// id examined. A row is removed only when it was also processed before the cutoff.
///
/// The rows go by their physical address (`ctid`), read with them: a join back on the key was
/// planned as a hash join over the whole table, reading all of it for every step. A row updated
/// in between (a parked event unparked) is no longer at that address and stays.
const DEDUPE_STEP: &str = "
WITH state AS (
    SELECT COALESCE($2::jsonb, '{}'::jsonb) AS c,
           (lpad(to_hex((extract(epoch FROM $1::timestamptz) * 1000)::bigint), 12, '0')
            || '00000000000000000000')::uuid AS bound),
batch AS (
    SELECT m.row_id, m.group_name, m.event_id, m.processed_at, m.outcome
    FROM (SELECT DISTINCT group_name FROM partition_owner) g
    CROSS JOIN LATERAL (
        SELECT ctid AS row_id, group_name, event_id, processed_at, outcome
        FROM processed_message m
        WHERE m.group_name = g.group_name
          AND m.event_id > COALESCE(((SELECT c FROM state) ->> g.group_name)::uuid,
                                    '00000000-0000-0000-0000-000000000000')
          AND m.event_id < (SELECT bound FROM state)
        ORDER BY m.event_id LIMIT $3) m),
doomed AS (
    SELECT b.row_id FROM batch b
    WHERE b.processed_at < $1
      AND b.outcome <> 'parked'
      AND NOT (b.outcome = 'dead_lettered'
               AND EXISTS (SELECT 1 FROM dead_letter l
                           WHERE l.group_name = b.group_name AND l.event_id = b.event_id
                             AND l.status = 'open'))),
removed AS (
    DELETE FROM processed_message m
    WHERE m.ctid = ANY (ARRAY(SELECT row_id FROM doomed))
      AND m.processed_at < $1 AND m.outcome <> 'parked'
    RETURNING 1),
walked AS (
    SELECT group_name, max(event_id::text) AS last, count(*) AS n FROM batch GROUP BY group_name)
SELECT (SELECT count(*) FROM removed),
       ((SELECT c FROM state)
        || COALESCE((SELECT jsonb_object_agg(group_name, last) FROM walked), '{}'::jsonb))::text,
       NOT EXISTS (SELECT 1 FROM walked WHERE n >= $3)";

/// The effect history's time partitions (`applied_at`): a partition goes once all of it is
/// older than the history window; the history of orders with an open dead letter or parked
/// events is copied into `applied_effect_held` first.
pub const EFFECT_PARTITIONS: TimePartitions = TimePartitions {
    table: "applied_effect",
    column: "applied_at",
    keep_sql: Some(KEEP_EFFECTS),
};

/// Creates the effect history's partitions for the time to come, on the grid the history
/// window gives them (see [`pipeline_core::retention::partitions::span`]): consumers do it at
/// start and every few seconds, whether or not they run retention.
pub async fn ensure_partitions(
    pool: &sqlx::PgPool,
    settings: &RetentionSettings,
) -> Result<u32, sqlx::Error> {
    let span = partitions::span(settings.history.duration());
    EFFECT_PARTITIONS
        .ensure(pool, span, partitions::runway(span))
        .await
}

/// A detached partition's effects that outlive it: those of orders with an open dead letter or
/// parked events, found from those (few) orders through the partition's order index.
const KEEP_EFFECTS: &str = "
INSERT INTO applied_effect_held (id, group_name, event_id, aggregate_id, sequence, event_type,
                                 occurred_at, applied_at)
SELECT a.id, a.group_name, a.event_id, a.aggregate_id, a.sequence, a.event_type, a.occurred_at,
       a.applied_at
FROM (SELECT group_name, aggregate_id FROM dead_letter WHERE status = 'open' AND aggregate_id IS NOT NULL
      UNION
      SELECT group_name, aggregate_id FROM parked_event) k
JOIN {partition} a ON a.group_name = k.group_name AND a.aggregate_id = k.aggregate_id
ON CONFLICT (id) DO NOTHING";

/// Effects kept past their partition (`applied_effect_held`) once older than the cutoff and no
/// longer needed, from the oldest id on.
const HELD_EFFECTS_STEP: &str = "
WITH batch AS (
    SELECT id, group_name, aggregate_id, applied_at FROM applied_effect_held
    WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
old AS (
    SELECT * FROM batch WHERE applied_at < $1),
doomed AS (
    SELECT o.id FROM old o
    WHERE NOT EXISTS (SELECT 1 FROM dead_letter l
                      WHERE l.status = 'open' AND l.group_name = o.group_name
                        AND l.aggregate_id = o.aggregate_id)
      AND NOT EXISTS (SELECT 1 FROM parked_event p
                      WHERE p.aggregate_id = o.aggregate_id AND p.group_name = o.group_name)),
removed AS (
    DELETE FROM applied_effect_held a WHERE a.id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM old)::text,
       (SELECT count(*) FROM old) < $3";

/// Transitions older than the cutoff, from the oldest id on.
const TRANSITIONS_STEP: &str = "
WITH batch AS (
    SELECT id, group_name, aggregate_id, at FROM group_transition
    WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
old AS (
    SELECT * FROM batch WHERE at < $1),
doomed AS (
    SELECT o.id FROM old o
    WHERE o.aggregate_id IS NULL
       OR (NOT EXISTS (SELECT 1 FROM dead_letter l
                       WHERE l.status = 'open' AND l.group_name = o.group_name
                         AND l.aggregate_id = o.aggregate_id)
           AND NOT EXISTS (SELECT 1 FROM parked_event p
                           WHERE p.aggregate_id = o.aggregate_id AND p.group_name = o.group_name))),
removed AS (
    DELETE FROM group_transition t WHERE t.id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM old)::text,
       (SELECT count(*) FROM old) < $3";

/// Resolved dead letters resolved before the cutoff, swept in id order.
const DEAD_LETTERS_STEP: &str = "
WITH batch AS (
    SELECT id, status, COALESCE(resolved_at, last_failure_at) AS resolved_at FROM dead_letter
    WHERE id > COALESCE($2::bigint, 0) ORDER BY id LIMIT $3),
doomed AS (
    SELECT id FROM batch WHERE status <> 'open' AND resolved_at < $1),
removed AS (
    DELETE FROM dead_letter d USING doomed WHERE d.id = doomed.id RETURNING 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT max(id) FROM batch)::text,
       (SELECT count(*) FROM batch) < $3";

/// The progress of aggregates whose last event was applied before the cutoff, swept in key order.
/// The cursor is the last key examined, as a JSON array [aggregate_id, group_name].
///
/// Each group's horizon is announced before any progress below it goes: a step raises
/// `forgotten_before` to the cutoff only once the previous announcement is a minute old, and
/// removes progress only below an announcement at least that old. A batch statement (bounded by
/// the consumer's statement timeout, seconds) that read no progress for an order therefore saw
/// a horizon covering it. A row a batch transaction updates meanwhile is no longer older than
/// the cutoff when the delete reaches it, and stays.
const PROGRESS_STEP: &str = "
WITH batch AS (
    SELECT aggregate_id, group_name, updated_at FROM aggregate_progress
    WHERE $2::jsonb IS NULL
       OR (aggregate_id, group_name) > ($2::jsonb ->> 0, $2::jsonb ->> 1)
    ORDER BY aggregate_id, group_name LIMIT $3),
groups AS (
    SELECT DISTINCT group_name FROM batch),
seeded AS (
    INSERT INTO progress_horizon (group_name, forgotten_before, announced_at, deletable_before)
    SELECT group_name, 'epoch', 'epoch', 'epoch' FROM groups
    ON CONFLICT (group_name) DO NOTHING),
horizon AS (
    SELECT h.group_name, h.forgotten_before, h.deletable_before,
           h.announced_at < now() - interval '1 minute' AS aged
    FROM progress_horizon h JOIN groups USING (group_name)),
announced AS (
    UPDATE progress_horizon h
    SET deletable_before = x.forgotten_before, forgotten_before = $1, announced_at = now()
    FROM horizon x
    WHERE h.group_name = x.group_name AND x.aged AND x.forgotten_before < $1),
deletable AS (
    SELECT group_name, CASE WHEN aged THEN forgotten_before ELSE deletable_before END AS before
    FROM horizon),
doomed AS (
    SELECT b.aggregate_id, b.group_name FROM batch b JOIN deletable x USING (group_name)
    WHERE b.updated_at < $1 AND b.updated_at < x.before
      AND NOT EXISTS (SELECT 1 FROM parked_event p
                      WHERE p.aggregate_id = b.aggregate_id AND p.group_name = b.group_name)
      AND NOT EXISTS (SELECT 1 FROM dead_letter l
                      WHERE l.status = 'open' AND l.group_name = b.group_name
                        AND l.aggregate_id = b.aggregate_id)),
removed AS (
    DELETE FROM aggregate_progress p USING doomed d
    WHERE p.aggregate_id = d.aggregate_id AND p.group_name = d.group_name AND p.updated_at < $1
    RETURNING 1),
last AS (
    SELECT aggregate_id, group_name FROM batch ORDER BY aggregate_id DESC, group_name DESC LIMIT 1)
SELECT (SELECT count(*) FROM removed),
       (SELECT jsonb_build_array(aggregate_id, group_name)::text FROM last),
       (SELECT count(*) FROM batch) < $3";
