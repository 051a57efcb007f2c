-- Rate limits: the limit each group runs with (`--rate-limit GROUP=N/s`), written by every
-- consumer process of the group when it starts, so that `pipeline status` can show it beside the
-- group's lag. A process that runs the group without a limit removes the row. The limit holds
-- per process: every process of a group should run with the same one (the row is the last
-- started's).
CREATE TABLE IF NOT EXISTS group_rate_limit (
    group_name        text             PRIMARY KEY,
    -- As given: `200/s`, `30/min`.
    rate              text             NOT NULL,
    events_per_second double precision NOT NULL CHECK (events_per_second > 0),
    -- The token bucket's size: the most events one batch applies.
    burst             integer          NOT NULL CHECK (burst > 0),
    updated_at        timestamptz      NOT NULL DEFAULT clock_timestamp()
);
