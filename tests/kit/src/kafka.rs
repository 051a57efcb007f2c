//! The broker tests use, and how far a consumer group has got.

use std::time::Duration;

use pipeline_core::kafka::{group_lag, KafkaArgs};

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
