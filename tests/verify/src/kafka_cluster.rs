//! The run's own Apache Kafka cluster: three nodes in KRaft combined mode
//! (each a broker and one of three controller voters), every topic replicated on all three with
//! `min.insync.replicas=2`, so that an event the relay saw acknowledged (`acks=all`) is on at
//! least two nodes and survives the loss of its partition's leader.
//!
//! Each node gets its own ports (fixed for the run: see `--kafka-base-port`), configuration and
//! data directory under the run's work directory (`broker/node-<id>`) and its own log
//! (`logs/kafka-<id>.log`); the nodes are formatted with one cluster id and started by the run's
//! supervisor, which starts a killed node again with its data. The configuration comes from
//! deploy/kafka/cluster.properties.in; the JVM from `--kafka-java`, the jars from `--kafka-jars`.
//!
//! The cluster is observed through each node's own metadata client: which nodes are registered
//! and unfenced, which node leads each partition, and which replicas are in sync.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::wait_until;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio::time::Instant;

use super::config::{KafkaSettings, KAFKA_SESSION_TIMEOUT_MS};
use super::environment::Environment;
use super::processes::ProcessSpec;

/// Nodes of the cluster.
pub const NODES: usize = 3;
/// Replicas of every topic (the brokers' `default.replication.factor`).
pub const REPLICATION_FACTOR: usize = 3;
/// In-sync replicas a write needs (`min.insync.replicas`).
pub const MIN_INSYNC_REPLICAS: usize = 2;
/// Partitions of a topic created on first use.
const AUTO_CREATED_PARTITIONS: i32 = 4;
/// The configuration template, in `--kafka-config-dir`.
pub const TEMPLATE: &str = "cluster.properties.in";
/// The nodes' log4j2 configuration, in `--kafka-config-dir`.
pub const LOG4J: &str = "log4j2-cluster.properties";
const HOST: &str = "127.0.0.1";
/// How long one metadata request may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the cluster's state is polled while waiting for a change.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// The process label of node `id`.
pub fn label(id: i32) -> String {
    format!("kafka-{id}")
}

/// Every node's process label.
pub fn labels() -> Vec<String> {
    (1..=NODES as i32).map(label).collect()
}

/// One node of the cluster.
#[derive(Debug, Clone)]
pub struct KafkaNode {
    pub id: i32,
    pub label: String,
    /// The clients' listener.
    pub addr: SocketAddr,
    /// The KRaft controller listener.
    pub controller_addr: SocketAddr,
    /// Its configuration and data directory.
    pub dir: PathBuf,
}

impl KafkaNode {
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("server.properties")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }
}

/// The run's cluster.
pub struct KafkaCluster {
    pub nodes: Vec<KafkaNode>,
    settings: KafkaSettings,
    log_dir: PathBuf,
    /// One metadata client per node, bootstrapped on that node alone.
    observers: Vec<Arc<BaseConsumer>>,
}

/// What a node said about the cluster.
#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    /// The node that answered.
    pub from: i32,
    /// Registered, unfenced brokers.
    pub brokers: Vec<i32>,
    pub partitions: Vec<PartitionView>,
}

/// One partition's leader and replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionView {
    pub topic: String,
    pub partition: i32,
    /// -1 when it has none.
    pub leader: i32,
    pub replicas: Vec<i32>,
    pub isr: Vec<i32>,
}

