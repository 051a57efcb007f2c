//! Kafka client settings and the few admin calls the pipeline needs.
//!
//! Everything here speaks the plain Kafka protocol through librdkafka, so the same binaries run
//! against Apache Kafka, Redpanda, MSK or any other Kafka-protocol cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

/// The brokers of [`KafkaArgs::default`]: a local broker.
pub const DEFAULT_KAFKA_BROKERS: &str = "127.0.0.1:9092";

/// Kafka settings shared by every binary.
#[derive(Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct KafkaArgs {
    /// Bootstrap brokers, comma separated.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KAFKA_BROKERS", default_value = DEFAULT_KAFKA_BROKERS)
    )]
    pub kafka_brokers: String,
    /// Extra librdkafka settings as key=value, repeatable (or comma separated in the environment),
    /// e.g. security.protocol=SASL_SSL, sasl.mechanisms=SCRAM-SHA-512, sasl.username=…,
    /// sasl.password=…, ssl.ca.location=/etc/ssl/ca.pem.
    #[cfg_attr(
        feature = "cli",
        arg(long = "kafka-option", env = "KAFKA_OPTIONS", value_delimiter = ',', value_parser = parse_option)
    )]
    pub kafka_options: Vec<(String, String)>,
}

impl Default for KafkaArgs {
    fn default() -> Self {
        KafkaArgs {
            kafka_brokers: DEFAULT_KAFKA_BROKERS.to_owned(),
            kafka_options: Vec::new(),
        }
    }
}

/// Parses one `key=value` librdkafka setting.
pub fn parse_option(s: &str) -> Result<(String, String), String> {
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

/// The Kafka cluster refused this client's credentials or its TLS handshake failed; the
/// message is librdkafka's, which names the broker and the reason.
#[derive(Debug, thiserror::Error)]
#[error(
    "Kafka refused the connection: {0} (check KAFKA_OPTIONS: security.protocol, sasl.*, ssl.*)"
)]
pub struct AccessRefused(pub String);

/// A client context that keeps the first authentication or TLS failure librdkafka reports, and
/// logs every error as the default context does.
#[derive(Default)]
struct AccessWatch {
    refused: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl ClientContext for AccessWatch {
    fn error(&self, error: KafkaError, reason: &str) {
        // A TLS failure counts only when the certificate is what failed: a broker closing a
        // handshake half-way (say, while it restarts) is an SSL error too, and passes.
        let refused = match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed) => {
                true
            }
            Some(RDKafkaErrorCode::SSL) => reason.contains("certificate"),
            _ => false,
        };
        if refused {
            if let Ok(mut refused) = self.refused.lock() {
                refused.get_or_insert_with(|| reason.to_owned());
            }
        }
        tracing::error!("librdkafka: {error}: {reason}");
    }
}

impl ConsumerContext for AccessWatch {}

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

    /// Connects to the cluster once and fails when it refuses this client: a SASL login the
    /// brokers reject (wrong user or password, a mechanism they do not enable) or a TLS handshake
    /// that fails (a certificate the client does not trust, a name that does not match). A
    /// cluster that does not answer within `within` (down, starting, unreachable) is no error:
    /// the clients wait for it as they always do. The binaries call it at start-up, so that bad
    /// credentials stop them with the brokers' reason instead of an endless retry.
    pub async fn check_access(&self, within: Duration) -> Result<(), AccessRefused> {
        let config = self.client_config();
        tokio::task::spawn_blocking(move || {
            let watch = AccessWatch::default();
            let refused = watch.refused.clone();
            let consumer: BaseConsumer<AccessWatch> = config
                .create_with_context(watch)
                .map_err(|e| AccessRefused(format!("invalid client settings: {e}")))?;
            // Metadata requests go out only once the connection is up and authenticated; the
            // login's failure reaches the context's error callback when the client is polled.
            let deadline = std::time::Instant::now() + within;
            while std::time::Instant::now() < deadline {
                if consumer
                    .fetch_metadata(None, Duration::from_millis(500))
                    .is_ok()
                {
                    return Ok(());
                }
                let _ = consumer.poll(Duration::from_millis(100));
                if let Some(reason) = refused.lock().map(|r| r.clone()).unwrap_or_default() {
                    return Err(AccessRefused(reason));
                }
            }
            Ok(())
        })
        .await
        .unwrap_or(Ok(()))
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

    /// A topic's replicas and the settings an acknowledged write's durability rests on.
    pub async fn topic_durability(&self, topic: &str) -> anyhow::Result<TopicDurability> {
        let admin: AdminClient<DefaultClientContext> = self
            .client_config()
            .create()
            .context("creating Kafka admin client")?;
        let timeout = Duration::from_secs(10);
        let metadata = admin
            .inner()
            .fetch_metadata(Some(topic), timeout)
            .with_context(|| format!("reading topic {topic}'s metadata"))?;
        let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
            bail!("topic {topic} not found");
        };
        if let Some(e) = found.error() {
            bail!("topic {topic}: {:?}", RDKafkaErrorCode::from(e));
        }
        let partitions = found.partitions();
        let replication_factor = partitions
            .iter()
            .map(|p| p.replicas().len())
            .min()
            .unwrap_or(0);
        let opts = AdminOptions::new().request_timeout(Some(timeout));
        let configs = admin
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &opts)
            .await
            .with_context(|| format!("reading topic {topic}'s configuration"))?;
        let config = configs.into_iter().next().and_then(Result::ok);
        let value = |name: &str| {
            config
                .as_ref()
                .and_then(|c| c.get(name))
                .and_then(|e| e.value.clone())
        };
        Ok(TopicDurability {
            topic: topic.to_owned(),
            partitions: partitions.len(),
            replication_factor,
            min_insync_replicas: value("min.insync.replicas").and_then(|v| v.parse().ok()),
            unclean_leader_election: value("unclean.leader.election.enable")
                .and_then(|v| v.parse().ok()),
        })
    }
}

