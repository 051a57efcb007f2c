-- Failure handling: dead-letter lifecycle and partition ownership fencing.

ALTER TABLE dead_letter
    ADD COLUMN sequence         bigint,
    ADD COLUMN event_type       text,
    ADD COLUMN attempts         integer     NOT NULL DEFAULT 1,
    ADD COLUMN first_failure_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ADD COLUMN last_failure_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    ADD COLUMN status           text        NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'replayed', 'discarded')),
    ADD COLUMN resolved_at      timestamptz,
    ADD COLUMN resolution       text;

CREATE INDEX dead_letter_open_idx ON dead_letter (group_name, order_id) WHERE status = 'open';

-- Which consumer currently owns a partition for a group. A new owner replaces the token when the
-- partition is assigned to it; a batch transaction first checks, with a share lock, that its
-- token is still the owner's, so a consumer that lost its partitions (a paused "zombie") can
-- apply nothing afterwards, and the new owner's takeover waits for its in-flight transaction.
CREATE TABLE partition_owner (
    group_name  text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    owner       uuid        NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, topic, partition)
);
