-- Recurring schedules: a cron expression in a time zone, and the event each occurrence appends.
-- The active relay materialises each occurrence that falls due as a delayed event (publish time:
-- the occurrence's), once: the occurrence's row (schedule, fire time) and the event's business
-- fact are both unique, and the relay writes them fenced by its lease epoch.

CREATE TABLE IF NOT EXISTS outbox_schedule (
    name         text        PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    -- Six fields (seconds first) or the usual five; evaluated in `time_zone` (IANA name).
    cron         text        NOT NULL,
    time_zone    text        NOT NULL,
    event_type   text        NOT NULL,
    aggregate_id text        NOT NULL,
    topic        text        NOT NULL,
    -- Its string values may name {{schedule}}, {{fire_at}} (UTC) and {{local_time}}.
    payload      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Occurrences that fell due while no relay was active: fire the latest one only, every one,
    -- or none that is more than a minute late.
    missed       text        NOT NULL DEFAULT 'latest' CHECK (missed IN ('latest', 'all', 'skip')),
    enabled      boolean     NOT NULL DEFAULT true,
    -- The next occurrence to materialise (NULL while paused).
    next_fire_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS outbox_schedule_due_idx ON outbox_schedule (next_fire_at)
    WHERE enabled;

-- One row per occurrence materialised (or passed over by the missed-occurrence policy), and per
-- run-now: the unique key that keeps an occurrence from being materialised twice.
CREATE TABLE IF NOT EXISTS outbox_schedule_occurrence (
    schedule    text        NOT NULL REFERENCES outbox_schedule (name) ON DELETE CASCADE,
    fire_at     timestamptz NOT NULL,
    -- fired (an event was appended), skipped (the missed-occurrence policy passed over it),
    -- run_now (an operator's extra occurrence).
    outcome     text        NOT NULL CHECK (outcome IN ('fired', 'skipped', 'run_now')),
    event_id    uuid,
    relay_epoch bigint,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (schedule, fire_at)
);
ALTER TABLE outbox_schedule_occurrence SET (vacuum_truncate = false);
