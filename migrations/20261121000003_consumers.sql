-- Consumer-side tables, shared by every consumer group.

-- Exactly-once: a group applies an event only in the transaction that inserts this row.
CREATE TABLE processed_message (
    group_name   text        NOT NULL,
    event_id     uuid        NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    kafka_offset bigint      NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('applied', 'parked', 'stale', 'dead_lettered')),
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, event_id)
);

-- Last sequence applied per order and group: the next event applied must carry last + 1.
CREATE TABLE order_progress (
    group_name    text        NOT NULL,
    order_id      text        NOT NULL,
    last_sequence bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, order_id)
);

-- Events that arrived ahead of their predecessor: recorded, not applied, released in sequence
-- order once the gap closes.
CREATE TABLE parked_event (
    group_name   text        NOT NULL,
    order_id     text        NOT NULL,
    sequence     bigint      NOT NULL,
    event_id     uuid        NOT NULL,
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,
    occurred_at  timestamptz,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    kafka_offset bigint      NOT NULL,
    reason       text        NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, order_id, sequence)
);

-- Messages a group could not apply because the message itself is bad, with the cause.
CREATE TABLE dead_letter (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name   text        NOT NULL,
    event_id     uuid,
    order_id     text,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    kafka_offset bigint      NOT NULL,
    reason       text        NOT NULL,
    key          bytea,
    payload      bytea,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT dead_letter_record_key UNIQUE (group_name, topic, partition, kafka_offset)
);
CREATE INDEX dead_letter_group_idx ON dead_letter (group_name, created_at);

-- History of every effect a group applied. Deliberately without a unique constraint: a broken
-- dedupe shows here as a second row for the same (group, event).
CREATE TABLE applied_effect (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name  text        NOT NULL,
    event_id    uuid        NOT NULL,
    order_id    text        NOT NULL,
    sequence    bigint      NOT NULL,
    event_type  text        NOT NULL,
    occurred_at timestamptz,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX applied_effect_order_idx ON applied_effect (group_name, order_id, id);

-- inventory group
CREATE TABLE inventory_stock (
    product_id text    PRIMARY KEY,
    available  integer NOT NULL CHECK (available >= 0),
    reserved   integer NOT NULL DEFAULT 0 CHECK (reserved >= 0)
);

CREATE TABLE inventory_reservation (
    order_id    text        PRIMARY KEY,
    status      text        NOT NULL CHECK (status IN ('reserved', 'rejected', 'released', 'fulfilled')),
    reason      text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE inventory_reservation_line (
    order_id   text    NOT NULL REFERENCES inventory_reservation (order_id),
    product_id text    NOT NULL,
    quantity   integer NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, product_id)
);

-- notification group
CREATE TABLE notification (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id   uuid        NOT NULL,
    order_id   text        NOT NULL,
    recipient  text        NOT NULL,
    channel    text        NOT NULL,
    template   text        NOT NULL,
    status     text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent', 'failed')),
    attempts   integer     NOT NULL DEFAULT 0,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at    timestamptz
);
CREATE INDEX notification_pending_idx ON notification (id) WHERE status = 'pending';
