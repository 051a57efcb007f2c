-- Whether the active relay waits for a wake-up: a writer's insert NOTIFYs outbox_pending only
-- while one does. NOTIFY takes a database-wide lock from just before its transaction commits
-- until after, so notifying transactions commit one at a time; a relay that is busy claims
-- again at once and needs no wake-up, and says so here (listening = false), so that under load
-- no writer notifies. No row (no relay has said anything yet, or the table was emptied by a
-- crash: it is unlogged, its writes cost no WAL) means notify.
CREATE UNLOGGED TABLE IF NOT EXISTS outbox_relay_wakeup (
    lock_key  bigint      PRIMARY KEY,
    listening boolean     NOT NULL,
    since     timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION outbox_queue_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
    SELECT id, aggregate_id, sequence, created_at FROM inserted_events;
    -- Wake a relay that waits (PostgreSQL folds one transaction's identical notifications).
    IF (SELECT bool_or(listening) FROM outbox_relay_wakeup) IS NOT FALSE THEN
        PERFORM pg_notify('outbox_pending', '');
    END IF;
    RETURN NULL;
END
$$;
