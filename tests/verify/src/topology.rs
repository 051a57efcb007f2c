//! The processes of a run and where to reach them: the run's own three-node Apache Kafka cluster
//! (see [`super::kafka_cluster`]), the order service, two relays, and two consumer processes per
//! consumer group (the fault binaries, each with its crash point armed on its own trigger file),
//! plus each group's extra member of a rebalance. One group's members use the classic group
//! protocol, the other's the consumer protocol (KIP-848; see [`group_protocols`]), so that every
//! consumer fault, which hits a member of each group, hits both protocols. Every process gets
//! fixed ports, so restarts keep their addresses.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_core::crash_point::{CONSUMER_AFTER_DB_COMMIT, RELAY_AFTER_DELIVERY};
use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::wait_until;

use super::config::{
    group_protocols, GroupProtocol, Settings, RELAY_LEASE_TTL_MS, RELAY_STANDBY_RETRY_MS,
    SESSION_TIMEOUT_MS,
};
use super::environment::Environment;
use super::kafka_cluster::KafkaCluster;
use super::processes::{ProcessSpec, Supervisor};
use super::proxy::DbProxy;

/// Partitions of the run's topic.
pub const PARTITIONS: i32 = 12;
/// Products of the catalogue the driver orders from: a catalogue of some size, so that stock
/// row locks of concurrent inventory batches do not all collide.
pub const PRODUCTS: u32 = 1_000;
/// Stock of each product: enough that no reservation is rejected for lack of it.
pub const STOCK: i64 = 100_000_000;
pub const ORDER_SERVICE: &str = "order-service";
/// Consumer processes each group runs all along (a rebalance adds one more for a while).
pub const MEMBERS_PER_GROUP: usize = 2;
/// Database connections of each consumer process (one group, half of its partitions).
const CONSUMER_MAX_CONNECTIONS: u32 = 8;
/// The relay and consumer binaries with their crash points armed (built with the others, in
/// the bin directory).
const RELAY_BIN: &str = "relay-crash-points";
const CONSUMER_BIN: &str = "consumer-crash-points";
/// The consumers' dedupe window in the run: the least the setting allows, so that retention
/// removes dedupe rows all through the run and redeliveries past it must be caught as stale by
/// their orders' progress. The effect history (what the checks read) keeps its default window.
pub const RETAIN_DEDUPE: &str = "1m";
/// How often the consumers run retention in the run.
pub const RETENTION_INTERVAL: &str = "5s";

/// The group a consumer process runs, and on which protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupMembership {
    /// The group kind (`inventory`, `notification`).
    pub kind: &'static str,
    pub protocol: GroupProtocol,
}

/// A relay or consumer process.
#[derive(Debug, Clone)]
pub struct Member {
    pub label: String,
    /// Its /metrics, /healthz and /readyz address.
    pub ops: SocketAddr,
    /// The file that fires its crash point.
    pub trigger: PathBuf,
    /// For a consumer process: its group.
    pub group: Option<GroupMembership>,
}

/// The running pipeline.
pub struct Topology {
    pub supervisor: Supervisor,
    pub cluster: KafkaCluster,
    pub order_service: SocketAddr,
    pub relays: Vec<Member>,
    /// Each group's members, group by group.
    pub consumers: Vec<Member>,
    /// Each group's extra member of a rebalance (not running otherwise).
    pub extra_consumers: Vec<Member>,
    /// Each relay's and each consumer's own path to PostgreSQL, by label: a fault cuts one.
    proxies: HashMap<String, DbProxy>,
    http: reqwest::Client,
    consumer_bin: PathBuf,
    consumer_fetch_wait_ms: u64,
    consumer_env: Vec<(String, String)>,
    database_url: String,
    topic: String,
    group_prefix: String,
    log_dir: PathBuf,
}

