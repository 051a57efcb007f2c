-- The example's own tables: the payments service's payments, and the shipping group's log of
-- what it did (its effects).
CREATE TABLE IF NOT EXISTS payment (
    payment_id   text        PRIMARY KEY,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    status       text        NOT NULL CHECK (status IN ('captured', 'refunded')),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE IF NOT EXISTS shipment_log (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id text   NOT NULL,
    sequence   bigint NOT NULL,
    action     text   NOT NULL CHECK (action IN ('ship', 'cancel'))
);
