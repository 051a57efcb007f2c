-- Retention: published events, their delivery and attempts, and operator actions are removed
-- once older than their window, by the active relay in bounded steps (see the README's
-- "Retention"). Nothing here rewrites a table or copies a row: a database in use takes it
-- while the pipeline runs.

-- What each table's retention runner last did, and the window it had (read by
-- `pipeline retention status`, and by `pipeline retention run` for the windows in force). The
-- same table exists in each group's database.
CREATE TABLE IF NOT EXISTS retention_state (
    table_name     text        PRIMARY KEY,
    window_seconds bigint      NOT NULL,
    -- Where a swept table's pass stopped (its runner's own format).
    cursor         text,
    last_run_at    timestamptz,
    last_removed   bigint      NOT NULL DEFAULT 0,
    total_removed  bigint      NOT NULL DEFAULT 0,
    caught_up_at   timestamptz,
    oldest_kept_at timestamptz,
    updated_by     text
);

-- Rows are removed from the old end of these tables as fast as they are added at the new end:
-- vacuum them after 2 % of their rows changed (instead of 20 %), so the space of removed rows
-- is reused by new ones before the tables grow.
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
ALTER TABLE outbox_delivery SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