impl Topology {
    /// Starts the Kafka cluster, creates the topic, seeds catalogue and stock, starts the pipeline and
    /// waits until every process is ready and one relay is active.
    pub async fn start(
        settings: &Settings,
        env: &Environment,
        supervisor: Supervisor,
    ) -> anyhow::Result<Topology> {
        let protocols = group_protocols(settings.seed);
        let mut ports = free_ports(3 + protocols.len() * (MEMBERS_PER_GROUP + 1))?.into_iter();
        let mut next_addr = || -> anyhow::Result<SocketAddr> {
            let port = ports.next().context("out of free ports")?;
            Ok(SocketAddr::from(([127, 0, 0, 1], port)))
        };
        let cluster = KafkaCluster::new(&settings.kafka, env)?;
        let order_service = next_addr()?;
        let member = |label: String, ops: SocketAddr, group: Option<GroupMembership>| Member {
            trigger: env.trigger_dir.join(format!("{label}.trigger")),
            label,
            ops,
            group,
        };
        let relays = vec![
            member("relay-1".to_owned(), next_addr()?, None),
            member("relay-2".to_owned(), next_addr()?, None),
        ];
        let (mut consumers, mut extra_consumers) = (Vec::new(), Vec::new());
        for (kind, protocol) in protocols {
            let group = Some(GroupMembership { kind, protocol });
            for n in 1..=MEMBERS_PER_GROUP {
                consumers.push(member(member_label(kind, n), next_addr()?, group));
            }
            let extra = member_label(kind, MEMBERS_PER_GROUP + 1);
            extra_consumers.push(member(extra, next_addr()?, group));
        }
        let upstream = database_addr(&env.database_url).await?;
        let mut proxies = HashMap::new();
        for m in relays.iter().chain(&consumers) {
            let _ = proxies.insert(m.label.clone(), DbProxy::start(upstream).await?);
        }
        let topology = Topology {
            supervisor,
            cluster,
            order_service,
            relays,
            consumers,
            extra_consumers,
            proxies,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .context("building the probe HTTP client")?,
            consumer_bin: settings.bin_dir.join(CONSUMER_BIN),
            consumer_fetch_wait_ms: settings.consumer_fetch_wait_ms,
            consumer_env: settings.consumer_env.clone(),
            database_url: env.database_url.clone(),
            topic: env.topic.clone(),
            group_prefix: env.group_prefix.clone(),
            log_dir: env.log_dir.clone(),
        };
        for bin in [
            settings.bin_dir.join("producer"),
            settings.bin_dir.join(RELAY_BIN),
            topology.consumer_bin.clone(),
        ] {
            if !bin.exists() {
                bail!("{} is missing: build the binaries first", bin.display());
            }
        }

        topology.cluster.prepare().await?;
        for node in &topology.cluster.nodes {
            topology
                .supervisor
                .start(topology.cluster.spec(node, base_env()))?;
        }
        topology.wait_for_broker(Duration::from_secs(180)).await?;
        let kafka = topology.kafka();
        let topic = env.topic.clone();
        wait_until("the run's topic", Duration::from_secs(60), || async {
            kafka
                .ensure_topics(std::slice::from_ref(&topic), PARTITIONS)
                .await?;
            Ok(Some(()))
        })
        .await?;
        // Created with the brokers' default replication factor: all three, all in sync.
        let cluster = &topology.cluster;
        wait_until(
            "the run's topic on every node",
            Duration::from_secs(30),
            || async { cluster.check_topic(&topic).await.map(Some) },
        )
        .await?;
        topology.seed(settings).await?;

        topology.supervisor.start(ProcessSpec {
            label: ORDER_SERVICE.to_owned(),
            program: settings.bin_dir.join("producer"),
            args: strings(&[
                "serve",
                "--listen",
                &order_service.to_string(),
                "--topic",
                &env.topic,
            ]),
            env: topology.pipeline_env(ORDER_SERVICE, 10, None),
            cwd: None,
            log_path: topology.log_path(ORDER_SERVICE),
        })?;
        for relay in &topology.relays {
            topology.supervisor.start(ProcessSpec {
                label: relay.label.clone(),
                program: settings.bin_dir.join(RELAY_BIN),
                args: strings(&[
                    "run",
                    "--metrics-listen",
                    &relay.ops.to_string(),
                    "--lease-ttl",
                    &format!("{RELAY_LEASE_TTL_MS}ms"),
                    "--standby-retry",
                    &format!("{RELAY_STANDBY_RETRY_MS}ms"),
                    "--source",
                    settings.relay_source.as_str(),
                    "--slot",
                    &env.slot(),
                ]),
                env: topology.pipeline_env(
                    &relay.label,
                    6,
                    Some((RELAY_AFTER_DELIVERY, &relay.trigger)),
                ),
                cwd: None,
                log_path: topology.log_path(&relay.label),
            })?;
        }
        for consumer in &topology.consumers {
            topology
                .supervisor
                .start(topology.consumer_spec(consumer)?)?;
        }
        wait_until(
            "every process ready and one relay active",
            Duration::from_secs(90),
            || async {
                Ok(
                    (topology.all_ready().await && topology.active_relay().await.is_some())
                        .then_some(()),
                )
            },
        )
        .await?;
        Ok(topology)
    }

    /// Client settings for the run's Kafka cluster.
    pub fn kafka(&self) -> KafkaArgs {
        KafkaArgs {
            kafka_brokers: self.cluster.bootstrap(),
            kafka_options: Vec::new(),
        }
    }

    /// The order service's base URL.
    pub fn order_service_url(&self) -> String {
        format!("http://{}", self.order_service)
    }

