-- What each group did with each event, for `pipeline trace` and for people. Every outcome is
-- recorded in the batch transaction that reaches it, by a statement that already runs there:
--   applied        applied_effect (one row per effect applied; written before this file);
--   duplicate      a redelivered event the dedupe rows recognised, so not applied again;
--   parked         arrived ahead of its predecessor, kept until the gap closes;
--   released       a parked event applied once the gap closed;
--   stale          an event whose sequence the order had already passed;
--   dead_lettered  could not be applied, with the reason;
-- and the operators' actions (replay, skip, discard, reprocess) in operator_action. An event
-- applied on first delivery writes nothing more than it did.

CREATE TABLE IF NOT EXISTS group_transition (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name   text        NOT NULL,
    -- NULL for a record without a readable event.
    event_id     uuid,
    order_id     text,
    sequence     bigint,
    event_type   text,
    transition   text        NOT NULL
                 CHECK (transition IN ('duplicate', 'parked', 'released', 'stale', 'dead_lettered')),
    detail       text,
    topic        text,
    partition    integer,
    kafka_offset bigint,
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS group_transition_order_idx ON group_transition (group_name, order_id, id);

-- What operators did, by whom and why; the same table as in the outbox's database, so a group
-- in a database of its own records its own actions.
CREATE TABLE IF NOT EXISTS operator_action (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    acted_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor        text        NOT NULL,
    action       text        NOT NULL,
    reason       text        NOT NULL,
    group_name   text,
    event_id     uuid,
    aggregate_id text,
    detail       jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX IF NOT EXISTS operator_action_aggregate_idx ON operator_action (aggregate_id, id)
    WHERE aggregate_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS operator_action_event_idx ON operator_action (event_id, id)
    WHERE event_id IS NOT NULL;

-- One row per outcome of each event in each group, and each operator action on a group's
-- events, in the order they happened.
CREATE OR REPLACE VIEW group_history AS
SELECT a.group_name, a.event_id, a.order_id, a.sequence, a.event_type,
       a.applied_at AS at, 'applied' AS transition, NULL::text AS detail,
       p.topic, p.partition, p.kafka_offset
FROM applied_effect a
LEFT JOIN processed_message p ON p.group_name = a.group_name AND p.event_id = a.event_id
UNION ALL
SELECT t.group_name, t.event_id, t.order_id, t.sequence, t.event_type,
       t.at, t.transition, t.detail, t.topic, t.partition, t.kafka_offset
FROM group_transition t
UNION ALL
SELECT x.group_name, x.event_id, x.aggregate_id, (x.detail ->> 'sequence')::bigint, NULL,
       x.acted_at, x.action, format('by %s: %s', x.actor, x.reason), NULL, NULL, NULL
FROM operator_action x
WHERE x.group_name IS NOT NULL;

-- A dead letter an operator passed over is `skipped`: its order moved past it and its parked
-- events were applied. `discarded` closes a letter that held nothing back.
ALTER TABLE dead_letter DROP CONSTRAINT IF EXISTS dead_letter_status_check;
ALTER TABLE dead_letter ADD CONSTRAINT dead_letter_status_check
    CHECK (status IN ('open', 'replayed', 'skipped', 'discarded'));
