-- The outbox's inserts as a publication, for the relay that reads them from the write-ahead log
-- (a logical replication slot of its own streams them; `wal_level = logical`). Inserts only:
-- retention's deletes are not published, and the table needs no replica identity for them. A
-- publication no slot reads costs nothing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_events') THEN
        CREATE PUBLICATION outbox_events FOR TABLE outbox WITH (publish = 'insert');
    END IF;
END
$$;
