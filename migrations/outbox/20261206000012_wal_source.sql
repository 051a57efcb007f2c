-- The relay may read the outbox's inserts from the write-ahead log (`--source wal`) instead of
-- claiming them from its queue table. While a relay streams, writers add nothing to the queue
-- (and notify no one), and the relay records no delivery per event: what it has published is
-- known from one row, its horizon, which it moves forward about once a second.
--
-- horizon: every outbox event created before it that has neither a delivery record nor a queue
-- row was published from the log. The relay sets it from a probe (the server's WAL insert
-- position and the start of its oldest open transaction) once the slot's confirmed position has
-- passed the probe's. An event created after it may or may not be published yet; falling back to
-- the queue queues exactly those (some again: consumers skip what they already applied).
CREATE TABLE IF NOT EXISTS outbox_wal_source (
    lock_key   bigint      PRIMARY KEY,
    slot       text        NOT NULL,
    streaming  boolean     NOT NULL,
    horizon    timestamptz NOT NULL,
    -- The outbox's last id when the horizon's probe was taken: events with a greater id are
    -- (nearly all) newer than the horizon, which the backlog gauges count from.
    horizon_id bigint      NOT NULL DEFAULT 0,
    confirmed  pg_lsn,
    since      timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The insert trigger queues and notifies only while no relay streams the log.
CREATE OR REPLACE FUNCTION outbox_queue_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_wal_source WHERE streaming) THEN
        RETURN NULL;
    END IF;
    INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
    SELECT id, aggregate_id, sequence, created_at FROM inserted_events;
    -- Wake a relay that waits (PostgreSQL folds one transaction's identical notifications).
    IF (SELECT bool_or(listening) FROM outbox_relay_wakeup) IS NOT FALSE THEN
        PERFORM pg_notify('outbox_pending', '');
    END IF;
    RETURN NULL;
END
$$;

-- An event with neither a delivery record nor a queue row is published when it is older than the
-- horizon of a relay that streams (or streamed) the log, and pending otherwise.
CREATE OR REPLACE VIEW outbox_status AS
SELECT o.id, o.event_id, o.business_key, o.event_type, o.aggregate_id, o.sequence, o.topic,
       o.payload, o.headers, o.created_at,
       CASE WHEN d.id IS NOT NULL THEN 'published'
            WHEN u.id IS NOT NULL THEN u.state
            WHEN o.created_at < (SELECT max(horizon) FROM outbox_wal_source) THEN 'published'
            ELSE 'pending' END                                        AS state,
       COALESCE(d.attempts, u.attempts, 0)                            AS attempts,
       u.next_attempt_at,
       u.last_attempt_at,
       u.last_error,
       d.kafka_partition,
       d.kafka_offset,
       d.published_at
FROM outbox o
LEFT JOIN outbox_delivery d ON d.id = o.id
LEFT JOIN outbox_unpublished u ON u.id = o.id;
