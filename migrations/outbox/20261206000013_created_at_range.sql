-- An event's `created_at` travels as the envelope's `occurred_at`, which the relay and the
-- consumers read as a time between the years 1 and 9999. A writer that sets the column itself
-- ('infinity', or a year past that range) would write an event no relay could publish: the
-- relay would stop at that row. Such a write is refused instead, naming this constraint.
-- NOT VALID: rows already written are not scanned (which would hold the table's lock for the
-- whole scan); every row written from now on is checked.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conname = 'outbox_created_at_range' AND conrelid = 'outbox'::regclass) THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_created_at_range
            CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at < '10000-01-01 00:00:00+00')
            NOT VALID;
    END IF;
END
$$;
