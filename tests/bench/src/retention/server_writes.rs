//! What the server wrote and read over a segment, per event: WAL (records, whole-page images,
//! bytes), checkpoints (by time and requested) and the buffers they wrote, the buffers the
//! backends had to write themselves, and the database's block reads and row changes. Two
//! segments at the same load differ here by what retention adds: its deletes, the vacuums after
//! them and the pages they bring in from disk.
//!
//! The WAL and checkpoint counters are the server's (every database on it); the benchmark's
//! database is the only busy one while it runs.

use serde::Serialize;
use sqlx::PgPool;

use crate::procstat::round1;

/// The server's cumulative counters at one moment.
#[derive(Debug, Clone, Copy, Default, sqlx::FromRow)]
pub struct Counters {
    wal_records: i64,
    wal_fpi: i64,
    wal_bytes: i64,
    checkpoints_timed: i64,
    checkpoints_req: i64,
    buffers_checkpoint: i64,
    buffers_clean: i64,
    buffers_backend: i64,
    blks_read: i64,
    tup_inserted: i64,
    tup_updated: i64,
    tup_deleted: i64,
}

// `wal_bytes` is numeric; the others are bigint.
const READ_SQL: &str = "/* bench */
SELECT w.wal_records, w.wal_fpi, w.wal_bytes::bigint AS wal_bytes,
       b.checkpoints_timed, b.checkpoints_req, b.buffers_checkpoint, b.buffers_clean,
       b.buffers_backend, d.blks_read, d.tup_inserted, d.tup_updated, d.tup_deleted
FROM pg_stat_wal w, pg_stat_bgwriter b, pg_stat_database d
WHERE d.datname = current_database()";

impl Counters {
    /// Reads them now.
    pub async fn read(pool: &PgPool) -> anyhow::Result<Counters> {
        Ok(sqlx::query_as(READ_SQL).fetch_one(pool).await?)
    }
}

/// The counters' growth over a segment, and per event.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerWrites {
    pub events: u64,
    pub wal_mb: f64,
    pub wal_records: i64,
    pub wal_fpi: i64,
    pub checkpoints_timed: i64,
    pub checkpoints_requested: i64,
    /// 8 kB buffers written by the checkpointer, the background writer and the backends.
    pub buffers_checkpoint: i64,
    pub buffers_clean: i64,
    pub buffers_backend: i64,
    /// Blocks the database read from outside shared buffers (the OS cache or the disk).
    pub blocks_read: i64,
    pub rows_inserted: i64,
    pub rows_updated: i64,
    pub rows_deleted: i64,
    /// WAL bytes per event.
    pub wal_bytes_per_event: f64,
    /// Whole-page images per 1,000 events.
    pub fpi_per_1000_events: f64,
    /// Blocks read per 1,000 events.
    pub blocks_read_per_1000_events: f64,
}

impl ServerWrites {
    /// What grew from `before` to `after`, over `events` events.
    pub fn between(before: &Counters, after: &Counters, events: u64) -> ServerWrites {
        let per = |n: i64, scale: f64| {
            if events == 0 {
                0.0
            } else {
                round1(n as f64 * scale / events as f64)
            }
        };
        let wal_bytes = after.wal_bytes - before.wal_bytes;
        let wal_fpi = after.wal_fpi - before.wal_fpi;
        let blocks_read = after.blks_read - before.blks_read;
        ServerWrites {
            events,
            wal_mb: round1(wal_bytes as f64 / 1e6),
            wal_records: after.wal_records - before.wal_records,
            wal_fpi,
            checkpoints_timed: after.checkpoints_timed - before.checkpoints_timed,
            checkpoints_requested: after.checkpoints_req - before.checkpoints_req,
            buffers_checkpoint: after.buffers_checkpoint - before.buffers_checkpoint,
            buffers_clean: after.buffers_clean - before.buffers_clean,
            buffers_backend: after.buffers_backend - before.buffers_backend,
            blocks_read,
            rows_inserted: after.tup_inserted - before.tup_inserted,
            rows_updated: after.tup_updated - before.tup_updated,
            rows_deleted: after.tup_deleted - before.tup_deleted,
            wal_bytes_per_event: per(wal_bytes, 1.0),
            fpi_per_1000_events: per(wal_fpi, 1000.0),
            blocks_read_per_1000_events: per(blocks_read, 1000.0),
        }
    }

    /// One line, such as `WAL 4260.0 MB (7100 B/event, 243.9 whole pages/1k events), …`.
    pub fn summary(&self) -> String {
        format!(
            "WAL {:.1} MB ({:.0} B/event, {:.1} whole pages/1k events), checkpoints {} timed + {} \
             requested, buffers written by checkpointer/bgwriter/backends {}/{}/{}, blocks read \
             {:.1}/1k events, rows inserted/updated/deleted {}/{}/{}",
            self.wal_mb,
            self.wal_bytes_per_event,
            self.fpi_per_1000_events,
            self.checkpoints_timed,
            self.checkpoints_requested,
            self.buffers_checkpoint,
            self.buffers_clean,
            self.buffers_backend,
            self.blocks_read_per_1000_events,
            self.rows_inserted,
            self.rows_updated,
            self.rows_deleted
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_after_minus_before_and_per_event_scales_it() {
        let before = Counters {
            wal_bytes: 1_000_000,
            wal_fpi: 10,
            blks_read: 5,
            tup_deleted: 7,
            ..Counters::default()
        };
        let after = Counters {
            wal_bytes: 3_000_000,
            wal_fpi: 510,
            blks_read: 1_005,
            tup_deleted: 1_007,
            checkpoints_req: 1,
            ..Counters::default()
        };
        let w = ServerWrites::between(&before, &after, 1_000);
        assert_eq!(w.wal_mb, 2.0);
        assert_eq!(w.wal_bytes_per_event, 2_000.0);
        assert_eq!(w.fpi_per_1000_events, 500.0);
        assert_eq!(w.blocks_read_per_1000_events, 1_000.0);
        assert_eq!(w.rows_deleted, 1_000);
        assert_eq!(w.checkpoints_requested, 1);
        assert_eq!(
            ServerWrites::between(&before, &after, 0).wal_bytes_per_event,
            0.0
        );
    }
}
