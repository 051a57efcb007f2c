//! `pipeline status`: the outbox's queue, the relay lease, and each group's state (paused or
//! running), lag, rate limit, dead letters and parked orders. Every count stops at [`CAP`] and
//! every read uses an index, so the command costs the same on a database of a thousand events and
//! one of a billion.

use std::time::Duration;

use consumer::operator::read_group;
use pipeline_core::kafka::offsets_reader;
use rdkafka::consumer::BaseConsumer;
use serde::Serialize;

use crate::group::{self, PausedSince};
use crate::output::{age, capped, cell, table};
use crate::targets::{KnownBy, Targets};

/// Counts stop here: beyond it, the figure shows as `≥CAP`.
pub const CAP: i64 = 100_000;

/// The outbox's queue.
#[derive(Debug, Serialize)]
pub struct OutboxQueue {
    /// Events waiting for their first publish attempt (up to [`CAP`]).
    pub pending: i64,
    /// Events that failed an attempt and wait for the next one (up to [`CAP`]).
    pub retrying: i64,
    /// Events that failed for good and hold their orders' later events (up to [`CAP`]).
    pub failed: i64,
    /// Age of the oldest event not yet published, in seconds.
    pub oldest_unpublished_seconds: Option<f64>,
    /// Delayed events waiting for their publish time or, due, for the relay to move them (up
    /// to [`CAP`]).
    pub delayed: i64,
    /// Of those, the ones already due (up to [`CAP`]).
    pub delayed_due: i64,
    /// Seconds until the next delayed event falls due (negative: overdue since).
    pub next_delayed_in_seconds: Option<f64>,
}

/// The relay lease: who publishes.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct RelayLease {
    /// The lease's key (one lease per outbox).
    pub lease_key: i64,
    /// Grows on every takeover.
    pub epoch: i64,
    /// The holder's id, if any.
    pub holder: Option<uuid::Uuid>,
    /// The holder's renewing session.
    pub holder_pid: Option<i32>,
    /// True while the lease is unexpired.
    pub held: bool,
    /// True while the holder's renewing session exists.
    pub holder_connected: bool,
    /// Seconds since the last renewal.
    pub renewed_seconds_ago: Option<f64>,
}

/// A relay that streams (or streamed) the outbox from the write-ahead log (`--source wal`).
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct WalStream {
    /// The relay lease's key.
    pub lease_key: i64,
    /// Its replication slot.
    pub slot: String,
    /// True while writers queue nothing because the relay streams; false once it fell back to
    /// the queue.
    pub streaming: bool,
    /// Whether the slot exists.
    pub slot_exists: bool,
    /// Whether a session streams from it now.
    pub slot_active: bool,
    /// PostgreSQL's `wal_status` of the slot: `reserved`, `extended`, `unreserved` (at risk)
    /// or `lost`.
    pub wal_status: Option<String>,
    /// Write-ahead log past the slot's confirmed position, in bytes: what the relay has not
    /// yet confirmed (Kafka's acknowledgement comes first).
    pub lag_bytes: Option<i64>,
    /// Write-ahead log the slot keeps on the server's disk, in bytes.
    pub retained_bytes: Option<i64>,
    /// Events past the horizon, neither queued nor delivered (up to [`CAP`]): those not yet
    /// published, and the last second or so of published ones the horizon has not reached.
    pub past_horizon: i64,
    /// How far the horizon trails the database clock, in seconds: every event created before
    /// it is published.
    pub horizon_seconds: f64,
}

/// One group.
#[derive(Debug, Serialize)]
pub struct GroupStatus {
    /// The group's name (without the prefix).
    pub group: String,
    /// `paused` (by an operator: `pipeline group pause`) or `running`.
    pub state: &'static str,
    /// While paused: since when, by whom and why.
    pub paused: Option<PausedSince>,
    /// Members in the Kafka group, when Kafka answered.
    pub members: Option<usize>,
    /// Messages between the committed and end offsets, over partitions with a commit.
    pub lag_messages: Option<i64>,
    /// Age of the oldest unprocessed event over the group's partitions, in seconds.
    pub lag_seconds: Option<f64>,
    /// Partitions holding data where the group has not committed yet.
    pub uncommitted_partitions: Option<usize>,
    /// The group's rate limit per consumer process (`200/s`, `30/min`), as its last started
    /// process recorded it; `None`: not limited.
    pub rate_limit: Option<String>,
    /// The same limit in events per second.
    pub rate_limit_events_per_second: Option<f64>,
    /// Open dead letters (up to [`CAP`]).
    pub dead_letters_open: i64,
    /// Orders with parked events (up to [`CAP`] parked events read).
    pub orders_parked: i64,
    /// What the task beside the group has waiting, where the program registers a read of it
    /// ([`consumer::Groups::waiting`]): the demonstration's export jobs, say.
    pub waiting: Option<consumer::Waiting>,
    /// Why that read failed, if it did.
    pub waiting_error: Option<String>,
    /// Why Kafka's figures are missing, if they are.
    pub kafka_error: Option<String>,
    /// Each partition of the group's topics, when Kafka answered.
    pub partitions: Vec<PartitionStatus>,
}

