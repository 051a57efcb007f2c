-- The effect history (`applied_effect`) in time partitions: range partitions of `applied_at`,
-- created ahead by the consumers and detached and dropped whole by retention once every row in
-- them is older than the history window, instead of deleted row by row (see the README's
-- "Retention"). A partition's rows that must outlive it (the history of an order with an open
-- dead letter or parked events) are copied into `applied_effect_held` first.
--
-- The table as it was becomes the partition of everything before this migration,
-- `applied_effect_before`. Nothing here reads or copies its rows, so a database in use takes
-- this in a moment whatever the history's size: the table is renamed and given a CHECK
-- constraint that is not validated yet; a consumer validates it (reading the table, without
-- blocking anyone) and attaches it as a partition, which PostgreSQL then does without reading
-- the table again. Until then the rows are in it but not in `applied_effect`; an empty table is
-- attached here and now.

ALTER TABLE applied_effect RENAME TO applied_effect_before;
ALTER TABLE applied_effect_before RENAME CONSTRAINT applied_effect_pkey TO applied_effect_before_pkey;
ALTER INDEX applied_effect_order_idx RENAME TO applied_effect_before_order_idx;

-- No unique key: a broken dedupe would show here as a second row for the same (group, event),
-- as before. `id` stays the order of application (an identity on the partitioned table).
CREATE TABLE applied_effect (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    group_name  text        NOT NULL,
    event_id    uuid        NOT NULL,
    order_id    text        NOT NULL,
    sequence    bigint      NOT NULL,
    event_type  text        NOT NULL,
    occurred_at timestamptz,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY RANGE (applied_at);
CREATE INDEX applied_effect_order_idx ON applied_effect (group_name, order_id, id);
-- Lookups by id (the newest effects, those after a given one), as the old primary key served
-- them; a key of a partitioned table must hold the partition key, so this one is not unique.
CREATE INDEX applied_effect_id_idx ON applied_effect (id);
-- Partitions are dropped, never vacuumed of removed rows: the settings the table had for
-- batched deletes do not apply.

-- Rows kept past their partition: copied in before the partition is dropped, removed by
-- retention's batched steps once their order has no open dead letter or parked events and they
-- are older than the window.
CREATE TABLE applied_effect_held (
    id          bigint      PRIMARY KEY,
    group_name  text        NOT NULL,
    event_id    uuid        NOT NULL,
    order_id    text        NOT NULL,
    sequence    bigint      NOT NULL,
    event_type  text        NOT NULL,
    occurred_at timestamptz,
    applied_at  timestamptz NOT NULL
);
CREATE INDEX applied_effect_held_order_idx ON applied_effect_held (group_name, order_id, id);

DO $$
DECLARE
    -- Every row of the old table was written before this: the rename above waited for the
    -- transactions writing it, and `applied_at` is their clock.
    bound   timestamptz := clock_timestamp();
    next_id bigint;
BEGIN
    SELECT COALESCE(max(id), 0) + 1 INTO next_id FROM applied_effect_before;
    EXECUTE format('ALTER TABLE applied_effect ALTER COLUMN id RESTART WITH %s', next_id);
    ALTER TABLE applied_effect_before ALTER COLUMN id DROP IDENTITY;
    EXECUTE format('ALTER TABLE applied_effect_before ADD CONSTRAINT applied_effect_before_bound
                    CHECK (applied_at < %L) NOT VALID', bound);
    IF NOT EXISTS (SELECT 1 FROM applied_effect_before) THEN
        ALTER TABLE applied_effect_before VALIDATE CONSTRAINT applied_effect_before_bound;
        EXECUTE format('ALTER TABLE applied_effect ATTACH PARTITION applied_effect_before
                        FOR VALUES FROM (MINVALUE) TO (%L)', bound);
    END IF;
    -- The first minute after it. The consumers create the next partitions, ahead of time, at
    -- start and every half minute (and at once when a batch finds none for its rows).
    EXECUTE format('CREATE TABLE applied_effect_p%s PARTITION OF applied_effect
                    FOR VALUES FROM (%L) TO (%L)',
                   to_char(bound AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS'),
                   bound, bound + interval '1 minute');
END
$$;

-- The history view reads the held rows beside the partitions.
CREATE OR REPLACE VIEW group_history AS
SELECT a.group_name, a.event_id, a.order_id, a.sequence, a.event_type,
       a.applied_at AS at, 'applied' AS transition, NULL::text AS detail,
       p.topic, p.partition, p.kafka_offset
FROM (SELECT group_name, event_id, order_id, sequence, event_type, applied_at FROM applied_effect
      UNION ALL
      SELECT group_name, event_id, order_id, sequence, event_type, applied_at
      FROM applied_effect_held) a
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
