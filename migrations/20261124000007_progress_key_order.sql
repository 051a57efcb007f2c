-- order_progress is read as "these orders of this group" (group = $1 AND order = ANY($2)). With
-- the group first in the primary key, a prepared statement's cached generic plan made while the
-- table was small read the group's every row and filtered them (seen: the consumer's opening
-- statement at 279 ms on average once batches grew past a hundred events at 4,000 events/s, as
-- the table grew). With the order first, each order is one index lookup whatever the table's
-- size when the plan was made. Upserts name the same columns, so nothing else changes.
ALTER TABLE order_progress
    DROP CONSTRAINT order_progress_pkey,
    ADD PRIMARY KEY (order_id, group_name);

-- The same question of parked events ("does any of these orders of this group have one?"),
-- asked by every batch: an index with the order first answers it by lookups too.
CREATE INDEX parked_event_order_idx ON parked_event (order_id, group_name);
