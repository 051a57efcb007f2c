-- Delayed events (appended with an earliest publish time, kept until due, then moved into the
-- outbox by the active relay) are called "delayed", not "scheduled": that word is kept for
-- recurring schedules. This renames their table, its column, index and constraint names, and
-- the `pipeline trace` transition of an event still waiting, in place: no row is copied, and a
-- database already migrated keeps every waiting event.

DO $$
BEGIN
    IF to_regclass('outbox_scheduled') IS NOT NULL AND to_regclass('outbox_delayed') IS NULL THEN
        ALTER TABLE outbox_scheduled RENAME TO outbox_delayed;
        ALTER TABLE outbox_delayed RENAME COLUMN scheduled_at TO delayed_at;
        ALTER TABLE outbox_delayed RENAME CONSTRAINT outbox_scheduled_pkey TO outbox_delayed_pkey;
        ALTER TABLE outbox_delayed
            RENAME CONSTRAINT outbox_scheduled_business_fact_key TO outbox_delayed_business_fact_key;
        ALTER INDEX outbox_scheduled_due_idx RENAME TO outbox_delayed_due_idx;
        ALTER INDEX outbox_scheduled_aggregate_idx RENAME TO outbox_delayed_aggregate_idx;
    END IF;
END
$$;

-- One row per state change of each outbox event, in the order they happened; an event still
-- waiting for its publish time shows as `delayed` (with no outbox id yet).
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
SELECT NULL, d.event_id, d.aggregate_id, NULL, d.event_type,
       d.delayed_at, 'delayed', format('publish at %s', d.publish_at), NULL, NULL
FROM outbox_delayed d;
