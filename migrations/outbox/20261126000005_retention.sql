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
-- is reused by new ones before the tables grow. Vacuum leaves their empty last pages in place
-- (new rows reuse them): giving them back takes an ACCESS EXCLUSIVE lock that the relay's marks
-- and the writers' inserts would wait behind. The relay's queue table is truncated only by the
-- relay's own vacuum, once a backlog grew it (relay/src/vacuum.rs).
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000,
                        vacuum_truncate = false);
ALTER TABLE outbox_delivery SET (autovacuum_vacuum_scale_factor = 0.02,
                                 autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);
ALTER TABLE outbox_attempt SET (vacuum_truncate = false);
ALTER TABLE outbox_unpublished SET (vacuum_truncate = false);
