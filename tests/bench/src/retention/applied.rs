//! End-to-end latency while retention removes old rows: the effects each group applied are read
//! every few seconds as they commit (long before retention could remove them), and matched
//! afterwards with the times the driver meant to send their requests, as the latency phase
//! does at the end of its run.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use pipeline_load::figures::{micros_histogram, quantile_ms};
use serde::Serialize;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::driver::SentEvent;

const POLL_EVERY: Duration = Duration::from_secs(5);

/// One applied effect: its order, sequence, outbox and applied times (µs since the epoch).
#[derive(Debug, Clone, Copy)]
struct Applied {
    order_id: Uuid,
    sequence: i64,
    created_us: Option<i64>,
    applied_us: i64,
}

/// Effects read so far, by group kind, and the relay's share (outbox row → published).
#[derive(Default)]
struct Collected {
    by_group: BTreeMap<String, Vec<Applied>>,
    relay: Option<Histogram<u64>>,
    /// Effects whose outbox row was gone when read.
    without_outbox_row: u64,
}

/// Latencies of one group over a segment, ms.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentLatency {
    /// Measured events the group applied, and those it did not (or not while watched).
    pub events: u64,
    pub missing: u64,
    /// Intended send → applied by the group.
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub e2e_p999_ms: f64,
    pub e2e_max_ms: f64,
    /// Outbox row written → applied.
    pub outbox_to_applied_p50_ms: f64,
    pub outbox_to_applied_p99_ms: f64,
}

/// Every group's latencies (by kind), and the relay's (outbox row written → published, every event).
#[derive(Debug, Clone, Serialize)]
pub struct Latencies {
    pub groups: BTreeMap<String, SegmentLatency>,
    /// Intended send → applied, both groups, by the minute of the segment the request was due.
    pub by_minute: Vec<MinuteLatency>,
    pub relay_p50_ms: f64,
    pub relay_p99_ms: f64,
    pub without_outbox_row: u64,
}

/// One minute's end-to-end latency, ms.
#[derive(Debug, Clone, Serialize)]
pub struct MinuteLatency {
    /// Minutes from the first measured request.
    pub minute: u64,
    /// Effects applied (two groups: two an event).
    pub effects: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// A running reader of new effects.
pub struct AppliedWatch {
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<Collected>>,
    pool: PgPool,
}

type Row = (
    i64,
    String,
    String,
    i64,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
);

impl AppliedWatch {
    /// Starts reading the effects `groups` ((kind, group id) pairs) apply from now on.
    pub async fn start(
        pool: &PgPool,
        groups: Vec<(String, String)>,
    ) -> anyhow::Result<AppliedWatch> {
        let from: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM applied_effect")
            .fetch_one(pool)
            .await?;
        let stop = CancellationToken::new();
        let (token, reader) = (stop.clone(), pool.clone());
        let task = tokio::spawn(async move {
            let mut cursor = Cursor::new(from);
            let mut collected = Collected::default();
            let mut tick = tokio::time::interval(POLL_EVERY);
            loop {
                let last = tokio::select! {
                    () = token.cancelled() => true,
                    _ = tick.tick() => false,
                };
                cursor.poll(&reader, &groups, &mut collected).await?;
                if last {
                    return Ok(collected);
                }
            }
        });
        Ok(AppliedWatch {
            stop,
            task,
            pool: pool.clone(),
        })
    }

