//! The broker tests use, and how far a consumer group has got.

use std::time::{Duration, Instant};

use pipeline_core::kafka::{group_lag, KafkaArgs};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::OwnedMessage;
use rdkafka::{Offset, TopicPartitionList};

/// The broker when `KAFKA_BROKERS` is not set: the local one `scripts/test.sh` runs.
const LOCAL_BROKER: &str = "127.0.0.1:9092";

/// The broker tests use: `KAFKA_BROKERS`, by default the local one.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| LOCAL_BROKER.to_owned())
}

/// Client settings for `brokers`, with no further options.
pub fn kafka_args(brokers: &str) -> KafkaArgs {
    KafkaArgs {
        kafka_brokers: brokers.to_owned(),
        kafka_options: Vec::new(),
    }
}

/// Total committed lag of `group` over `topic`: 0 once the group has committed everything;
/// `None` while a partition with data has no commit yet. Blocks on the broker (up to 10 s).
pub fn committed_lag(kafka: &KafkaArgs, group: &str, topic: &str) -> anyhow::Result<Option<i64>> {
    let parts = group_lag(kafka, group, &[topic.to_owned()], Duration::from_secs(10))?;
    let mut total = 0;
    for p in parts {
        match p.lag() {
            Some(l) => total += l,
            None if p.end > 0 => return Ok(None),
            None => {}
        }
    }
    Ok(Some(total))
}

/// Reads `topic` from the start of every partition until `count` records arrived or `timeout`
/// passed, and returns what arrived.
pub fn read_topic(
    kafka: &KafkaArgs,
    topic: &str,
    count: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<OwnedMessage>> {
    let reader: BaseConsumer = kafka
        .client_config()
        .set("group.id", "test-topic-reader")
        .create()?;
    let metadata = reader.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for topic_metadata in metadata.topics() {
        for p in topic_metadata.partitions() {
            tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
        }
    }
    reader.assign(&tpl)?;
    let mut records = Vec::new();
    let deadline = Instant::now() + timeout;
    while records.len() < count && Instant::now() < deadline {
        if let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) {
            records.push(m.detach());
        }
    }
    Ok(records)
}
