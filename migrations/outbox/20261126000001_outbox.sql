-- The transactional outbox and its relay: the tables a service that appends events needs, and
-- nothing else. Written to apply to a new database and to one that already has these tables
-- from an earlier layout of the migrations (every statement is idempotent).

-- Per-aggregate event sequence. The row is locked by the transaction that appends an event, so
-- events of one aggregate commit in sequence order.
CREATE TABLE IF NOT EXISTS outbox_sequence (
    aggregate_id  text   PRIMARY KEY,
    last_sequence bigint NOT NULL
);
-- Rewritten on every event: free room in its pages keeps those updates HOT.
ALTER TABLE outbox_sequence SET (fillfactor = 70);

-- One row per event, written in the same transaction as the business change it describes, and
-- never rewritten.
CREATE TABLE IF NOT EXISTS outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id     uuid        NOT NULL,
    business_key text        NOT NULL,
    event_type   text        NOT NULL,
    aggregate_id text        NOT NULL,
    sequence     bigint      NOT NULL CHECK (sequence > 0),
    topic        text        NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT outbox_event_id_key UNIQUE (event_id),
    CONSTRAINT outbox_business_fact_key UNIQUE (business_key, event_type),
    CONSTRAINT outbox_aggregate_sequence_key UNIQUE (aggregate_id, sequence)
);

-- Every event is in exactly one of:
--   outbox_unpublished  the relay's work queue (pending, or failed for good), small rows;
--   outbox_delivery     where Kafka stored it (partition, offset) and when.
-- Publishing an event is one DELETE from the first and one INSERT into the second, in the same
-- statement.
CREATE TABLE IF NOT EXISTS outbox_unpublished (
    id              bigint      PRIMARY KEY,
    aggregate_id    text        NOT NULL,
    sequence        bigint      NOT NULL,
    created_at      timestamptz NOT NULL,
    state           text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT '-infinity',
    last_attempt_at timestamptz,
    last_error      text
);
-- "Is an earlier event of this aggregate failed or waiting for a retry?" Only rows that failed an
-- attempt can be, so the index holds just those.
CREATE INDEX IF NOT EXISTS outbox_unpublished_retrying_idx ON outbox_unpublished (aggregate_id, sequence)
    WHERE attempts > 0;
-- A queue table: rows come and go all the time, so vacuum it often to keep its scans short.
ALTER TABLE outbox_unpublished SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000
);

CREATE TABLE IF NOT EXISTS outbox_delivery (
    id              bigint      PRIMARY KEY,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    attempts        integer     NOT NULL,
    published_at    timestamptz NOT NULL DEFAULT now()
);

-- Every event written to the outbox, by the library or by any other writer, joins the relay's
-- queue in the same transaction. One statement-level trigger per INSERT statement, so a
-- multi-row insert queues its rows with one more statement, not one per row. Rows an
-- ON CONFLICT DO NOTHING skipped are not in the transition table.
CREATE OR REPLACE FUNCTION outbox_queue_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
    SELECT id, aggregate_id, sequence, created_at FROM inserted_events;
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS outbox_queue_inserted ON outbox;
CREATE TRIGGER outbox_queue_inserted
    AFTER INSERT ON outbox
    REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_queue_inserted();

-- One row per event with its publishing state, for people and tools.
CREATE OR REPLACE VIEW outbox_status AS
SELECT o.id, o.event_id, o.business_key, o.event_type, o.aggregate_id, o.sequence, o.topic,
       o.payload, o.headers, o.created_at,
       CASE WHEN d.id IS NOT NULL THEN 'published' ELSE u.state END AS state,
       COALESCE(d.attempts, u.attempts)                               AS attempts,
       u.next_attempt_at,
       u.last_attempt_at,
       u.last_error,
       d.kafka_partition,
       d.kafka_offset,
       d.published_at
FROM outbox o
LEFT JOIN outbox_delivery d ON d.id = o.id
LEFT JOIN outbox_unpublished u ON u.id = o.id;

-- The active relay holds a lease: a row with an epoch that grows on every takeover and an expiry
-- the holder keeps pushing forward. A standby takes the lease over when it has expired (the
-- holder is frozen or cut off from the database) or when the holder's renewing session has
-- ended (the holder died). Every write the relay makes about events (marking them published,
-- recording a failed attempt) takes a share lock on this row and names its epoch, so a relay
-- that lost the lease can change nothing: its writes find no row and are refused.
CREATE TABLE IF NOT EXISTS relay_lease (
    lease_key   bigint      PRIMARY KEY,
    epoch       bigint      NOT NULL DEFAULT 0,
    holder      uuid,
    -- pg_backend_pid() of the holder's renewing session.
    holder_pid  integer,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz NOT NULL DEFAULT '-infinity'
);
ALTER TABLE relay_lease SET (fillfactor = 50);
