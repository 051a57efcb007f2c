-- The export worker's sweep counts the jobs not finished and finds the oldest of them
-- (`export_jobs_waiting`, `export_oldest_waiting_seconds`): an index of those alone, so the
-- count does not read every job ever exported. Idempotent, like the other migrations.
CREATE INDEX IF NOT EXISTS export_job_unfinished ON export_job (created_at)
    WHERE state IN ('pending', 'processing');
