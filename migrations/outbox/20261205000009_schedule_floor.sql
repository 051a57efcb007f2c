-- The least time between two occurrences a recurring schedule may have: the deployment's setting,
-- one row, read by every add_schedule (`pipeline schedules add` included), so that no command or
-- caller lifts it for itself. Whoever owns the database changes it, e.g.
--   UPDATE outbox_schedule_floor SET least_gap = interval '10 seconds';
CREATE TABLE IF NOT EXISTS outbox_schedule_floor (
    single    boolean  PRIMARY KEY DEFAULT true CHECK (single),
    least_gap interval NOT NULL DEFAULT interval '1 minute' CHECK (least_gap >= interval '0')
);
INSERT INTO outbox_schedule_floor DEFAULT VALUES ON CONFLICT DO NOTHING;
