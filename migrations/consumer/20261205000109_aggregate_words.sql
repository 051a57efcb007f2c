-- The runtime's word for what a group applies in sequence is the outbox's: an aggregate (an
-- order, a payment, an account), not an order. `order_progress` becomes `aggregate_progress` and
-- every `order_id` of the runtime's tables `aggregate_id`. Renames only: no row is read, copied
-- or rewritten, so this takes a moment whatever the tables' size. The partitions of
-- `applied_effect` follow their parent; `applied_effect_before`, while a consumer has not attached
-- it yet, is renamed on its own.

ALTER TABLE order_progress RENAME TO aggregate_progress;
ALTER TABLE aggregate_progress RENAME COLUMN order_id TO aggregate_id;
ALTER TABLE aggregate_progress RENAME CONSTRAINT order_progress_pkey TO aggregate_progress_pkey;

ALTER TABLE parked_event RENAME COLUMN order_id TO aggregate_id;
ALTER INDEX parked_event_order_idx RENAME TO parked_event_aggregate_idx;
ALTER TABLE parked_record RENAME COLUMN order_id TO aggregate_id;

ALTER TABLE dead_letter RENAME COLUMN order_id TO aggregate_id;

ALTER TABLE group_transition RENAME COLUMN order_id TO aggregate_id;
ALTER INDEX group_transition_order_idx RENAME TO group_transition_aggregate_idx;

ALTER TABLE applied_effect RENAME COLUMN order_id TO aggregate_id;
ALTER INDEX applied_effect_order_idx RENAME TO applied_effect_aggregate_idx;
ALTER TABLE applied_effect_held RENAME COLUMN order_id TO aggregate_id;
ALTER INDEX applied_effect_held_order_idx RENAME TO applied_effect_held_aggregate_idx;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = current_schema() AND table_name = 'applied_effect_before'
                     AND column_name = 'order_id') THEN
        ALTER TABLE applied_effect_before RENAME COLUMN order_id TO aggregate_id;
    END IF;
END
$$;
ALTER INDEX IF EXISTS applied_effect_before_order_idx RENAME TO applied_effect_before_aggregate_idx;

ALTER VIEW group_history RENAME COLUMN order_id TO aggregate_id;

-- Retention's state of the table, under its new name: its pass goes on where it was.
UPDATE retention_state SET table_name = 'aggregate_progress' WHERE table_name = 'order_progress';