/// One partition of a group's topics.
#[derive(Debug, Serialize)]
pub struct PartitionStatus {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The group's committed offset; `None` when it never committed here.
    pub committed: Option<i64>,
    /// The partition's end offset.
    pub end: i64,
    /// Messages between the committed and end offsets.
    pub lag_messages: Option<i64>,
    /// Age of the partition's oldest unprocessed event, in seconds (0 when it has none).
    pub lag_seconds: Option<f64>,
}

/// The whole screen.
#[derive(Debug, Serialize)]
pub struct Status {
    /// The outbox's queue.
    pub outbox: OutboxQueue,
    /// The relay lease(s).
    pub relay: Vec<RelayLease>,
    /// Relays that stream the outbox from the write-ahead log, or did.
    pub stream: Vec<WalStream>,
    /// Each group.
    pub groups: Vec<GroupStatus>,
}

/// Reads the status.
pub async fn read(targets: &Targets) -> anyhow::Result<Status> {
    // Names first: a group nothing knows is reported whatever else answers.
    let group_names = targets.groups(KnownBy::DatabaseOrKafka).await?;
    let outbox = targets.outbox().await?;
    let (pending_all, retrying, failed, oldest): (i64, i64, i64, Option<f64>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox_unpublished
                                       WHERE state = 'pending' LIMIT $1) x),
                (SELECT count(*) FROM (SELECT 1 FROM outbox_unpublished
                                       WHERE state = 'pending' AND attempts > 0 LIMIT $1) x),
                (SELECT count(*) FROM (SELECT 1 FROM outbox_unpublished
                                       WHERE state = 'failed' AND attempts > 0 LIMIT $1) x),
                (SELECT EXTRACT(EPOCH FROM clock_timestamp() - created_at)::float8
                 FROM outbox_unpublished ORDER BY id LIMIT 1)",
    )
    .bind(CAP)
    .fetch_one(&outbox)
    .await?;
    let (delayed, delayed_due, next_delayed): (i64, i64, Option<f64>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox_delayed LIMIT $1) x),
                (SELECT count(*) FROM (SELECT 1 FROM outbox_delayed
                                       WHERE publish_at <= clock_timestamp() LIMIT $1) x),
                (SELECT EXTRACT(EPOCH FROM publish_at - clock_timestamp())::float8
                 FROM outbox_delayed ORDER BY publish_at LIMIT 1)",
    )
    .bind(CAP)
    .fetch_one(&outbox)
    .await?;
    let relay: Vec<RelayLease> = sqlx::query_as(
        "SELECT lease_key, epoch, holder, holder_pid, expires_at > clock_timestamp() AS held,
                EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.holder_pid) AS holder_connected,
                EXTRACT(EPOCH FROM clock_timestamp() - renewed_at)::float8 AS renewed_seconds_ago
         FROM relay_lease l ORDER BY lease_key",
    )
    .fetch_all(&outbox)
    .await?;
    // A database whose outbox migrations predate the write-ahead log's relay has no stream.
    let streams: bool = sqlx::query_scalar("SELECT to_regclass('outbox_wal_source') IS NOT NULL")
        .fetch_one(&outbox)
        .await?;
    let stream: Vec<WalStream> = if !streams {
        Vec::new()
    } else {
        sqlx::query_as(
        "SELECT w.lock_key AS lease_key, w.slot, w.streaming, r.slot_name IS NOT NULL AS slot_exists,
                COALESCE(r.active, false) AS slot_active, r.wal_status::text AS wal_status,
                (pg_current_wal_lsn() - r.confirmed_flush_lsn)::bigint AS lag_bytes,
                (pg_current_wal_lsn() - r.restart_lsn)::bigint AS retained_bytes,
                (SELECT count(*) FROM (SELECT 1 FROM outbox o
                                       WHERE w.streaming AND o.id > w.horizon_id
                                         AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.id = o.id)
                                         AND NOT EXISTS (SELECT 1 FROM outbox_unpublished u WHERE u.id = o.id)
                                       LIMIT $1) x) AS past_horizon,
                EXTRACT(EPOCH FROM clock_timestamp() - w.horizon)::float8 AS horizon_seconds
         FROM outbox_wal_source w
         LEFT JOIN pg_replication_slots r ON r.slot_name = w.slot
         ORDER BY w.lock_key",
    )
    .bind(CAP)
    .fetch_all(&outbox)
    .await?
    };
    let mut groups = Vec::new();
    for group in group_names {
        groups.push(group_status(targets, &group).await?);
    }
    Ok(Status {
        outbox: OutboxQueue {
            pending: (pending_all - retrying).max(0),
            retrying,
            failed,
            oldest_unpublished_seconds: oldest,
            delayed,
            delayed_due,
            next_delayed_in_seconds: next_delayed,
        },
        relay,
        stream,
        groups,
    })
}

