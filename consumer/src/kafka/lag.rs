//! The lag collector: each group's committed offsets against the partitions' end offsets, read
//! through the Kafka protocol for a configured list of expected groups, so a group with no running
//! member still reports (growing) lag.
//!
//! Every cycle builds the series from a fresh snapshot and swaps it in whole: revoked partitions
//! and departed groups leave no stale series, a partition without a commit gets no lag series
//! (it is counted in `consumer_group_uncommitted_partitions`), and lag is never negative.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::Utc;
use pipeline_core::envelope::Envelope;
use pipeline_core::kafka::{offsets_reader, partition_lags, KafkaArgs, PartitionLag};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, IntGaugeVec, Opts};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

struct Families {
    lag_messages: IntGaugeVec,
    lag_seconds: GaugeVec,
    committed: IntGaugeVec,
    end: IntGaugeVec,
    uncommitted: IntGaugeVec,
    members: IntGaugeVec,
    last_success: GaugeVec,
}

impl Families {
    fn new() -> prometheus::Result<Self> {
        let gpt = &["group", "topic", "partition"];
        Ok(Families {
            lag_messages: IntGaugeVec::new(
                Opts::new("consumer_group_lag_messages", "End offset minus committed offset"),
                gpt,
            )?,
            lag_seconds: GaugeVec::new(
                Opts::new(
                    "consumer_group_lag_seconds",
                    "Age of the first unprocessed event (from its occurred-at header); 0 without lag",
                ),
                gpt,
            )?,
            committed: IntGaugeVec::new(
                Opts::new("consumer_group_committed_offset", "The group's committed offset"),
                gpt,
            )?,
            end: IntGaugeVec::new(
                Opts::new("kafka_topic_partition_end_offset", "The partition's end offset (high watermark)"),
                &["topic", "partition"],
            )?,
            uncommitted: IntGaugeVec::new(
                Opts::new(
                    "consumer_group_uncommitted_partitions",
                    "Partitions holding data where the group has no committed offset",
                ),
                &["group", "topic"],
            )?,
            members: IntGaugeVec::new(
                Opts::new("consumer_group_members", "Members of the consumer group"),
                &["group"],
            )?,
            last_success: GaugeVec::new(
                Opts::new(
                    "lag_collector_last_success_timestamp_seconds",
                    "Unix time of the lag collector's last complete cycle",
                ),
                &[],
            )?,
        })
    }

    fn collectors(&self) -> [&dyn Collector; 7] {
        [
            &self.lag_messages,
            &self.lag_seconds,
            &self.committed,
            &self.end,
            &self.uncommitted,
            &self.members,
            &self.last_success,
        ]
    }
}

/// The Prometheus side: serves the last complete snapshot.
#[derive(Clone)]
pub struct LagCollector {
    descs: Arc<Vec<Desc>>,
    snapshot: Arc<RwLock<Vec<MetricFamily>>>,
}

impl LagCollector {
    /// A collector with no snapshot yet: it serves nothing until [`run_collector`] completes a
    /// cycle.
    pub fn new() -> prometheus::Result<Self> {
        let template = Families::new()?;
        let descs = template
            .collectors()
            .iter()
            .flat_map(|c| c.desc().into_iter().cloned())
            .collect();
        Ok(LagCollector {
            descs: Arc::new(descs),
            snapshot: Arc::new(RwLock::new(Vec::new())),
        })
    }
}

impl Collector for LagCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.snapshot.read().map(|s| s.clone()).unwrap_or_default()
    }
}

/// One group's offsets as of a cycle.
pub struct GroupSnapshot {
    /// The Kafka group id.
    pub group: String,
    /// Committed and end offsets of each partition of the group's topics.
    pub partitions: Vec<PartitionLag>,
    /// Age in seconds of the first unprocessed event per (topic, partition) with lag.
    pub first_unprocessed_age: HashMap<(String, i32), f64>,
    /// Members of the group; `None` when the lookup failed (no series rather than a false 0).
    pub members: Option<usize>,
}

/// Reads one group: offsets, members and the age of each lagging partition's next event.
pub fn read_group(
    reader: &BaseConsumer,
    peeker: &BaseConsumer,
    group: &str,
    topics: &[String],
    timeout: Duration,
) -> anyhow::Result<GroupSnapshot> {
    let partitions = partition_lags(reader, topics, timeout)?;
    let members = match reader.fetch_group_list(Some(group), timeout) {
        Ok(list) => Some(list.groups().iter().map(|g| g.members().len()).sum()),
        Err(e) => {
            tracing::warn!(group, error = %e, "cannot read group members");
            None
        }
    };
    let lagging: Vec<&PartitionLag> = partitions
        .iter()
        .filter(|p| p.lag().unwrap_or(0) > 0)
        .collect();
    let first_unprocessed_age = peek_ages(peeker, &lagging, timeout)?;
    Ok(GroupSnapshot {
        group: group.to_owned(),
        partitions,
        first_unprocessed_age,
        members,
    })
}

