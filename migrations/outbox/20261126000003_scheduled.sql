-- Delayed and scheduled events: an event with an earliest publish time waits here, written in
-- the caller's transaction like any event, until it is due. The active relay then moves due
-- events into the outbox in one statement: each takes the next sequence number of its
-- aggregate at that moment, so a waiting event never holds its aggregate's other events, and
-- once due it is published after every event its aggregate committed before it.
--
-- The relay's claim never reads this table: events scheduled far ahead cost it nothing.

CREATE TABLE IF NOT EXISTS outbox_scheduled (
    event_id     uuid        PRIMARY KEY,
    business_key text        NOT NULL,
    event_type   text        NOT NULL,
    aggregate_id text        NOT NULL,
    topic        text        NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Not published before this time.
    publish_at   timestamptz NOT NULL,
    scheduled_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT outbox_scheduled_business_fact_key UNIQUE (business_key, event_type)
);
-- The relay reads the due head of this index: its cost does not grow with events waiting
-- further ahead.
CREATE INDEX IF NOT EXISTS outbox_scheduled_due_idx ON outbox_scheduled (publish_at, event_id);
CREATE INDEX IF NOT EXISTS outbox_scheduled_aggregate_idx ON outbox_scheduled (aggregate_id);

-- One row per state change of each outbox event, in the order they happened; an event still
-- waiting for its publish time shows as `scheduled` (with no outbox id yet).
CREATE OR REPLACE VIEW outbox_history AS
SELECT o.id, o.event_id, o.aggregate_id, o.sequence, o.event_type,
       o.created_at AS at, 'written' AS transition, NULL::text AS detail,
       NULL::integer AS kafka_partition, NULL::bigint AS kafka_offset
FROM outbox o
UNION ALL
SELECT o.id, o.event_id, o.aggregate_id, o.sequence, o.event_type,
       a.attempted_at, CASE WHEN a.gave_up THEN 'failed' ELSE 'attempt_failed' END,
       format('attempt %s (relay epoch %s): %s', a.attempt, a.relay_epoch, a.error),
       NULL, NULL
FROM outbox_attempt a JOIN outbox o ON o.id = a.event
UNION ALL
SELECT o.id, o.event_id, o.aggregate_id, o.sequence, o.event_type,
       d.published_at, 'published', format('after %s attempt(s)', d.attempts),
       d.kafka_partition, d.kafka_offset
FROM outbox_delivery d JOIN outbox o ON o.id = d.id
UNION ALL
SELECT o.id, o.event_id, o.aggregate_id, o.sequence, o.event_type,
       x.acted_at, 'requeued', format('by %s: %s', x.actor, x.reason), NULL, NULL
FROM operator_action x JOIN outbox o ON o.event_id = x.event_id
WHERE x.action = 'outbox.requeue'
UNION ALL
SELECT NULL, s.event_id, s.aggregate_id, NULL, s.event_type,
       s.scheduled_at, 'scheduled', format('publish at %s', s.publish_at), NULL, NULL
FROM outbox_scheduled s;
