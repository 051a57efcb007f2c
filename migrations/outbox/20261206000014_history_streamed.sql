-- An event a relay streamed from the write-ahead log has no delivery record: it is published once
-- the stream's horizon has passed it (see outbox_status). Its history now says so, with the time
-- it was written (the publish time itself is not recorded) and the horizon that covers it; Kafka's
-- partition and offset are not known.
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
       o.created_at, 'published',
       format('from the write-ahead log, at a time not recorded before the stream''s horizon %s',
              h.horizon),
       NULL, NULL
FROM outbox o
CROSS JOIN (SELECT max(horizon) AS horizon FROM outbox_wal_source) h
WHERE o.created_at < h.horizon
  AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
  AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)
UNION ALL
SELECT o.id, o.event_id, o.aggregate_id, o.sequence, o.event_type,
       x.acted_at, 'requeued', format('by %s: %s', x.actor, x.reason), NULL, NULL
FROM operator_action x JOIN outbox o ON o.event_id = x.event_id
WHERE x.action = 'outbox.requeue'
UNION ALL
SELECT NULL, d.event_id, d.aggregate_id, NULL, d.event_type,
       d.delayed_at, 'delayed', format('publish at %s', d.publish_at), NULL, NULL
FROM outbox_delayed d;
