-- Delayed events are added with the orders that schedule them and removed when they fall due or
-- are cancelled, so the table's end pages empty and fill again all the time. Vacuum leaves those
-- empty pages in place: giving them back takes an ACCESS EXCLUSIVE lock that the writers'
-- inserts and the relay's release would wait behind.
ALTER TABLE outbox_delayed SET (vacuum_truncate = false);