/// A size in bytes, in the unit that suits it.
fn bytes(n: i64) -> String {
    let n = n.max(0) as f64;
    if n >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} GiB", n / (1024.0 * 1024.0 * 1024.0))
    } else if n >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", n / (1024.0 * 1024.0))
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n} B")
    }
}

async fn group_status(targets: &Targets, group: &str) -> anyhow::Result<GroupStatus> {
    let pool = targets.group(group).await?;
    let name = targets.qualified(group);
    let (dead_letters_open, orders_parked, rate_limit, rate_limit_events_per_second): (
        i64,
        i64,
        Option<String>,
        Option<f64>,
    ) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM dead_letter
                                       WHERE group_name = $1 AND status = 'open' LIMIT $2) x),
                (SELECT count(DISTINCT aggregate_id) FROM (SELECT aggregate_id FROM parked_event
                                                       WHERE group_name = $1 LIMIT $2) x),
                l.rate, l.events_per_second
         FROM (SELECT 1) one
         LEFT JOIN group_rate_limit l ON l.group_name = $1",
    )
    .bind(&name)
    .bind(CAP)
    .fetch_one(&pool)
    .await?;
    let paused = group::state(&pool, &name).await?;
    let kafka = targets.args.kafka.clone();
    let topics = targets.topics(group).await?;
    let kafka_group = name.clone();
    let lag = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        anyhow::ensure!(
            !topics.is_empty(),
            "the group has owned no partition of any topic: name its topics (--topic)"
        );
        let reader = offsets_reader(&kafka, &kafka_group)?;
        let peeker: BaseConsumer = kafka
            .client_config()
            .set("group.id", "pipeline-operator-status")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()?;
        read_group(
            &reader,
            &peeker,
            &kafka_group,
            &topics,
            Duration::from_secs(5),
        )
    })
    .await?;
    let mut status = GroupStatus {
        group: group.to_owned(),
        state: if paused.is_some() {
            "paused"
        } else {
            "running"
        },
        paused,
        members: None,
        lag_messages: None,
        lag_seconds: None,
        uncommitted_partitions: None,
        rate_limit,
        rate_limit_events_per_second,
        dead_letters_open,
        orders_parked,
        waiting: None,
        waiting_error: None,
        kafka_error: None,
        partitions: Vec::new(),
    };
    if let Some(read) = targets
        .registered_groups()
        .read_waiting(group, pool.clone())
    {
        match read.await {
            Ok(w) => status.waiting = Some(w),
            Err(e) => status.waiting_error = Some(format!("{e:#}")),
        }
    }
    match lag {
        Ok(snapshot) => {
            status.partitions = snapshot
                .partitions
                .iter()
                .map(|p| PartitionStatus {
                    topic: p.topic.clone(),
                    partition: p.partition,
                    committed: p.committed,
                    end: p.end,
                    lag_messages: p.lag(),
                    lag_seconds: p.lag().map(|_| {
                        snapshot
                            .first_unprocessed_age
                            .get(&(p.topic.clone(), p.partition))
                            .copied()
                            .unwrap_or(0.0)
                    }),
                })
                .collect();
            status.members = snapshot.members;
            status.lag_messages = Some(snapshot.partitions.iter().filter_map(|p| p.lag()).sum());
            status.uncommitted_partitions = Some(
                snapshot
                    .partitions
                    .iter()
                    .filter(|p| p.committed.is_none() && p.end > 0)
                    .count(),
            );
            status.lag_seconds = Some(
                snapshot
                    .first_unprocessed_age
                    .values()
                    .copied()
                    .fold(0.0, f64::max),
            );
        }
        Err(e) => status.kafka_error = Some(format!("{e:#}")),
    }
    Ok(status)
}

