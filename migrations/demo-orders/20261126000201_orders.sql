-- The demonstration order service's own tables (not the pipeline's): its catalogue, orders and
-- order lines. Idempotent, like the pipeline's migrations.

CREATE TABLE IF NOT EXISTS product (
    product_id  text   PRIMARY KEY,
    name        text   NOT NULL,
    price_cents bigint NOT NULL CHECK (price_cents >= 0)
);

CREATE TABLE IF NOT EXISTS orders (
    order_id        uuid        PRIMARY KEY,
    customer_id     text        NOT NULL,
    email           text,
    status          text        NOT NULL CHECK (status IN ('placed', 'paid', 'cancelled', 'shipped')),
    idempotency_key text,
    request_hash    text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT orders_idempotency_key UNIQUE (idempotency_key)
);
-- Its status is rewritten on every change: free room in its pages keeps those updates HOT.
ALTER TABLE orders SET (fillfactor = 80);

CREATE TABLE IF NOT EXISTS order_line (
    order_id   uuid    NOT NULL REFERENCES orders (order_id),
    line_no    integer NOT NULL,
    product_id text    NOT NULL REFERENCES product (product_id),
    quantity   integer NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, line_no)
);
