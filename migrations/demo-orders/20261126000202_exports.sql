-- Asynchronous order exports (`POST /exports`): one row per job, written by the order service in
-- the transaction that enqueues its `export.requested` event, then moved along by the `export`
-- consumer group and its worker. Idempotent, like the other migrations.

CREATE TABLE IF NOT EXISTS export_job (
    id             uuid        PRIMARY KEY,
    filters        jsonb       NOT NULL,
    state          text        NOT NULL DEFAULT 'pending'
                   CHECK (state IN ('pending', 'processing', 'succeeded', 'failed', 'expired')),
    file_name      text,
    row_count      bigint,
    checksum       text,       -- sha256 of the file, lowercase hex
    failure_reason text,
    retryable      boolean,
    attempts       integer     NOT NULL DEFAULT 0,
    lease_until    timestamptz,  -- a worker's claim on a processing job
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at     timestamptz,
    finished_at    timestamptz,
    expires_at     timestamptz,
    CONSTRAINT export_job_succeeded_has_file CHECK (
        state <> 'succeeded' OR (file_name IS NOT NULL AND row_count IS NOT NULL AND checksum IS NOT NULL))
);

-- The worker's claim: processing jobs, by lease.
CREATE INDEX IF NOT EXISTS export_job_processing ON export_job (lease_until)
    WHERE state = 'processing';
-- The expiry sweep: finished jobs, by expiry.
CREATE INDEX IF NOT EXISTS export_job_expiring ON export_job (expires_at)
    WHERE state IN ('succeeded', 'failed');
