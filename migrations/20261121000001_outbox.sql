-- The transactional outbox: one row per event, written in the same transaction as the business
-- change it describes, published to Kafka by the relay.

-- Per-aggregate event sequence. The row is locked by the transaction that appends an event, so
-- events of one aggregate commit in sequence order.
CREATE TABLE outbox_sequence (
    aggregate_id  text   PRIMARY KEY,
    last_sequence bigint NOT NULL
);

CREATE TABLE outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL,
    business_key    text        NOT NULL,
    event_type      text        NOT NULL,
    aggregate_id    text        NOT NULL,
    sequence        bigint      NOT NULL CHECK (sequence > 0),
    topic           text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state           text        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'published', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_attempt_at timestamptz,
    last_error      text,
    kafka_partition integer,
    kafka_offset    bigint,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at    timestamptz,
    CONSTRAINT outbox_event_id_key UNIQUE (event_id),
    CONSTRAINT outbox_business_fact_key UNIQUE (business_key, event_type),
    CONSTRAINT outbox_aggregate_sequence_key UNIQUE (aggregate_id, sequence)
);

-- The relay's claim reads pending rows in id order: a partial index holds only those, so the scan
-- stays small however many published rows the table keeps.
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE state = 'pending';

-- "Is an earlier event of this aggregate failed or waiting for a retry?" Only rows that failed an
-- attempt can be, so the index holds just those: it stays tiny however large the backlog.
CREATE INDEX outbox_retrying_by_aggregate_idx ON outbox (aggregate_id, sequence)
    WHERE state <> 'published' AND attempts > 0;
