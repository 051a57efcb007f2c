-- Retention: dedupe rows, the effect history, resolved dead letters, operator actions and the
-- progress of orders long silent are removed once older than their window, by one consumer
-- of the database at a time, in bounded steps (see the README's "Retention"). Nothing here
-- rewrites a table or copies a row: a database in use takes it while the pipeline runs.

-- What each table's retention runner last did, and the window it had; the same table as in the
-- outbox's database.
CREATE TABLE IF NOT EXISTS retention_state (
    table_name     text        PRIMARY KEY,
    window_seconds bigint      NOT NULL,
    cursor         text,
    last_run_at    timestamptz,
    last_removed   bigint      NOT NULL DEFAULT 0,
    total_removed  bigint      NOT NULL DEFAULT 0,
    caught_up_at   timestamptz,
    oldest_kept_at timestamptz,
    updated_by     text
);

-- Per group: the progress of an order whose last event was applied before `forgotten_before`
-- may have been removed. An event of an order with no progress that occurred before it is a
-- redelivery of an order the group has forgotten: stale, never applied again. Consumers read
-- `forgotten_before`; retention removes progress only below `deletable_before`, a horizon
-- announced (`announced_at`) at least a minute earlier, so that no batch statement still
-- running from before the announcement can miss both an order's progress and the horizon.
CREATE TABLE IF NOT EXISTS progress_horizon (
    group_name       text        PRIMARY KEY,
    forgotten_before timestamptz NOT NULL,
    announced_at     timestamptz NOT NULL,
    deletable_before timestamptz NOT NULL
);

-- Rows are removed from the old end of these tables as fast as they are added at the new end:
-- vacuum them after 2 % of their rows changed (instead of 20 %), so the space of removed rows
-- is reused by new ones before the tables grow. Vacuum leaves their empty last pages in place
-- (new rows reuse them): giving them back takes an ACCESS EXCLUSIVE lock that every batch
-- transaction would wait behind.
ALTER TABLE processed_message SET (autovacuum_vacuum_scale_factor = 0.02,
                                   autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);
ALTER TABLE applied_effect SET (autovacuum_vacuum_scale_factor = 0.02,
                                autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);
ALTER TABLE order_progress SET (vacuum_truncate = false);
ALTER TABLE group_transition SET (vacuum_truncate = false);
