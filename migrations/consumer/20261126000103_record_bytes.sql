-- A dead letter keeps its record's bytes exactly: the key and payload (bytea already) and now
-- every header in order, duplicates and all, as two arrays of equal length (a value NULL for a
-- header without one). `headers` keeps the readable form: the first value of each name, escaped
-- (no NUL, no invalid UTF-8). Text columns hold only text made from the record that PostgreSQL
-- takes: `order_id` is the event's order, or the record's key when that is UTF-8 without NUL and
-- no longer than an order id may be (an index entry must fit).
ALTER TABLE dead_letter ADD COLUMN IF NOT EXISTS header_names bytea[];
ALTER TABLE dead_letter ADD COLUMN IF NOT EXISTS header_values bytea[];

-- Letters written before this file named an unreadable record's order only by its key.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT id, key FROM dead_letter WHERE order_id IS NULL AND key IS NOT NULL LOOP
        BEGIN
            UPDATE dead_letter SET order_id = convert_from(r.key, 'UTF8') WHERE id = r.id;
        EXCEPTION WHEN OTHERS THEN
            NULL; -- not text: the letter has no order
        END;
    END LOOP;
END $$;

-- `pipeline trace` finds a letter without an order by its key's bytes. A hash index: a key may be
-- far longer than a B-tree entry can be.
CREATE INDEX IF NOT EXISTS dead_letter_key_idx ON dead_letter USING hash (key)
    WHERE order_id IS NULL;

-- A parked event's record as it arrived (payload and headers exactly), beside it rather than in
-- it, so parked_event's rows and plans stay as they were: a dead letter raised when the event is
-- released (its handler rejects it) holds the record's bytes.
CREATE TABLE IF NOT EXISTS parked_record (
    group_name    text    NOT NULL,
    order_id      text    NOT NULL,
    sequence      bigint  NOT NULL,
    payload       bytea,
    header_names  bytea[] NOT NULL,
    header_values bytea[] NOT NULL,
    PRIMARY KEY (group_name, order_id, sequence)
);