/// Prints the status as tables.
pub fn print(status: &Status) {
    let o = &status.outbox;
    let mut outbox = table(&[
        "outbox",
        "pending",
        "retrying",
        "failed",
        "oldest unpublished",
    ]);
    crate::output::row(
        &mut outbox,
        vec![
            "queue".to_owned(),
            capped(o.pending, CAP),
            capped(o.retrying, CAP),
            capped(o.failed, CAP),
            cell(o.oldest_unpublished_seconds.map(age)),
        ],
    );
    println!("{outbox}");
    let mut delayed = table(&["delayed events", "waiting", "due", "next due"]);
    crate::output::row(
        &mut delayed,
        vec![
            "delayed".to_owned(),
            capped(o.delayed, CAP),
            capped(o.delayed_due, CAP),
            cell(o.next_delayed_in_seconds.map(|s| {
                if s >= 0.0 {
                    format!("in {}", age(s))
                } else {
                    format!("overdue {}", age(-s))
                }
            })),
        ],
    );
    println!("{delayed}");
    let mut relay = table(&["relay lease", "epoch", "holder", "state", "renewed"]);
    for l in &status.relay {
        let state = match (l.held, l.holder_connected) {
            (true, true) => "active",
            (true, false) => "held, holder's session gone",
            (false, true) => "expired (holder frozen or cut off?)",
            (false, false) => "vacant",
        };
        crate::output::row(
            &mut relay,
            vec![
                l.lease_key.to_string(),
                l.epoch.to_string(),
                cell(
                    l.holder
                        .map(|h| format!("{h} (pid {})", cell(l.holder_pid))),
                ),
                state.to_owned(),
                cell(l.renewed_seconds_ago.map(|s| format!("{} ago", age(s)))),
            ],
        );
    }
    if status.relay.is_empty() {
        crate::output::row(
            &mut relay,
            vec!["-", "-", "no relay has run", "vacant", "-"],
        );
    }
    println!("{relay}");
    if !status.stream.is_empty() {
        let mut stream = table(&[
            "write-ahead log",
            "slot",
            "writers",
            "session",
            "lag",
            "WAL kept",
            "past horizon",
            "horizon",
        ]);
        for w in &status.stream {
            let session = match (w.slot_exists, w.slot_active, w.wal_status.as_deref()) {
                (false, _, _) => "no slot".to_owned(),
                (true, _, Some("lost")) => {
                    "slot LOST: the relay falls back to the queue".to_owned()
                }
                (true, true, _) => "streaming".to_owned(),
                (true, false, _) => "none (slot inactive)".to_owned(),
            };
            crate::output::row(
                &mut stream,
                vec![
                    w.lease_key.to_string(),
                    w.slot.clone(),
                    if w.streaming {
                        "queue nothing"
                    } else {
                        "queue (fell back)"
                    }
                    .to_owned(),
                    session,
                    cell(w.lag_bytes.map(bytes)),
                    cell(w.retained_bytes.map(bytes)),
                    capped(w.past_horizon, CAP),
                    format!("{} ago", age(w.horizon_seconds.max(0.0))),
                ],
            );
        }
        println!("{stream}");
    }
    let mut groups = table(&[
        "group",
        "state",
        "members",
        "lag (messages)",
        "lag (age)",
        "uncommitted partitions",
        "rate limit (per member)",
        "dead letters open",
        "orders parked",
    ]);
    for g in &status.groups {
        let state = match &g.paused {
            Some(p) => format!(
                "paused {}",
                age((chrono::Utc::now() - p.since).num_milliseconds().max(0) as f64 / 1000.0)
            ),
            None => g.state.to_owned(),
        };
        crate::output::row(
            &mut groups,
            vec![
                g.group.clone(),
                state,
                cell(g.members),
                cell(g.lag_messages),
                cell(g.lag_seconds.map(age)),
                cell(g.uncommitted_partitions),
                g.rate_limit.clone().unwrap_or_else(|| "none".to_owned()),
                capped(g.dead_letters_open, CAP),
                capped(g.orders_parked, CAP),
            ],
        );
    }
    println!("{groups}");
    for g in &status.groups {
        if let Some(p) = &g.paused {
            println!("{}: {}", g.group, group::describe(p));
        }
        if let Some(w) = &g.waiting {
            println!(
                "{}: {} {} waiting{}",
                g.group,
                w.count,
                w.what,
                w.oldest_seconds
                    .map(|s| format!(", the oldest for {}", age(s)))
                    .unwrap_or_default()
            );
        }
        if let Some(e) = &g.waiting_error {
            println!("{}: what waits beside it could not be read: {e}", g.group);
        }
    }
    for g in status.groups.iter().filter(|g| g.kafka_error.is_some()) {
        println!(
            "{}: Kafka did not answer: {}",
            g.group,
            cell(g.kafka_error.as_ref())
        );
    }
}
