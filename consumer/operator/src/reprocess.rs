//! `pipeline reprocess --group G --from <time | offset>`: moves a stopped group's committed
//! offsets back, so its members read the events from there again when they start.
//!
//! By default the group's dedupe rows stay: every event it had processed is recognised and
//! skipped, so effects stay once-only and only what it had not processed is applied. With
//! `--clear-dedupe`, the dedupe rows of the events from there on are deleted and each of their
//! orders' progress goes back to just before its first such event, so those events are applied a
//! second time, in order.
//!
//! Kafka's offsets move first, then the database changes, in one transaction with the record of
//! the action: if the database step fails, the group re-reads events it still recognises, which
//! is safe, and the command can be run again.

use std::time::Duration;

use anyhow::Context;
use pipeline_core::kafka::offsets_reader;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::args::{Position, ReprocessArgs};
use crate::error::BadInput;
use crate::output::table;
use crate::targets::{KnownBy, Targets};

const TIMEOUT: Duration = Duration::from_secs(10);

/// Where one partition starts again.
#[derive(Debug, Clone, Serialize)]
pub struct Rewind {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The group's committed offset before.
    pub committed_before: Option<i64>,
    /// The offset it starts from now.
    pub from: i64,
}

/// What `reprocess` did.
#[derive(Debug, Serialize)]
pub struct Reprocessed {
    /// The group.
    pub group: String,
    /// Each partition's new starting offset.
    pub partitions: Vec<Rewind>,
    /// Dedupe rows deleted (`--clear-dedupe`).
    pub dedupe_rows_cleared: u64,
    /// Orders whose progress moved back (`--clear-dedupe`).
    pub orders_rewound: u64,
}

/// Moves the group `--group` names back to `args.from`.
pub async fn reprocess(targets: &Targets, args: &ReprocessArgs) -> anyhow::Result<Reprocessed> {
    let group = targets.one_group(KnownBy::Database).await?;
    reprocess_group(targets, &group, args).await
}

/// Moves `group` (a known name without the prefix) back to `args.from`; the `reprocess` command
/// and the web console both act through here.
pub async fn reprocess_group(
    targets: &Targets,
    group: &str,
    args: &ReprocessArgs,
) -> anyhow::Result<Reprocessed> {
    let group = group.to_owned();
    let name = targets.qualified(&group);
    let pool = targets.group(&group).await?;
    let known: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM partition_owner WHERE group_name = $1)")
            .bind(&name)
            .fetch_one(&pool)
            .await?;
    if !known {
        return Err(BadInput::UnknownGroup(
            group.clone(),
            "it has never owned a partition in its database".to_owned(),
        )
        .into());
    }
    let topics = targets.topics(&group).await?;
    if topics.is_empty() {
        return Err(BadInput::Refused(format!(
            "group {group} has owned no partition of any topic: name its topics (--topic)"
        ))
        .into());
    }
    // Who acts, once the group is known to be one that can be moved back.
    let actor = args.change.actor()?;
    let kafka = targets.args.kafka.clone();
    let from = args.from;
    let kafka_group = name.clone();
    let partitions = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Rewind>> {
        let client = offsets_reader(&kafka, &kafka_group)?;
        let members: usize = client
            .fetch_group_list(Some(&kafka_group), TIMEOUT)
            .context("reading the group's members")?
            .groups()
            .iter()
            .map(|g| g.members().len())
            .sum();
        if members > 0 {
            return Err(BadInput::Refused(format!(
                "group {kafka_group} has {members} running member(s): stop them first, so no \
                 member commits over the new offsets"
            ))
            .into());
        }
        let rewinds = plan(&client, &topics, from)?;
        let mut tpl = TopicPartitionList::new();
        for r in &rewinds {
            tpl.add_partition_offset(&r.topic, r.partition, Offset::Offset(r.from))?;
        }
        client
            .commit(&tpl, CommitMode::Sync)
            .context("committing the group's new offsets")?;
        Ok(rewinds)
    })
    .await??;
    let topics: Vec<&str> = partitions.iter().map(|r| r.topic.as_str()).collect();
    let numbers: Vec<i32> = partitions.iter().map(|r| r.partition).collect();
    let offsets: Vec<i64> = partitions.iter().map(|r| r.from).collect();
    let mut tx = pool.begin().await?;
    let (cleared, rewound): (i64, i64) = if args.clear_dedupe {
        sqlx::query_as(
            "WITH r AS (SELECT * FROM unnest($2::text[], $3::int[], $4::bigint[])
                        AS r(topic, partition, from_offset)),
                  range AS (SELECT pm.event_id FROM processed_message pm
                            JOIN r ON pm.topic = r.topic AND pm.partition = r.partition
                                  AND pm.kafka_offset >= r.from_offset
                            WHERE pm.group_name = $1),
                  firsts AS (SELECT a.aggregate_id, min(a.sequence) AS first
                             FROM (SELECT group_name, event_id, aggregate_id, sequence
                                   FROM applied_effect
                                   UNION ALL
                                   SELECT group_name, event_id, aggregate_id, sequence
                                   FROM applied_effect_held) a
                             WHERE a.group_name = $1 AND a.event_id IN (SELECT event_id FROM range)
                             GROUP BY a.aggregate_id),
                  rewound AS (UPDATE aggregate_progress p SET last_sequence = f.first - 1,
                                                          updated_at = clock_timestamp()
                              FROM firsts f
                              WHERE p.group_name = $1 AND p.aggregate_id = f.aggregate_id
                                AND p.last_sequence >= f.first
                              RETURNING 1),
                  cleared AS (DELETE FROM processed_message pm USING range
                              WHERE pm.group_name = $1 AND pm.event_id = range.event_id
                              RETURNING 1)
             SELECT (SELECT count(*) FROM cleared), (SELECT count(*) FROM rewound)",
        )
        .bind(&name)
        .bind(&topics)
        .bind(&numbers)
        .bind(&offsets)
        .fetch_one(&mut *tx)
        .await?
    } else {
        (0, 0)
    };
    let result = Reprocessed {
        group: group.clone(),
        partitions,
        dedupe_rows_cleared: cleared as u64,
        orders_rewound: rewound as u64,
    };
    let _ = sqlx::query(
        "INSERT INTO operator_action (actor, action, reason, group_name, detail)
         VALUES ($1, 'group.reprocess', $2, $3, $4)",
    )
    .bind(&actor)
    .bind(&args.change.note)
    .bind(&name)
    .bind(serde_json::to_value(&result)?)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(result)
}

