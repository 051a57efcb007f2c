-- Publishing state moves out of the outbox rows. An outbox row is written once and never rewritten
-- on the happy path: rewriting it to mark it published copied the whole row (payload included)
-- into a new version and a new entry in every index, which was most of the relay's database time.
--
-- Every event is in exactly one of:
--   outbox_unpublished  the relay's work queue (pending, or failed for good), small rows;
--   outbox_delivery     where Kafka stored it (partition, offset) and when.
-- Publishing an event is one DELETE from the first and one INSERT into the second, in the same
-- statement. outbox_status joins the three for people and tools that want the old columns.

CREATE TABLE outbox_unpublished (
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
CREATE INDEX outbox_unpublished_retrying_idx ON outbox_unpublished (aggregate_id, sequence)
    WHERE attempts > 0;

-- A queue table: rows come and go all the time, so vacuum it often to keep its scans short.
ALTER TABLE outbox_unpublished SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000
);

CREATE TABLE outbox_delivery (
    id              bigint      PRIMARY KEY,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    attempts        integer     NOT NULL,
    published_at    timestamptz NOT NULL DEFAULT now()
);

INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at, state, attempts,
                                next_attempt_at, last_attempt_at, last_error)
SELECT id, aggregate_id, sequence, created_at, state, attempts, next_attempt_at, last_attempt_at,
       last_error
FROM outbox WHERE state <> 'published';

INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts, published_at)
SELECT id, COALESCE(kafka_partition, -1), COALESCE(kafka_offset, -1), attempts,
       COALESCE(published_at, updated_at)
FROM outbox WHERE state = 'published';

DROP INDEX outbox_pending_idx;
DROP INDEX outbox_retrying_by_aggregate_idx;
ALTER TABLE outbox
    DROP COLUMN state,
    DROP COLUMN attempts,
    DROP COLUMN next_attempt_at,
    DROP COLUMN last_attempt_at,
    DROP COLUMN last_error,
    DROP COLUMN kafka_partition,
    DROP COLUMN kafka_offset,
    DROP COLUMN updated_at,
    DROP COLUMN published_at;

-- Every event written to the outbox, by our library or by any other writer, joins the relay's
-- queue in the same transaction. One statement-level trigger per INSERT statement, so a
-- multi-row insert queues its rows with one more statement, not one per row. Rows an
-- ON CONFLICT DO NOTHING skipped are not in the transition table.
CREATE FUNCTION outbox_queue_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
    SELECT id, aggregate_id, sequence, created_at FROM inserted_events;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_queue_inserted
    AFTER INSERT ON outbox
    REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_queue_inserted();

-- The outbox as it read before: one row per event with its publishing state.
CREATE VIEW outbox_status AS
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
