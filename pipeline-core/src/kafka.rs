//! Kafka client settings and the few admin calls the pipeline needs.
//!
//! Everything here speaks the plain Kafka protocol through librdkafka, so the same binaries run
//! against Apache Kafka, Redpanda, MSK or the local development broker.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

/// Kafka settings shared by every binary.
#[derive(clap::Args, Clone)]
pub struct KafkaArgs {
    /// Bootstrap brokers, comma separated.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub kafka_brokers: String,
    /// Extra librdkafka settings as key=value, repeatable (or comma separated in the environment),
    /// e.g. security.protocol=SASL_SSL, sasl.mechanisms=SCRAM-SHA-512, sasl.username=…,
    /// sasl.password=…, ssl.ca.location=/etc/ssl/ca.pem.
    #[arg(long = "kafka-option", env = "KAFKA_OPTIONS", value_delimiter = ',', value_parser = parse_option)]
    pub kafka_options: Vec<(String, String)>,
}

fn parse_option(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not key=value"))?;
    if k.trim().is_empty() {
        return Err(format!("`{s}` has an empty key"));
    }
    Ok((k.trim().to_owned(), v.to_owned()))
}

fn is_secret(key: &str) -> bool {
    key.contains("password") || key.contains("secret") || key.ends_with(".key.pem")
}

impl std::fmt::Debug for KafkaArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: BTreeMap<&str, &str> = self
            .kafka_options
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaArgs")
            .field("kafka_brokers", &self.kafka_brokers)
            .field("kafka_options", &options)
            .finish()
    }
}

impl KafkaArgs {
    /// A client configuration with the brokers and the pass-through options set.
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.kafka_brokers);
        for (k, v) in &self.kafka_options {
            config.set(k, v);
        }
        config
    }

    /// Creates the topics that do not exist yet; existing ones are left as they are.
    pub async fn ensure_topics(&self, topics: &[String], partitions: i32) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = self
            .client_config()
            .create()
            .context("creating Kafka admin client")?;
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(-1)))
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = admin
            .create_topics(&new, &opts)
            .await
            .context("creating topics")?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => bail!("cannot create topic {topic}: {code}"),
            }
        }
        Ok(())
    }
}

/// Offsets of one partition as seen by one consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLag {
    pub topic: String,
    pub partition: i32,
    /// The group's committed offset; `None` when the group has never committed here.
    pub committed: Option<i64>,
    /// The partition's end offset (high watermark).
    pub end: i64,
}

impl PartitionLag {
    /// Messages the group has yet to process; `None` when nothing was committed.
    pub fn lag(&self) -> Option<i64> {
        self.committed.map(|c| (self.end - c).max(0))
    }
}

/// Reads a group's committed offsets, then the end offsets, for every partition of `topics`.
///
/// Committed offsets are read first so that a commit landing in between can only make the lag
/// look larger, never negative. The client joins no group: it only reads.
pub fn group_lag(
    kafka: &KafkaArgs,
    group: &str,
    topics: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<PartitionLag>> {
    let consumer = offsets_reader(kafka, group)?;
    partition_lags(&consumer, topics, timeout)
}

/// A client that reads `group`'s committed offsets without joining the group.
pub fn offsets_reader(kafka: &KafkaArgs, group: &str) -> anyhow::Result<BaseConsumer> {
    kafka
        .client_config()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .context("creating Kafka client for offsets")
}

/// [`group_lag`] with a reader made by [`offsets_reader`].
pub fn partition_lags(
    consumer: &BaseConsumer,
    topics: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<PartitionLag>> {
    let mut tpl = TopicPartitionList::new();
    for topic in topics {
        let metadata = consumer
            .fetch_metadata(Some(topic), timeout)
            .with_context(|| format!("fetching metadata of {topic}"))?;
        for t in metadata.topics() {
            for p in t.partitions() {
                tpl.add_partition(t.name(), p.id());
            }
        }
    }
    let committed = consumer
        .committed_offsets(tpl, timeout)
        .context("fetching committed offsets")?;
    let mut out = Vec::new();
    for elem in committed.elements() {
        let (_, high) = consumer
            .fetch_watermarks(elem.topic(), elem.partition(), timeout)
            .with_context(|| {
                format!(
                    "fetching watermarks of {}/{}",
                    elem.topic(),
                    elem.partition()
                )
            })?;
        let committed = match elem.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        };
        out.push(PartitionLag {
            topic: elem.topic().to_owned(),
            partition: elem.partition(),
            committed,
            end: high,
        });
    }
    out.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kafka: KafkaArgs,
    }

    #[test]
    fn secrets_are_redacted_in_debug() {
        let cli = Cli::parse_from([
            "x",
            "--kafka-option",
            "sasl.username=app",
            "--kafka-option",
            "sasl.password=hunter2",
        ]);
        let shown = format!("{:?}", cli.kafka);
        assert!(shown.contains("app"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn rejects_options_without_value() {
        assert!(parse_option("acks").is_err());
        assert_eq!(
            parse_option("a=b=c").expect("valid"),
            ("a".to_owned(), "b=c".to_owned())
        );
    }
}