    fn log_path(&self, label: &str) -> PathBuf {
        self.log_dir.join(format!("{label}.log"))
    }

    /// Cuts `label`'s path to PostgreSQL (see [`DbProxy`]); `false` when it has no proxy.
    pub fn cut_database(&self, label: &str) -> bool {
        self.proxies.get(label).map(DbProxy::cut).is_some()
    }

    /// Restores every cut path to PostgreSQL.
    pub fn restore_databases(&self) {
        for proxy in self.proxies.values() {
            proxy.restore();
        }
    }

    /// The database URL `label` connects with: through its proxy when it has one.
    fn database_url_for(&self, label: &str) -> String {
        match self.proxies.get(label) {
            Some(proxy) => with_authority(&self.database_url, &proxy.addr().to_string()),
            None => self.database_url.clone(),
        }
    }

    /// What every pipeline binary gets, with its crash point armed when given.
    fn pipeline_env(
        &self,
        label: &str,
        max_connections: u32,
        crash_point: Option<(&str, &Path)>,
    ) -> Vec<(String, String)> {
        let mut env = base_env();
        env.extend([
            ("DATABASE_URL".to_owned(), self.database_url_for(label)),
            (
                "DATABASE_MAX_CONNECTIONS".to_owned(),
                max_connections.to_string(),
            ),
            ("KAFKA_BROKERS".to_owned(), self.cluster.bootstrap()),
            ("RUST_LOG".to_owned(), "info".to_owned()),
        ]);
        if let Some((point, trigger)) = crash_point {
            env.push(("PIPELINE_CRASH_AT".to_owned(), point.to_owned()));
            env.push((
                "PIPELINE_CRASH_TRIGGER".to_owned(),
                trigger.display().to_string(),
            ));
        }
        env
    }

    /// A consumer process running its member's group on the group's protocol, with its crash
    /// point armed.
    pub fn consumer_spec(&self, member: &Member) -> anyhow::Result<ProcessSpec> {
        let group = member
            .group
            .with_context(|| format!("{} is not a consumer", member.label))?;
        let args = strings(&[
            "run",
            "--group",
            group.kind,
            "--group-protocol",
            group.protocol.as_str(),
            "--topic",
            &self.topic,
            "--group-prefix",
            &self.group_prefix,
            "--metrics-listen",
            &member.ops.to_string(),
            "--session-timeout",
            &format!("{SESSION_TIMEOUT_MS}ms"),
            "--fetch-wait-max",
            &format!("{}ms", self.consumer_fetch_wait_ms),
            "--lag-interval",
            "0s",
            "--retention-interval",
            RETENTION_INTERVAL,
            "--retain-dedupe",
            RETAIN_DEDUPE,
        ]);
        Ok(ProcessSpec {
            label: member.label.clone(),
            program: self.consumer_bin.clone(),
            args,
            env: {
                let mut env = self.pipeline_env(
                    &member.label,
                    CONSUMER_MAX_CONNECTIONS,
                    Some((CONSUMER_AFTER_DB_COMMIT, &member.trigger)),
                );
                // Later entries win: the extra environment overrides the defaults.
                env.extend(self.consumer_env.iter().cloned());
                env
            },
            cwd: None,
            log_path: self.log_path(&member.label),
        })
    }

    /// The `index`-th member of each group (what a consumer fault hits).
    pub fn member_of_each_group(&self, index: usize) -> Vec<&Member> {
        self.consumers
            .chunks(MEMBERS_PER_GROUP)
            .map(|members| &members[index % members.len()])
            .collect()
    }

    /// The members of the group `member` belongs to.
    pub fn group_members(&self, member: &Member) -> Vec<&Member> {
        self.consumers
            .iter()
            .filter(|m| m.group.is_some() && m.group == member.group)
            .collect()
    }

