-- The demonstration consumer groups' own effect tables (not the pipeline's): inventory's stock
-- and reservations, notification's outbox of messages to send. Idempotent, like the pipeline's
-- migrations.

CREATE TABLE IF NOT EXISTS inventory_stock (
    product_id text    PRIMARY KEY,
    available  integer NOT NULL CHECK (available >= 0),
    reserved   integer NOT NULL DEFAULT 0 CHECK (reserved >= 0)
);
ALTER TABLE inventory_stock SET (fillfactor = 50);

CREATE TABLE IF NOT EXISTS inventory_reservation (
    order_id    text        PRIMARY KEY,
    status      text        NOT NULL CHECK (status IN ('reserved', 'rejected', 'released', 'fulfilled')),
    reason      text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
ALTER TABLE inventory_reservation SET (fillfactor = 80);

CREATE TABLE IF NOT EXISTS inventory_reservation_line (
    order_id   text    NOT NULL REFERENCES inventory_reservation (order_id),
    product_id text    NOT NULL,
    quantity   integer NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, product_id)
);

-- Notifications recorded in the event's transaction, sent after commit by the dispatcher. A
-- claim pushes next_attempt_at forward (a short lease on the row), the send happens outside any
-- transaction, and the outcome sets the next attempt (exponential backoff) or settles the row.
CREATE TABLE IF NOT EXISTS notification (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL,
    order_id        text        NOT NULL,
    recipient       text        NOT NULL,
    channel         text        NOT NULL,
    template        text        NOT NULL,
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at         timestamptz,
    next_attempt_at timestamptz NOT NULL DEFAULT '-infinity'
);
ALTER TABLE notification ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz NOT NULL DEFAULT '-infinity';
DROP INDEX IF EXISTS notification_pending_idx;
CREATE INDEX IF NOT EXISTS notification_due_idx ON notification (next_attempt_at, id) WHERE status = 'pending';
