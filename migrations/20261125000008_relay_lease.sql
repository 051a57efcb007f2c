-- The active relay holds a lease: a row with an epoch that grows on every takeover and an expiry
-- the holder keeps pushing forward. A standby takes the lease over when it has expired (the
-- holder is frozen or cut off from the database) or when the holder's renewing session has
-- ended (the holder died). Every write the relay makes about events (marking them published,
-- recording a failed attempt) takes a share lock on this row and names its epoch, so a relay
-- that lost the lease can change nothing: its writes find no row and are refused.
CREATE TABLE relay_lease (
    lease_key   bigint      PRIMARY KEY,
    epoch       bigint      NOT NULL DEFAULT 0,
    holder      uuid,
    -- pg_backend_pid() of the holder's renewing session.
    holder_pid  integer,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz NOT NULL DEFAULT '-infinity'
);
ALTER TABLE relay_lease SET (fillfactor = 50);
