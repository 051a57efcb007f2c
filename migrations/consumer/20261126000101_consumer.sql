-- What a consumer group needs besides its own effect tables: dedupe rows, per-aggregate progress,
-- parked events, dead letters, the effect history and partition ownership. They live in the
-- group's own database, next to its effects, so both commit in one transaction. Written to
-- apply to a new database and to one that already has these tables from an earlier layout of
-- the migrations (every statement is idempotent).

-- Exactly-once: a group applies an event only in the transaction that inserts this row.
CREATE TABLE IF NOT EXISTS processed_message (
    group_name   text        NOT NULL,
    event_id     uuid        NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    kafka_offset bigint      NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('applied', 'parked', 'stale', 'dead_lettered')),
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, event_id)
);

-- Last sequence applied per aggregate and group: the next event applied must carry last + 1.
-- Keyed with the aggregate first, so "these aggregates of this group" is one index lookup each
-- whatever the table's size when a cached plan was made.
CREATE TABLE IF NOT EXISTS order_progress (
    group_name    text        NOT NULL,
    order_id      text        NOT NULL,
    last_sequence bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (order_id, group_name)
);
-- Rewritten on every event: free room in its pages keeps those updates HOT.
ALTER TABLE order_progress SET (fillfactor = 70);

-- Events that arrived ahead of their predecessor: recorded, not applied, released in sequence
-- order once the gap closes.
CREATE TABLE IF NOT EXISTS parked_event (
    group_name   text        NOT NULL,
    order_id     text        NOT NULL,
    sequence     bigint      NOT NULL,
    event_id     uuid        NOT NULL,
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,
    occurred_at  timestamptz,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    kafka_offset bigint      NOT NULL,
    reason       text        NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, order_id, sequence)
);
CREATE INDEX IF NOT EXISTS parked_event_order_idx ON parked_event (order_id, group_name);

-- Messages a group could not apply because the message itself is bad, with the cause.
CREATE TABLE IF NOT EXISTS dead_letter (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name       text        NOT NULL,
    event_id         uuid,
    order_id         text,
    topic            text        NOT NULL,
    partition        integer     NOT NULL,
    kafka_offset     bigint      NOT NULL,
    reason           text        NOT NULL,
    key              bytea,
    payload          bytea,
    headers          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    sequence         bigint,
    event_type       text,
    attempts         integer     NOT NULL DEFAULT 1,
    first_failure_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_failure_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    status           text        NOT NULL DEFAULT 'open'
                     CHECK (status IN ('open', 'replayed', 'discarded')),
    resolved_at      timestamptz,
    resolution       text,
    CONSTRAINT dead_letter_record_key UNIQUE (group_name, topic, partition, kafka_offset)
);
CREATE INDEX IF NOT EXISTS dead_letter_group_idx ON dead_letter (group_name, created_at);
CREATE INDEX IF NOT EXISTS dead_letter_open_idx ON dead_letter (group_name, order_id) WHERE status = 'open';

-- History of every effect a group applied. Deliberately without a unique constraint: a broken
-- dedupe shows here as a second row for the same (group, event).
CREATE TABLE IF NOT EXISTS applied_effect (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name  text        NOT NULL,
    event_id    uuid        NOT NULL,
    order_id    text        NOT NULL,
    sequence    bigint      NOT NULL,
    event_type  text        NOT NULL,
    occurred_at timestamptz,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS applied_effect_order_idx ON applied_effect (group_name, order_id, id);

-- Which consumer currently owns a partition for a group. A new owner replaces the token when the
-- partition is assigned to it; a batch transaction first checks, with a share lock, that its
-- token is still the owner's, so a consumer that lost its partitions (a paused or cut-off
-- "zombie") can apply nothing afterwards, and the new owner's takeover waits for its in-flight
-- transaction.
CREATE TABLE IF NOT EXISTS partition_owner (
    group_name  text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    owner       uuid        NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, topic, partition)
);
ALTER TABLE partition_owner SET (fillfactor = 50);