impl ClusterView {
    /// The partitions of `topic`.
    pub fn topic<'a>(&'a self, topic: &'a str) -> impl Iterator<Item = &'a PartitionView> + 'a {
        self.partitions.iter().filter(move |p| p.topic == topic)
    }

    /// How many partitions of `topic` each broker leads.
    pub fn leaders(&self, topic: &str) -> BTreeMap<i32, usize> {
        let mut led = BTreeMap::new();
        for p in self.topic(topic).filter(|p| p.leader >= 0) {
            *led.entry(p.leader).or_default() += 1;
        }
        led
    }

    /// The node leading most partitions of `topic`; among equals, the `turn`-th (so that
    /// successive faults spread over the nodes), and `None` when no partition has a leader.
    pub fn busiest_leader(&self, topic: &str, turn: usize) -> Option<(i32, usize)> {
        let led = self.leaders(topic);
        let most = *led.values().max()?;
        let busiest: Vec<i32> = led
            .iter()
            .filter(|(_, n)| **n == most)
            .map(|(id, _)| *id)
            .collect();
        Some((busiest[turn % busiest.len()], most))
    }

    /// Whether every partition of `topic` has a leader other than `node`.
    pub fn led_without(&self, topic: &str, node: i32) -> bool {
        let mut partitions = self.topic(topic).peekable();
        partitions.peek().is_some() && partitions.all(|p| p.leader >= 0 && p.leader != node)
    }

    /// Whether `node` is registered and in the ISR of every partition it replicates, and every
    /// partition has a leader.
    pub fn in_sync(&self, node: i32) -> bool {
        self.brokers.contains(&node)
            && !self.partitions.is_empty()
            && self
                .partitions
                .iter()
                .all(|p| p.leader >= 0 && (!p.replicas.contains(&node) || p.isr.contains(&node)))
    }

    /// Partitions with fewer in-sync replicas than replicas, as `topic/partition isr [..]`.
    pub fn under_replicated(&self) -> Vec<String> {
        self.partitions
            .iter()
            .filter(|p| p.isr.len() < p.replicas.len())
            .map(|p| format!("{}/{} isr {:?}", p.topic, p.partition, p.isr))
            .collect()
    }
}

