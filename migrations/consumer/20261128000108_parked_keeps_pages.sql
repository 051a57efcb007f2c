-- Parked events are removed when the gap before them is filled, an order's whole stretch in one
-- batch. Vacuum leaves the emptied pages in place: giving them back takes an ACCESS EXCLUSIVE
-- lock that every batch, which looks up its orders' parked events, would wait behind.
ALTER TABLE parked_event SET (vacuum_truncate = false);
ALTER TABLE parked_record SET (vacuum_truncate = false);
