//! The run's own broker: nisshi on durable PostgreSQL storage (its own database), so that a
//! broker restart loses nothing the broker acknowledged (nisshi reads a `.env` file from its
//! working directory, so it runs in an empty directory of the run); or, with `--broker kafka`, a
//! three-node Apache Kafka cluster (see [`super::kafka_cluster`]).

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::Context;
use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::wait_until;

use super::config::Settings;
use super::environment::Environment;
use super::kafka_cluster::KafkaCluster;
use super::processes::{ProcessSpec, Supervisor};

/// The broker's process label (nisshi).
pub const BROKER: &str = "broker";

/// The run's broker.
pub enum Broker {
    /// One nisshi process listening on `addr`.
    Nisshi { addr: SocketAddr },
    /// Three Apache Kafka nodes.
    Kafka(KafkaCluster),
}

impl Broker {
    /// The clients' bootstrap list.
    pub fn bootstrap(&self) -> String {
        match self {
            Broker::Nisshi { addr } => addr.to_string(),
            Broker::Kafka(cluster) => cluster.bootstrap(),
        }
    }

    /// Starts the broker's processes under `supervisor` (formatting a Kafka cluster's storage
    /// first).
    pub async fn start(
        &self,
        settings: &Settings,
        env: &Environment,
        supervisor: &Supervisor,
        inherited: Vec<(String, String)>,
    ) -> anyhow::Result<()> {
        match self {
            Broker::Nisshi { addr } => supervisor.start(spec(settings, env, *addr, inherited)),
            Broker::Kafka(cluster) => {
                cluster.prepare().await?;
                for node in &cluster.nodes {
                    supervisor.start(cluster.spec(node, inherited.clone()))?;
                }
                Ok(())
            }
        }
    }

    /// Waits until the broker serves: nisshi answers a metadata request; every Kafka node
    /// answers and sees all three registered.
    pub async fn wait_until_serving(
        &self,
        kafka: &KafkaArgs,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        match self {
            Broker::Nisshi { addr } => wait_until_serving(*addr, kafka, timeout).await,
            Broker::Kafka(cluster) => cluster.wait_until_serving(timeout).await,
        }
    }

    /// The Kafka cluster, if the run has one.
    pub fn kafka_cluster(&self) -> Option<&KafkaCluster> {
        match self {
            Broker::Nisshi { .. } => None,
            Broker::Kafka(cluster) => Some(cluster),
        }
    }
}

/// How the run's broker is started: listening on `addr`, storing in the run's broker database;
/// `inherited` is what every child inherits.
pub fn spec(
    settings: &Settings,
    env: &Environment,
    addr: SocketAddr,
    inherited: Vec<(String, String)>,
) -> ProcessSpec {
    let url = format!("tcp://{addr}");
    let mut process_env = inherited;
    process_env.push(("RUST_LOG".to_owned(), "warn".to_owned()));
    ProcessSpec {
        label: BROKER.to_owned(),
        program: settings.nisshi.clone(),
        args: [
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            env.broker_storage.as_deref().unwrap_or_default(),
        ]
        .map(str::to_owned)
        .to_vec(),
        env: process_env,
        // nisshi reads a .env file from its working directory: give it an empty one.
        cwd: Some(env.broker_dir.clone()),
        log_path: env.log_dir.join(format!("{BROKER}.log")),
    }
}

fn answers_metadata(kafka: &KafkaArgs) -> anyhow::Result<()> {
    let consumer: rdkafka::consumer::BaseConsumer = kafka
        .client_config()
        .create()
        .context("creating a metadata client")?;
    let _ = rdkafka::consumer::Consumer::fetch_metadata(&consumer, None, Duration::from_secs(2))
        .context("fetching metadata")?;
    Ok(())
}

/// Waits until the broker at `addr` answers a metadata request.
pub async fn wait_until_serving(
    addr: SocketAddr,
    kafka: &KafkaArgs,
    timeout: Duration,
) -> anyhow::Result<()> {
    wait_until("the broker", timeout, || {
        let kafka = kafka.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                // librdkafka would keep retrying a closed port: ask only once it is open.
                if TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err() {
                    return Ok(None);
                }
                answers_metadata(&kafka).map(Some)
            })
            .await?
        }
    })
    .await
}
