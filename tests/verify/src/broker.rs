//! The run's own broker: nisshi on durable PostgreSQL storage (its own database), so that a
//! broker restart loses nothing the broker acknowledged. nisshi reads a `.env` file from its
//! working directory, so it runs in an empty directory of the run.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::Context;
use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::wait_until;

use super::config::Settings;
use super::environment::Environment;
use super::processes::ProcessSpec;

/// The broker's process label.
pub const BROKER: &str = "broker";

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
            &env.broker_storage,
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
