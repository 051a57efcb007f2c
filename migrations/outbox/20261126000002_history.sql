-- The history of every outbox event, for `pipeline trace` and for people. Each state change is
-- recorded in the transaction that makes it, by the statement that makes it:
--   written      the outbox row itself (created_at);
--   attempt      a failed publish attempt, with its error, and whether it was the last one
--                (the event is then failed and holds its aggregate's later events);
--   published    outbox_delivery (partition, offset, published_at);
--   requeued     an operator's requeue of a failed event (operator_action).
-- Only the unusual paths (a failed attempt, an operator's action) write rows of their own: a
-- published event costs nothing more than it did.

CREATE TABLE IF NOT EXISTS outbox_attempt (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- outbox.id of the event.
    event        bigint      NOT NULL,
    -- The event's attempt count after this attempt (it starts again at 1 after a requeue).
    attempt      integer     NOT NULL,
    error        text        NOT NULL,
    -- No attempt is left: the event became `failed`.
    gave_up      boolean     NOT NULL,
    relay_epoch  bigint      NOT NULL,
    attempted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS outbox_attempt_event_idx ON outbox_attempt (event, id);

-- What operators did, by whom and why. The same table exists in every database of the pipeline
-- (the outbox's and each group's): each action is recorded in the transaction that makes it,
-- in the database it changes.
CREATE TABLE IF NOT EXISTS operator_action (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    acted_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor        text        NOT NULL,
    -- e.g. outbox.requeue, dead_letter.replay, dead_letter.discard, dead_letter.skip,
    -- group.reprocess.
    action       text        NOT NULL,
    reason       text        NOT NULL,
    group_name   text,
    event_id     uuid,
    aggregate_id text,
    -- What the action changed (ids, counts, offsets), as the command printed it.
    detail       jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX IF NOT EXISTS operator_action_aggregate_idx ON operator_action (aggregate_id, id)
    WHERE aggregate_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS operator_action_event_idx ON operator_action (event_id, id)
    WHERE event_id IS NOT NULL;

-- One row per state change of each outbox event, in the order they happened.
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
WHERE x.action = 'outbox.requeue';
