-- A delivery record holds the offset Kafka gave the event, or NULL when Kafka confirmed the write
-- without one: the idempotent producer reports "offset unknown" (librdkafka's -1001) for a
-- message the broker had already written, say a retry answered as a duplicate after a leader
-- change. The partition is always known. Records made before this migration with that sentinel
-- say so now.
ALTER TABLE outbox_delivery ALTER COLUMN kafka_offset DROP NOT NULL;
UPDATE outbox_delivery SET kafka_offset = NULL WHERE kafka_offset < 0;
ALTER TABLE outbox_delivery DROP CONSTRAINT IF EXISTS outbox_delivery_offset_known;
ALTER TABLE outbox_delivery ADD CONSTRAINT outbox_delivery_offset_known
    CHECK (kafka_offset >= 0) NOT VALID;