/// Reads the message at each lagging partition's committed offset and returns its age.
fn peek_ages(
    peeker: &BaseConsumer,
    lagging: &[&PartitionLag],
    timeout: Duration,
) -> anyhow::Result<HashMap<(String, i32), f64>> {
    let mut ages = HashMap::new();
    if lagging.is_empty() {
        return Ok(ages);
    }
    let mut tpl = TopicPartitionList::new();
    for p in lagging {
        if let Some(c) = p.committed {
            tpl.add_partition_offset(&p.topic, p.partition, Offset::Offset(c))?;
        }
    }
    peeker.assign(&tpl)?;
    let deadline = std::time::Instant::now() + timeout;
    while ages.len() < lagging.len() && std::time::Instant::now() < deadline {
        match peeker.poll(Duration::from_millis(100)) {
            Some(Ok(msg)) => {
                let key = (msg.topic().to_owned(), msg.partition());
                if ages.contains_key(&key) {
                    continue;
                }
                // A record without a readable envelope still has a broker timestamp.
                let created = Envelope::from_record(msg.key(), msg.headers())
                    .map(|e| e.occurred_at.timestamp_millis())
                    .ok()
                    .or_else(|| msg.timestamp().to_millis());
                if let Some(ms) = created {
                    let age = (Utc::now().timestamp_millis() - ms).max(0) as f64 / 1000.0;
                    let _ = ages.insert(key, age);
                }
            }
            Some(Err(e)) => tracing::debug!(error = %e, "lag peek"),
            None => {}
        }
    }
    peeker.unassign()?;
    Ok(ages)
}

/// Builds the metric families of one cycle.
fn families(snapshots: &[GroupSnapshot]) -> prometheus::Result<Vec<MetricFamily>> {
    let f = Families::new()?;
    let mut ends: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for s in snapshots {
        if let Some(members) = s.members {
            f.members.with_label_values(&[&s.group]).set(members as i64);
        }
        let mut uncommitted: BTreeMap<&str, i64> = BTreeMap::new();
        for p in &s.partitions {
            let _ = ends.insert((p.topic.clone(), p.partition), p.end);
            let part = p.partition.to_string();
            let labels = [s.group.as_str(), p.topic.as_str(), part.as_str()];
            let _ = uncommitted.entry(&p.topic).or_insert(0);
            match (p.committed, p.lag()) {
                (Some(c), Some(lag)) => {
                    f.committed.with_label_values(&labels).set(c);
                    f.lag_messages.with_label_values(&labels).set(lag);
                    let age = if lag > 0 {
                        s.first_unprocessed_age
                            .get(&(p.topic.clone(), p.partition))
                            .copied()
                    } else {
                        Some(0.0)
                    };
                    if let Some(age) = age {
                        f.lag_seconds.with_label_values(&labels).set(age);
                    }
                }
                _ if p.end > 0 => *uncommitted.entry(&p.topic).or_insert(0) += 1,
                _ => {}
            }
        }
        for (topic, n) in uncommitted {
            f.uncommitted.with_label_values(&[&s.group, topic]).set(n);
        }
    }
    for ((topic, partition), end) in ends {
        f.end
            .with_label_values(&[&topic, &partition.to_string()])
            .set(end);
    }
    f.last_success
        .with_label_values::<&str>(&[])
        .set(Utc::now().timestamp_millis() as f64 / 1000.0);
    Ok(f.collectors().iter().flat_map(|c| c.collect()).collect())
}

/// Refreshes `collector` every `interval` until `shutdown`, on the calling (blocking) thread.
pub fn run_collector(
    kafka: &KafkaArgs,
    groups: &[String],
    topics: &[String],
    interval: Duration,
    collector: &LagCollector,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let readers: Vec<(String, BaseConsumer)> = groups
        .iter()
        .map(|g| offsets_reader(kafka, g).map(|r| (g.clone(), r)))
        .collect::<anyhow::Result<_>>()?;
    let peeker: BaseConsumer = kafka
        .client_config()
        .set("group.id", "pipeline-lag-collector")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()?;
    let timeout = Duration::from_secs(5);
    while !shutdown.is_cancelled() {
        let snapshots: anyhow::Result<Vec<GroupSnapshot>> = readers
            .iter()
            .map(|(g, r)| read_group(r, &peeker, g, topics, timeout))
            .collect();
        match snapshots.and_then(|s| families(&s).map_err(Into::into)) {
            Ok(f) => {
                if let Ok(mut slot) = collector.snapshot.write() {
                    *slot = f;
                }
            }
            // The previous snapshot stays, and its last-success time ages: alerts see it.
            Err(e) => tracing::warn!(error = %e, "lag collection failed"),
        }
        let wake = std::time::Instant::now() + interval;
        while std::time::Instant::now() < wake && !shutdown.is_cancelled() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}