/// What an `acks=all` write to a topic rests on: its replicas and the in-sync replicas a write
/// needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDurability {
    /// The topic.
    pub topic: String,
    /// Its partitions.
    pub partitions: usize,
    /// The fewest replicas any of its partitions has.
    pub replication_factor: usize,
    /// `min.insync.replicas` (the topic's, or the broker's default), when the cluster tells it.
    pub min_insync_replicas: Option<u32>,
    /// `unclean.leader.election.enable`, when the cluster tells it.
    pub unclean_leader_election: Option<bool>,
}

impl TopicDurability {
    /// What an acknowledged write to this topic does not survive, one sentence each; empty when
    /// it survives the loss of any one broker.
    pub fn weaknesses(&self) -> Vec<String> {
        let mut weak = Vec::new();
        if self.replication_factor < 2 {
            weak.push(format!(
                "replication factor {}: an acknowledged event lives on one broker and is lost with \
                 its disk (use 3)",
                self.replication_factor
            ));
        } else if let Some(min) = self.min_insync_replicas {
            if min < 2 {
                weak.push(format!(
                    "min.insync.replicas {min}: the leader alone may acknowledge an event, and it \
                     is lost if that broker fails before a follower copies it (use 2 with \
                     replication factor 3)"
                ));
            } else if min as usize >= self.replication_factor {
                weak.push(format!(
                    "min.insync.replicas {min} with replication factor {}: one broker down stops \
                     every write (use replication factor {} or more)",
                    self.replication_factor,
                    min + 1
                ));
            }
        }
        if self.unclean_leader_election == Some(true) {
            weak.push(
                "unclean.leader.election.enable=true: a replica that missed acknowledged events \
                 may become leader and drop them"
                    .to_owned(),
            );
        }
        weak
    }
}

/// Offsets of one partition as seen by one consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLag {
    /// The topic.
    pub topic: String,
    /// The partition.
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

    #[test]
    fn secrets_are_redacted_in_debug() {
        let kafka = KafkaArgs {
            kafka_options: vec![
                parse_option("sasl.username=app").expect("valid"),
                parse_option("sasl.password=hunter2").expect("valid"),
            ],
            ..KafkaArgs::default()
        };
        let shown = format!("{kafka:?}");
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

    fn topic(replication_factor: usize, min_isr: u32, unclean: bool) -> TopicDurability {
        TopicDurability {
            topic: "t".into(),
            partitions: 12,
            replication_factor,
            min_insync_replicas: Some(min_isr),
            unclean_leader_election: Some(unclean),
        }
    }

    #[test]
    fn three_replicas_two_in_sync_survive_one_broker() {
        assert!(topic(3, 2, false).weaknesses().is_empty());
    }

    #[test]
    fn each_weak_setting_is_named() {
        let one = topic(1, 1, false).weaknesses();
        assert!(one[0].contains("replication factor 1"), "{one:?}");
        let leader_alone = topic(3, 1, false).weaknesses();
        assert!(
            leader_alone[0].contains("min.insync.replicas 1"),
            "{leader_alone:?}"
        );
        let all_needed = topic(2, 2, false).weaknesses();
        assert!(
            all_needed[0].contains("stops every write"),
            "{all_needed:?}"
        );
        let unclean = topic(3, 2, true).weaknesses();
        assert!(
            unclean[0].contains("unclean.leader.election.enable"),
            "{unclean:?}"
        );
    }
}