    /// Reads what is left and matches the effects with `measured`; `offset_us` is the database
    /// clock minus the local one.
    pub async fn finish(self, measured: &[SentEvent], offset_us: i64) -> anyhow::Result<Latencies> {
        self.stop.cancel();
        let collected = self.task.await??;
        drop(self.pool);
        let intended: HashMap<(Uuid, i64), i64> = measured
            .iter()
            .map(|e| ((e.order_id, e.sequence), e.intended_us + offset_us))
            .collect();
        let groups = collected
            .by_group
            .iter()
            .map(|(group, applied)| (group.clone(), latency(applied, &intended)))
            .collect();
        let by_minute = by_minute(&collected, &intended);
        let relay = collected.relay.unwrap_or_else(micros_histogram);
        Ok(Latencies {
            groups,
            by_minute,
            relay_p50_ms: quantile_ms(&relay, 0.5),
            relay_p99_ms: quantile_ms(&relay, 0.99),
            without_outbox_row: collected.without_outbox_row,
        })
    }
}

fn latency(applied: &[Applied], intended: &HashMap<(Uuid, i64), i64>) -> SegmentLatency {
    let (mut e2e, mut to_applied) = (micros_histogram(), micros_histogram());
    let mut seen: HashSet<(Uuid, i64)> = HashSet::new();
    for a in applied {
        let key = (a.order_id, a.sequence);
        let Some(&due) = intended.get(&key) else {
            continue;
        };
        if !seen.insert(key) {
            continue;
        }
        e2e.saturating_record(u64::try_from(a.applied_us - due).unwrap_or(0));
        if let Some(created) = a.created_us {
            to_applied.saturating_record(u64::try_from(a.applied_us - created).unwrap_or(0));
        }
    }
    SegmentLatency {
        events: seen.len() as u64,
        missing: (intended.len() - seen.len()) as u64,
        e2e_p50_ms: quantile_ms(&e2e, 0.5),
        e2e_p99_ms: quantile_ms(&e2e, 0.99),
        e2e_p999_ms: quantile_ms(&e2e, 0.999),
        e2e_max_ms: quantile_ms(&e2e, 1.0),
        outbox_to_applied_p50_ms: quantile_ms(&to_applied, 0.5),
        outbox_to_applied_p99_ms: quantile_ms(&to_applied, 0.99),
    }
}

/// End-to-end latency of every group's effects by the minute their request was due.
fn by_minute(collected: &Collected, intended: &HashMap<(Uuid, i64), i64>) -> Vec<MinuteLatency> {
    let Some(&first) = intended.values().min() else {
        return Vec::new();
    };
    let mut minutes: BTreeMap<u64, Histogram<u64>> = BTreeMap::new();
    for applied in collected.by_group.values() {
        let mut seen: HashSet<(Uuid, i64)> = HashSet::new();
        for a in applied {
            let key = (a.order_id, a.sequence);
            let Some(&due) = intended.get(&key) else {
                continue;
            };
            if !seen.insert(key) {
                continue;
            }
            let minute = u64::try_from((due - first) / 60_000_000).unwrap_or(0);
            minutes
                .entry(minute)
                .or_insert_with(micros_histogram)
                .saturating_record(u64::try_from(a.applied_us - due).unwrap_or(0));
        }
    }
    minutes
        .into_iter()
        .map(|(minute, h)| MinuteLatency {
            minute,
            effects: h.len(),
            p50_ms: quantile_ms(&h, 0.5),
            p99_ms: quantile_ms(&h, 0.99),
            max_ms: quantile_ms(&h, 1.0),
        })
        .collect()
}

/// Where the reading stands. Effects are numbered when inserted but may commit out of that
/// order, so each read starts below the highest id seen, at the highest id seen two reads ago
/// (seconds before: far longer than a batch transaction lasts), and skips the ids it has.
struct Cursor {
    /// Read ids above this.
    from: i64,
    /// The highest id seen by the last read and by this one.
    highest: [i64; 2],
    /// Ids above `from` already read.
    seen: HashSet<i64>,
}

impl Cursor {
    fn new(from: i64) -> Cursor {
        Cursor {
            from,
            highest: [from, from],
            seen: HashSet::new(),
        }
    }

    async fn poll(
        &mut self,
        pool: &PgPool,
        groups: &[(String, String)],
        into: &mut Collected,
    ) -> anyhow::Result<()> {
        // Planned with the value: a generic plan would not know the range is the table's tail.
        let rows: Vec<Row> = sqlx::query_as(
            "/* bench */ SELECT a.id, a.group_name, a.aggregate_id, a.sequence, o.created_at,
                    d.published_at, a.applied_at
             FROM applied_effect a
             LEFT JOIN outbox o ON o.event_id = a.event_id
             LEFT JOIN outbox_delivery d ON d.id = o.id
             WHERE a.id > $1 AND a.group_name = ANY($2)",
        )
        .persistent(false)
        .bind(self.from)
        .bind(groups.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
        let mut highest = self.highest[1];
        let relay = into.relay.get_or_insert_with(micros_histogram);
        for (id, group, order_id, sequence, created, published, applied) in rows {
            highest = highest.max(id);
            if !self.seen.insert(id) {
                continue;
            }
            let Ok(order_id) = Uuid::parse_str(&order_id) else {
                continue;
            };
            let created_us = created.map(|c| c.timestamp_micros());
            if created_us.is_none() {
                into.without_outbox_row += 1;
            }
            let Some(index) = groups.iter().position(|(_, id)| *id == group) else {
                continue;
            };
            // Each event once: the first group's row carries its publish.
            if let (Some(c), Some(p), 0) = (created_us, published, index) {
                relay.saturating_record(u64::try_from(p.timestamp_micros() - c).unwrap_or(0));
            }
            let kind = groups[index].0.clone();
            into.by_group.entry(kind).or_default().push(Applied {
                order_id,
                sequence,
                created_us,
                applied_us: applied.timestamp_micros(),
            });
        }
        self.from = self.highest[0];
        self.highest = [self.highest[1], highest];
        let from = self.from;
        self.seen.retain(|&id| id > from);
        Ok(())
    }
}