impl KafkaCluster {
    /// The cluster's nodes, ports and directories (nothing started yet).
    pub fn new(settings: &KafkaSettings, env: &Environment) -> anyhow::Result<KafkaCluster> {
        let nodes = (1..=NODES as i32)
            .map(|id| {
                let offset = u16::try_from(id - 1)? * 100;
                let port = settings.base_port + offset;
                Ok(KafkaNode {
                    id,
                    label: label(id),
                    addr: SocketAddr::from(([127, 0, 0, 1], port)),
                    controller_addr: SocketAddr::from(([127, 0, 0, 1], port + 1)),
                    dir: node_dir(&env.broker_dir, id),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let bootstrap = |node: &KafkaNode| KafkaArgs {
            kafka_brokers: node.addr.to_string(),
            kafka_options: Vec::new(),
        };
        let observers = nodes
            .iter()
            .map(|node| {
                bootstrap(node)
                    .client_config()
                    .set("socket.timeout.ms", "2000")
                    .set("socket.connection.setup.timeout.ms", "2000")
                    .set("reconnect.backoff.max.ms", "500")
                    .create::<BaseConsumer>()
                    .map(Arc::new)
                    .with_context(|| format!("creating a metadata client for {}", node.label))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(KafkaCluster {
            nodes,
            settings: settings.clone(),
            log_dir: env.log_dir.clone(),
            observers,
        })
    }

    /// The clients' bootstrap list: every node.
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.addr.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn node(&self, id: i32) -> anyhow::Result<&KafkaNode> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .with_context(|| format!("no Kafka node {id}"))
    }

    /// `1@host:port,2@host:port,3@host:port`.
    fn voters(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("{}@{}", n.id, n.controller_addr))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Checks the ports are free and the jars there, writes each node's configuration and formats
    /// its storage (one cluster id for all).
    pub async fn prepare(&self) -> anyhow::Result<()> {
        let has_jars = std::fs::read_dir(&self.settings.jars)
            .with_context(|| format!("reading --kafka-jars {}", self.settings.jars.display()))?
            .filter_map(Result::ok)
            .any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.starts_with("kafka_2.13-") && name.ends_with(".jar")
            });
        if !has_jars {
            bail!(
                "{} holds no kafka_2.13-*.jar (scripts/kafka.sh fetch fills it)",
                self.settings.jars.display()
            );
        }
        for node in &self.nodes {
            for addr in [node.addr, node.controller_addr] {
                if TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok() {
                    bail!(
                        "{addr} (for {}) is already in use: an earlier run's Kafka node? \
                         (`ss -ltnp 'sport = :{}'` shows it; or choose --kafka-base-port)",
                        node.label,
                        addr.port()
                    );
                }
            }
        }
        let template_path = self.settings.config_dir.join(TEMPLATE);
        let template = std::fs::read_to_string(&template_path)
            .with_context(|| format!("reading {}", template_path.display()))?;
        let cluster_id = new_cluster_id();
        let voters = self.voters();
        // Formatted side by side: each is a JVM start.
        let mut formats = Vec::new();
        for node in &self.nodes {
            std::fs::create_dir_all(node.data_dir())
                .with_context(|| format!("creating {}", node.data_dir().display()))?;
            let config = render(
                &template,
                &[
                    ("NODE_ID", node.id.to_string()),
                    ("HOST", HOST.to_owned()),
                    ("PORT", node.addr.port().to_string()),
                    ("CONTROLLER_PORT", node.controller_addr.port().to_string()),
                    ("VOTERS", voters.clone()),
                    ("DATA_DIR", node.data_dir().display().to_string()),
                    ("PARTITIONS", AUTO_CREATED_PARTITIONS.to_string()),
                    ("SESSION_MS", KAFKA_SESSION_TIMEOUT_MS.to_string()),
                ],
            )?;
            std::fs::write(node.config_path(), config)
                .with_context(|| format!("writing {}", node.config_path().display()))?;
            let log = self.log_path(node);
            let out = std::fs::File::create(&log)
                .with_context(|| format!("creating {}", log.display()))?;
            let child = tokio::process::Command::new(&self.settings.java)
                .arg("-Xmx256m")
                .arg(format!(
                    "-Dlog4j2.configurationFile={}",
                    self.log4j().display()
                ))
                .arg("-cp")
                .arg(self.classpath())
                .args(["kafka.tools.StorageTool", "format", "--cluster-id"])
                .arg(&cluster_id)
                .arg("--config")
                .arg(node.config_path())
                .stdin(std::process::Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| {
                    format!(
                        "running {} (--kafka-java) to format {}'s storage",
                        self.settings.java.display(),
                        node.label
                    )
                })?;
            formats.push((node, child));
        }
        for (node, mut child) in formats {
            let status = tokio::time::timeout(Duration::from_secs(120), child.wait())
                .await
                .with_context(|| format!("formatting {}'s storage timed out", node.label))??;
            if !status.success() {
                bail!(
                    "formatting {}'s storage failed ({status}; see {})",
                    node.label,
                    self.log_path(node).display()
                );
            }
        }
        Ok(())
    }

    fn classpath(&self) -> String {
        format!("{}/*", self.settings.jars.display())
    }

    fn log4j(&self) -> PathBuf {
        self.settings.config_dir.join(LOG4J)
    }

    fn log_path(&self, node: &KafkaNode) -> PathBuf {
        self.log_dir.join(format!("{}.log", node.label))
    }

    /// How node `node` is started (and started again, with its data, after a kill).
    pub fn spec(&self, node: &KafkaNode, inherited: Vec<(String, String)>) -> ProcessSpec {
        // `nice` runs java in its own process (the node's pid is java's); when it may not raise
        // the priority it says so on the node's log and runs java anyway.
        let mut args = vec![
            "-n".to_owned(),
            self.settings.nice.to_string(),
            self.settings.java.display().to_string(),
        ];
        args.extend(self.settings.heap_opts.iter().cloned());
        if let Some(archive) = &self.settings.class_archive {
            args.push(format!("-XX:SharedArchiveFile={}", archive.display()));
        }
        args.extend(
            [
                "-XX:+UseG1GC",
                "-XX:MaxGCPauseMillis=20",
                "-XX:InitiatingHeapOccupancyPercent=35",
                "-XX:+ExplicitGCInvokesConcurrent",
                "-XX:+ExitOnOutOfMemoryError",
                "-Djava.awt.headless=true",
            ]
            .map(str::to_owned),
        );
        args.extend([
            format!("-Dlog4j2.configurationFile={}", self.log4j().display()),
            format!("-Dkafka.root.log.level={}", self.settings.log_level),
            "-cp".to_owned(),
            self.classpath(),
            "kafka.Kafka".to_owned(),
            node.config_path().display().to_string(),
        ]);
        ProcessSpec {
            label: node.label.clone(),
            program: PathBuf::from("nice"),
            args,
            env: inherited,
            cwd: Some(node.dir.clone()),
            log_path: self.log_path(node),
        }
    }

    /// What node `id` says about the cluster (one metadata request, blocking in a worker).
    pub async fn view_from(&self, id: i32) -> anyhow::Result<ClusterView> {
        let index = self
            .nodes
            .iter()
            .position(|n| n.id == id)
            .with_context(|| format!("no Kafka node {id}"))?;
        let (observer, addr) = (self.observers[index].clone(), self.nodes[index].addr);
        tokio::task::spawn_blocking(move || {
            // librdkafka would keep retrying a closed port: ask only once it is open.
            TcpStream::connect_timeout(&addr, Duration::from_millis(300))
                .with_context(|| format!("connecting to {addr}"))?;
            let metadata = observer
                .fetch_metadata(None, METADATA_TIMEOUT)
                .with_context(|| format!("metadata from {addr}"))?;
            let mut view = ClusterView {
                from: id,
                brokers: metadata.brokers().iter().map(|b| b.id()).collect(),
                partitions: Vec::new(),
            };
            for topic in metadata.topics() {
                for p in topic.partitions() {
                    view.partitions.push(PartitionView {
                        topic: topic.name().to_owned(),
                        partition: p.id(),
                        leader: p.leader(),
                        replicas: p.replicas().to_vec(),
                        isr: p.isr().to_vec(),
                    });
                }
            }
            Ok(view)
        })
        .await?
    }

    /// The cluster as the first node other than `except` that answers sees it.
    pub async fn view(&self, except: Option<i32>) -> anyhow::Result<ClusterView> {
        let mut errors = Vec::new();
        for node in self.nodes.iter().filter(|n| Some(n.id) != except) {
            match self.view_from(node.id).await {
                Ok(view) => return Ok(view),
                Err(e) => errors.push(format!("{}: {e:#}", node.label)),
            }
        }
        bail!("no Kafka node answered: {}", errors.join("; "))
    }

    /// Waits until every node answers and sees all of them registered and unfenced.
    pub async fn wait_until_serving(&self, timeout: Duration) -> anyhow::Result<()> {
        wait_until("every Kafka node serving", timeout, || async {
            for node in &self.nodes {
                let view = self.view_from(node.id).await?;
                if view.brokers.len() < NODES {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await
    }

    /// Waits, until `until`, for every partition of `topic` to be led by a node other than
    /// `node` (asking the others); when that happened, or `None`.
    pub async fn wait_failover(&self, topic: &str, node: i32, until: Instant) -> Option<Instant> {
        while Instant::now() < until {
            if let Ok(view) = self.view(Some(node)).await {
                if view.led_without(topic, node) {
                    return Some(Instant::now());
                }
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
        None
    }

    /// Waits until `node` is registered again and in the ISR of every partition it replicates.
    pub async fn wait_in_sync(&self, node: i32, timeout: Duration) -> anyhow::Result<()> {
        let label = label(node);
        let last = std::sync::Mutex::new(Vec::new());
        let last = &last;
        let result = wait_until(
            &format!("{label} back in sync"),
            timeout,
            move || async move {
                let view = self.view(None).await?;
                if view.in_sync(node) {
                    return Ok(Some(()));
                }
                *last.lock().unwrap_or_else(PoisonError::into_inner) = view.under_replicated();
                Ok(None)
            },
        )
        .await;
        let last = last.lock().unwrap_or_else(PoisonError::into_inner).clone();
        result.with_context(|| format!("under-replicated: {}", last.join(", ")))
    }

    /// Checks that every partition of `topic` has [`REPLICATION_FACTOR`] replicas, all in sync.
    pub async fn check_topic(&self, topic: &str) -> anyhow::Result<()> {
        let view = self.view(None).await?;
        let partitions: Vec<&PartitionView> = view.topic(topic).collect();
        if partitions.is_empty() {
            bail!("the cluster does not know topic {topic}");
        }
        for p in partitions {
            if p.replicas.len() != REPLICATION_FACTOR || p.isr.len() != REPLICATION_FACTOR {
                bail!(
                    "{topic}/{} has replicas {:?} and ISR {:?}: expected {REPLICATION_FACTOR} of \
                     each (is default.replication.factor 3 in {}?)",
                    p.partition,
                    p.replicas,
                    p.isr,
                    self.settings.config_dir.join(TEMPLATE).display()
                );
            }
        }
        Ok(())
    }
}

/// Node `id`'s configuration and data directory.
fn node_dir(broker_dir: &Path, id: i32) -> PathBuf {
    broker_dir.join(format!("node-{id}"))
}

/// Removes every node's data under the run's broker directory (after the run, unless kept).
pub fn remove_data(broker_dir: &Path) -> anyhow::Result<()> {
    for id in 1..=NODES as i32 {
        let dir = node_dir(broker_dir, id).join("data");
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
        }
    }
    Ok(())
}

/// `template` with each `@NAME@` replaced; fails on a placeholder left over.
pub fn render(template: &str, values: &[(&str, String)]) -> anyhow::Result<String> {
    let mut out = template.to_owned();
    for (name, value) in values {
        out = out.replace(&format!("@{name}@"), value);
    }
    let leftover: Vec<&str> = out
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && has_placeholder(l))
        .collect();
    if !leftover.is_empty() {
        bail!("placeholders left in the configuration: {leftover:?}");
    }
    Ok(out)
}

/// Whether `line` holds an `@NAME@` (upper case letters and underscores between two `@`).
fn has_placeholder(line: &str) -> bool {
    line.split('@')
        .skip(1)
        .collect::<Vec<_>>()
        .split_last()
        .is_some_and(|(_, inner)| {
            inner
                .iter()
                .any(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'))
        })
}

/// A new cluster id: 16 random bytes in Kafka's base64url form (22 characters), not starting
/// with '-' (the storage tool would take it for an option).
pub fn new_cluster_id() -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    loop {
        let bytes: [u8; 16] = rand::random();
        let mut bits: u32 = 0;
        let mut count = 0;
        let mut id = String::with_capacity(22);
        for b in bytes {
            bits = (bits << 8) | u32::from(b);
            count += 8;
            while count >= 6 {
                count -= 6;
                id.push(char::from(ALPHABET[((bits >> count) & 63) as usize]));
            }
        }
        if count > 0 {
            id.push(char::from(ALPHABET[((bits << (6 - count)) & 63) as usize]));
        }
        if !id.starts_with('-') {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(topic: &str, partition: i32, leader: i32, isr: &[i32]) -> PartitionView {
        PartitionView {
            topic: topic.to_owned(),
            partition,
            leader,
            replicas: vec![1, 2, 3],
            isr: isr.to_vec(),
        }
    }

    fn view() -> ClusterView {
        ClusterView {
            from: 1,
            brokers: vec![1, 2, 3],
            partitions: vec![
                partition("t", 0, 1, &[1, 2, 3]),
                partition("t", 1, 2, &[1, 2, 3]),
                partition("t", 2, 2, &[2, 3]),
                partition("t", 3, 3, &[1, 2, 3]),
                partition("t", 4, 1, &[1, 3]),
                partition("other", 0, 3, &[1, 2, 3]),
            ],
        }
    }

    #[test]
    fn the_busiest_leader_takes_turns_among_equals() {
        let v = view();
        assert_eq!(v.leaders("t"), BTreeMap::from([(1, 2), (2, 2), (3, 1)]));
        assert_eq!(v.busiest_leader("t", 0), Some((1, 2)));
        assert_eq!(v.busiest_leader("t", 1), Some((2, 2)));
        assert_eq!(v.busiest_leader("t", 2), Some((1, 2)));
        assert_eq!(v.busiest_leader("none", 0), None);
    }

    #[test]
    fn failover_and_sync_are_read_from_leaders_and_isrs() {
        let mut v = view();
        assert!(!v.led_without("t", 1));
        assert!(v.led_without("t", 4));
        assert!(
            !v.led_without("none", 1),
            "an unknown topic has not failed over"
        );
        for p in &mut v.partitions {
            if p.leader == 1 {
                p.leader = 3;
            }
        }
        assert!(v.led_without("t", 1));
        assert!(!v.in_sync(2), "2 is missing from t/4's ISR");
        assert!(!v.in_sync(1), "1 is missing from t/2's ISR");
        assert!(v.in_sync(3));
        assert_eq!(
            v.under_replicated(),
            vec!["t/2 isr [2, 3]", "t/4 isr [1, 3]"]
        );
        v.brokers = vec![1, 2];
        assert!(!v.in_sync(3), "a fenced node is not in sync");
        v.partitions[0].leader = -1;
        assert!(!v.in_sync(1) && !v.led_without("t", 2));
    }

    #[test]
    fn cluster_ids_look_like_kafkas() {
        for _ in 0..200 {
            let id = new_cluster_id();
            assert_eq!(id.len(), 22);
            assert!(!id.starts_with('-'));
            assert!(id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        }
    }

    #[test]
    fn the_template_renders_every_placeholder() {
        let template = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/kafka/cluster.properties.in"
        ))
        .expect("deploy/kafka/cluster.properties.in");
        let values = [
            ("NODE_ID", "2".to_owned()),
            ("HOST", "127.0.0.1".to_owned()),
            ("PORT", "29192".to_owned()),
            ("CONTROLLER_PORT", "29193".to_owned()),
            ("VOTERS", "1@127.0.0.1:29093,2@127.0.0.1:29193".to_owned()),
            ("DATA_DIR", "/tmp/x".to_owned()),
            ("PARTITIONS", "4".to_owned()),
        ];
        assert!(
            render(&template, &values).is_err(),
            "SESSION_MS is left over"
        );
        let mut values = values.to_vec();
        values.push(("SESSION_MS", "6000".to_owned()));
        let config = render(&template, &values).expect("every placeholder replaced");
        let setting = |key: &str| {
            config
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{key}=")))
                .map(str::to_owned)
        };
        assert_eq!(setting("node.id").as_deref(), Some("2"));
        assert_eq!(setting("default.replication.factor").as_deref(), Some("3"));
        assert_eq!(setting("min.insync.replicas").as_deref(), Some("2"));
        assert_eq!(
            setting("offsets.topic.replication.factor").as_deref(),
            Some("3")
        );
        assert_eq!(
            setting("unclean.leader.election.enable").as_deref(),
            Some("false")
        );
        assert_eq!(
            setting("listeners").as_deref(),
            Some("PLAINTEXT://127.0.0.1:29192,CONTROLLER://127.0.0.1:29193")
        );
        assert!(!config
            .lines()
            .any(|l| !l.starts_with('#') && l.contains('@') && !l.contains("quorum.voters")));
    }
}
