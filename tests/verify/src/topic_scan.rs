//! Reads the whole topic back with a plain consumer (assigned partitions, no group commits) and
//! counts the records whose `event-id` header was already seen: Kafka-level duplicates, which the
//! relay's crash window allows and the consumers must absorb.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pipeline_core::envelope::EVENT_ID;
use pipeline_core::kafka::KafkaArgs;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use uuid::Uuid;

/// What the topic holds.
#[derive(Debug, Default)]
pub struct TopicScan {
    pub records: u64,
    /// Records whose event id came earlier in the topic.
    pub duplicates: u64,
    /// Records without a readable `event-id` header.
    pub without_event_id: u64,
    /// Every event id seen.
    pub event_ids: HashSet<Uuid>,
    /// Where each record with an event id lies: (event id, partition, offset).
    pub positions: HashSet<(Uuid, i32, i64)>,
}

/// Reads every partition of `topic` from its low to its high watermark (blocking).
pub fn scan(kafka: &KafkaArgs, topic: &str, timeout: Duration) -> anyhow::Result<TopicScan> {
    let consumer: BaseConsumer = kafka
        .client_config()
        .set(
            "group.id",
            format!("verify-scan-{}", Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .create()
        .context("creating the topic reader")?;
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .context("fetching the topic's metadata")?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        bail!("topic {topic} has no partitions");
    }
    let mut assignment = TopicPartitionList::new();
    // Offset one past the last record still to read, per partition.
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for &partition in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, Duration::from_secs(10))
            .with_context(|| format!("watermarks of {topic}/{partition}"))?;
        if high > low {
            assignment.add_partition_offset(topic, partition, Offset::Offset(low))?;
            let _ = ends.insert(partition, high);
        }
    }
    consumer
        .assign(&assignment)
        .context("assigning partitions")?;
    let mut scan = TopicScan::default();
    let deadline = Instant::now() + timeout;
    while !ends.is_empty() {
        if Instant::now() > deadline {
            bail!("reading the topic back took over {timeout:?}; partitions left: {ends:?}");
        }
        let Some(message) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let message = match message {
            Ok(m) => m,
            // Past the last record (an offset gap can hide the high watermark's predecessor).
            Err(KafkaError::PartitionEOF(partition)) => {
                let _ = ends.remove(&partition);
                continue;
            }
            Err(e) => return Err(e).context("reading the topic"),
        };
        let partition = message.partition();
        let Some(&end) = ends.get(&partition) else {
            continue;
        };
        if message.offset() >= end {
            continue;
        }
        scan.records += 1;
        let event_id = message.headers().and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == EVENT_ID)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|s| Uuid::parse_str(s).ok())
        });
        if let Some(id) = event_id {
            let _ = scan.positions.insert((id, partition, message.offset()));
        }
        match event_id {
            Some(id) if !scan.event_ids.insert(id) => scan.duplicates += 1,
            Some(_) => {}
            None => scan.without_event_id += 1,
        }
        if message.offset() + 1 >= end {
            let _ = ends.remove(&partition);
        }
    }
    Ok(scan)
}