    async fn seed(&self, settings: &Settings) -> anyhow::Result<()> {
        let products = PRODUCTS.to_string();
        let stock = STOCK.to_string();
        let steps: [(PathBuf, Vec<&str>); 2] = [
            (
                settings.bin_dir.join("producer"),
                vec!["seed-catalog", "--products", &products],
            ),
            (
                self.consumer_bin.clone(),
                vec!["seed-stock", "--products", &products, "--quantity", &stock],
            ),
        ];
        for (program, args) in steps {
            let run = tokio::process::Command::new(&program)
                .args(&args)
                .env_clear()
                .envs(self.pipeline_env("seed", 2, None))
                .output();
            let out = tokio::time::timeout(Duration::from_secs(60), run)
                .await
                .with_context(|| format!("{} {args:?} timed out", program.display()))?
                .with_context(|| format!("running {}", program.display()))?;
            if !out.status.success() {
                bail!(
                    "{} {args:?} failed: {}",
                    program.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Ok(())
    }

    /// Waits until every Kafka node answers a metadata request and sees all three.
    pub async fn wait_for_broker(&self, timeout: Duration) -> anyhow::Result<()> {
        self.cluster.wait_until_serving(timeout).await
    }

    /// Whether a process's /readyz answers 200.
    pub async fn ready(&self, ops: SocketAddr) -> bool {
        match self.http.get(format!("http://{ops}/readyz")).send().await {
            Ok(response) => response.status().is_success(),
            Err(_) => false,
        }
    }

    /// Whether the order service, both relays and every group's members are up and ready.
    pub async fn all_ready(&self) -> bool {
        let mut ops = vec![self.order_service];
        ops.extend(self.relays.iter().map(|m| m.ops));
        ops.extend(self.consumers.iter().map(|m| m.ops));
        for addr in ops {
            if !self.ready(addr).await {
                return false;
            }
        }
        true
    }

    /// The sum of a metric's samples on a process's /metrics (with a timeout, unlike the
    /// harness's scrape: a frozen process must not hang the run).
    pub async fn scrape(&self, ops: SocketAddr, metric: &str) -> anyhow::Result<f64> {
        let addr = ops.to_string();
        tokio::time::timeout(
            Duration::from_secs(2),
            pipeline_testkit::scrape_sum(&addr, metric, &[]),
        )
        .await
        .with_context(|| format!("scraping {addr} timed out"))?
    }

    /// The relay that reports `relay_active 1`, if exactly one does.
    pub async fn active_relay(&self) -> Option<&Member> {
        let mut active = Vec::new();
        for relay in &self.relays {
            if self.supervisor.is_up(&relay.label)
                && self.scrape(relay.ops, "relay_active").await.ok() == Some(1.0)
            {
                active.push(relay);
            }
        }
        match active.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

/// The label of group `kind`'s `n`-th consumer process (from 1; the one after
/// [`MEMBERS_PER_GROUP`] joins for a rebalance).
pub fn member_label(kind: &str, n: usize) -> String {
    format!("{kind}-{n}")
}

/// The environment children inherit: only what finding programs and a home needs, so stray
/// settings of the caller (RELAY_*, CONSUMER_*, METRICS_LISTEN…) cannot change the run.
fn base_env() -> Vec<(String, String)> {
    ["PATH", "HOME", "LANG", "RUST_BACKTRACE"]
        .into_iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_owned(), v)))
        .collect()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// The host and port PostgreSQL listens on, from a database URL.
async fn database_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let options: sqlx::postgres::PgConnectOptions =
        url.parse().context("parsing the run's database URL")?;
    let host = format!("{}:{}", options.get_host(), options.get_port());
    let mut addrs = tokio::net::lookup_host(host)
        .await
        .context("resolving PostgreSQL's address")?;
    addrs.next().context("PostgreSQL's host has no address")
}

/// `url` with its host and port replaced by `authority`.
fn with_authority(url: &str, authority: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let host_start = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    format!("{}{authority}{}", &url[..host_start], &url[end..])
}

/// Where the run's listening ports are taken from: below the system's ephemeral range
/// (32768–60999 by default), so that no outgoing connection of the run (the clients' connections
/// to Kafka and PostgreSQL) takes a port between the moment it is found free and the moment its
/// process listens on it, and below the Kafka nodes' ports (29092 and up).
const PORTS: std::ops::Range<u16> = 20_000..29_000;

/// `n` distinct ports free right now (bound all at once, then released), from [`PORTS`],
/// starting at a place that varies with the process id so that successive runs spread out.
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let span = PORTS.end - PORTS.start;
    let start = (std::process::id() % u32::from(span)) as u16;
    let mut listeners = Vec::with_capacity(n);
    for i in 0..span {
        if listeners.len() == n {
            break;
        }
        let port = PORTS.start + (start + i) % span;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            listeners.push(l);
        }
    }
    anyhow::ensure!(
        listeners.len() == n,
        "finding {n} free ports between {} and {}",
        PORTS.start,
        PORTS.end
    );
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::with_authority;

    #[test]
    fn the_proxy_replaces_host_and_port_only() {
        assert_eq!(
            with_authority(
                "postgres://postgres@127.0.0.1:5432/db?sslmode=disable",
                "127.0.0.1:7"
            ),
            "postgres://postgres@127.0.0.1:7/db?sslmode=disable"
        );
        assert_eq!(
            with_authority("postgres://u:p@db.internal/x", "127.0.0.1:7"),
            "postgres://u:p@127.0.0.1:7/x"
        );
    }
}
