-- Rows rewritten on every event (an order's progress per group, stock levels, the per-order
-- sequence counter, order status, reservations) keep free room in their pages, so PostgreSQL can
-- write the new version next to the old one without touching any index (a HOT update) and prune
-- the old one on the page. None of the columns these updates change is indexed. Applies to pages
-- written from now on.
ALTER TABLE order_progress SET (fillfactor = 70);
ALTER TABLE inventory_stock SET (fillfactor = 50);
ALTER TABLE inventory_reservation SET (fillfactor = 80);
ALTER TABLE outbox_sequence SET (fillfactor = 70);
ALTER TABLE orders SET (fillfactor = 80);
ALTER TABLE partition_owner SET (fillfactor = 50);
