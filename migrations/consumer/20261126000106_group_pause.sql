-- Paused groups: a row per group an operator paused (`pipeline group pause GROUP --note WHY`),
-- removed when it is resumed. Every consumer process running the group reads its row every second:
-- while it exists, the group's members fetch nothing from Kafka and start no new batch, keeping
-- their partitions (see consumer/src/pause.rs). Who paused it and why is also in operator_action,
-- written in the same transaction; so is each resume.
CREATE TABLE IF NOT EXISTS group_pause (
    group_name text        PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor      text        NOT NULL,
    -- The operator's --note.
    note       text        NOT NULL
);