/// The starting offset of every partition of `topics`, within what the partition holds.
fn plan(client: &BaseConsumer, topics: &[String], from: Position) -> anyhow::Result<Vec<Rewind>> {
    let mut all = TopicPartitionList::new();
    for topic in topics {
        let metadata = client
            .fetch_metadata(Some(topic), TIMEOUT)
            .with_context(|| format!("reading the partitions of {topic}"))?;
        for t in metadata.topics() {
            if t.partitions().is_empty() {
                return Err(BadInput::NotFound {
                    what: "topic",
                    id: topic.clone(),
                }
                .into());
            }
            for p in t.partitions() {
                all.add_partition(topic, p.id());
            }
        }
    }
    let committed = client.committed_offsets(all.clone(), TIMEOUT)?;
    let wanted = match from {
        Position::Time(t) => {
            let mut times = TopicPartitionList::new();
            for e in all.elements() {
                times.add_partition_offset(
                    e.topic(),
                    e.partition(),
                    Offset::Offset(t.timestamp_millis()),
                )?;
            }
            Some(client.offsets_for_times(times, TIMEOUT)?)
        }
        Position::Offset(_) => None,
    };
    let mut rewinds = Vec::new();
    for e in all.elements() {
        let (low, high) = client.fetch_watermarks(e.topic(), e.partition(), TIMEOUT)?;
        let target = match (from, &wanted) {
            (Position::Offset(o), _) => o,
            (Position::Time(_), Some(found)) => match found
                .find_partition(e.topic(), e.partition())
                .map(|x| x.offset())
            {
                Some(Offset::Offset(o)) => o,
                // No record at or after that time: start at the end.
                _ => high,
            },
            (Position::Time(_), None) => high,
        };
        let before = committed
            .find_partition(e.topic(), e.partition())
            .and_then(|x| match x.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            });
        rewinds.push(Rewind {
            topic: e.topic().to_owned(),
            partition: e.partition(),
            committed_before: before,
            from: target.clamp(low, high),
        });
    }
    Ok(rewinds)
}

/// Prints what was done.
pub fn print(r: &Reprocessed) {
    let mut t = table(&["topic", "partition", "committed before", "starts from"]);
    for p in &r.partitions {
        crate::output::row(
            &mut t,
            vec![
                p.topic.clone(),
                p.partition.to_string(),
                p.committed_before.map_or("-".to_owned(), |o| o.to_string()),
                p.from.to_string(),
            ],
        );
    }
    println!("{t}");
    println!(
        "group {}: offsets moved; {} dedupe row(s) cleared, {} order(s) rewound. Start its members to reprocess.",
        r.group, r.dedupe_rows_cleared, r.orders_rewound
    );
}
