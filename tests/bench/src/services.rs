//! Starting the real binaries with the benchmark's flags, stopping them, and waiting for what
//! they do.

use std::collections::BTreeMap;
use std::time::Duration;

use pipeline_testkit::{scrape_sum, wait_until, Service, TestEnv};

use super::config::Settings;
use super::procstat::{peak_rss_mb, shared_processes, Watched};
use super::statements;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The arguments `relay run` gets. A relay built before its durations took units
/// (`--linger-ms 1` where it is now `--linger 1ms`) gets the flags it knows, so that `--bin-dir`
/// can compare a build with an older one.
pub fn relay_args(settings: &Settings) -> Vec<String> {
    let (linger, poll) = (settings.relay_linger_ms, settings.relay_poll_interval_ms);
    let timing = if relay_takes_milliseconds(settings) {
        [
            "--linger-ms",
            &linger.to_string(),
            "--poll-interval-ms",
            &poll.to_string(),
        ]
        .map(str::to_owned)
    } else {
        [
            "--linger",
            &format!("{linger}ms"),
            "--poll-interval",
            &format!("{poll}ms"),
        ]
        .map(str::to_owned)
    };
    let mut args: Vec<String> = [
        "run",
        "--metrics-listen",
        "127.0.0.1:0",
        "--batch-size",
        &settings.relay_batch_size.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(timing);
    if settings.relay_source != "queue" {
        // The slot is the database's own (`RELAY_SLOT`, set where the relay starts).
        args.extend(["--source".to_owned(), settings.relay_source.clone()]);
    }
    args
}

/// The replication slot of the relay on `env`'s database (`--source wal`): one per database,
/// dropped with it.
fn relay_slot(env: &TestEnv) -> String {
    let name = super::envs::database_name(&env.database_url);
    let slot: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("s_{}", &slot[..slot.len().min(60)])
}

/// Whether the relay in `--bin-dir` names its durations in milliseconds (`--linger-ms`).
fn relay_takes_milliseconds(settings: &Settings) -> bool {
    std::process::Command::new(settings.bin_dir.join("relay"))
        .args(["run", "--help"])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("--linger-ms"))
}

/// The arguments `consumer run` gets for `groups` with `max_batch`.
pub fn consumer_args(env: &TestEnv, groups: &[&str], max_batch: u32) -> Vec<String> {
    let mut args: Vec<String> = vec!["run".into()];
    for g in groups {
        args.extend(["--group".to_owned(), (*g).to_owned()]);
    }
    args.extend(
        [
            "--topic",
            &env.topic,
            "--group-prefix",
            &env.group_prefix,
            "--max-batch",
            &max_batch.to_string(),
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        .map(str::to_owned),
    );
    args
}

/// Starts `bin` with `args` and waits for its `<listening>` log line; returns it with the address.
pub async fn start(
    env: &TestEnv,
    bin: &str,
    label: &str,
    args: &[String],
    listening: &str,
) -> anyhow::Result<(Service, String)> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Each program as its own database role, so the statement profile tells them apart.
    let role_url = match statements::role_of(bin) {
        Some(role) if statements::enabled() => {
            Some(statements::client_url(&env.database_url, role)?)
        }
        _ => None,
    };
    let slot = relay_slot(env);
    let mut extra: Vec<(&str, &str)> = Vec::new();
    if let Some(url) = &role_url {
        extra.push(("DATABASE_URL", url));
    }
    if bin == "relay" {
        extra.push(("RELAY_SLOT", &slot));
    }
    let svc = env.spawn_with_env(bin, label, &args, &extra)?;
    let addr = svc.wait_for_log_value(listening, START_TIMEOUT).await?;
    Ok((svc, addr))
}

/// Starts the order service on a free port; returns it with its base URL.
pub async fn start_order_service(env: &TestEnv) -> anyhow::Result<(Service, String)> {
    let args = ["serve", "--listen", "127.0.0.1:0", "--topic", &env.topic].map(str::to_owned);
    let (svc, addr) = start(
        env,
        "producer",
        "order-service",
        &args,
        "order service listening on ",
    )
    .await?;
    Ok((svc, format!("http://{addr}")))
}

pub async fn start_relay(env: &TestEnv, settings: &Settings) -> anyhow::Result<(Service, String)> {
    let args = relay_args(settings);
    start(env, "relay", "relay", &args, "relay metrics listening on ").await
}

/// Stocks products 1..=`products` with `stock` each (`consumer seed-stock`).
pub fn seed_stock(env: &TestEnv, settings: &Settings) -> anyhow::Result<()> {
    tokio::task::block_in_place(|| {
        env.seed_stock(settings.products, Some(i64::from(settings.stock)))
    })
}

/// Seeds the catalogue (`producer seed-catalog`) and the stock.
pub fn seed_catalog_and_stock(env: &TestEnv, settings: &Settings) -> anyhow::Result<()> {
    tokio::task::block_in_place(|| env.seed_catalog(settings.products))?;
    seed_stock(env, settings)
}

/// Stops a service with SIGTERM; an unclean or slow exit is returned as a note.
pub async fn stop(service: Service) -> Option<String> {
    let label = service.label.clone();
    match service.stop(STOP_TIMEOUT).await {
        Ok(true) => None,
        Ok(false) => Some(format!("{label} exited with an error status after SIGTERM")),
        Err(e) => Some(format!("{label}: {e:#}")),
    }
}

/// The whole pipeline in one environment: order service, relay, consumer running both groups.
pub struct Pipeline {
    pub order_service: Service,
    pub url: String,
    pub relay: Service,
    pub consumer: Service,
    pub consumer_args: Vec<String>,
}

pub const GROUPS: [&str; 2] = ["inventory", "notification"];

impl Pipeline {
    /// Seeds the catalogue and stock, starts the three services and waits until the relay is
    /// active and both groups own every partition.
    pub async fn start(env: &TestEnv, settings: &Settings) -> anyhow::Result<Pipeline> {
        seed_catalog_and_stock(env, settings)?;
        let (order_service, url) = start_order_service(env).await?;
        let (relay, relay_metrics) = start_relay(env, settings).await?;
        let consumer_args = consumer_args(env, &GROUPS, settings.consumer_max_batch);
        let (consumer, consumer_metrics) = start(
            env,
            "consumer",
            "consumer",
            &consumer_args,
            "consumer metrics listening on ",
        )
        .await?;
        let partitions = f64::from(settings.partitions) * GROUPS.len() as f64;
        wait_until(
            "relay active, partitions assigned",
            START_TIMEOUT,
            || async {
                let active = scrape_sum(&relay_metrics, "relay_active", &[]).await?;
                let assigned =
                    scrape_sum(&consumer_metrics, "consumer_assigned_partitions", &[]).await?;
                Ok((active >= 1.0 && assigned >= partitions).then_some(()))
            },
        )
        .await?;
        Ok(Pipeline {
            order_service,
            url: format!("{url}/"),
            relay,
            consumer,
            consumer_args,
        })
    }

    /// The services plus broker, PostgreSQL and the benchmark itself.
    pub fn watched(&self) -> Vec<Watched> {
        let mut w = vec![
            Watched::Pid(
                "order-service",
                self.order_service.pid().as_raw().unsigned_abs(),
            ),
            Watched::Pid("relay", self.relay.pid().as_raw().unsigned_abs()),
            Watched::Pid("consumer", self.consumer.pid().as_raw().unsigned_abs()),
        ];
        w.extend(shared_processes());
        w
    }

    /// Peak resident memory of each service so far.
    pub fn peak_rss(&self) -> BTreeMap<String, f64> {
        peak_rss(&[
            ("order-service", &self.order_service),
            ("relay", &self.relay),
            ("consumer", &self.consumer),
        ])
    }

    /// Stops the consumer, relay and order service; returns notes on unclean exits.
    pub async fn stop(self) -> Vec<String> {
        let mut notes = Vec::new();
        for svc in [self.consumer, self.relay, self.order_service] {
            notes.extend(stop(svc).await);
        }
        notes
    }
}

/// Peak resident memory of named services, in MiB.
pub fn peak_rss(services: &[(&str, &Service)]) -> BTreeMap<String, f64> {
    services
        .iter()
        .filter_map(|(name, svc)| {
            Some((
                (*name).to_owned(),
                peak_rss_mb(svc.pid().as_raw().unsigned_abs())?,
            ))
        })
        .collect()
}

/// A group's lag, read without blocking the runtime's other tasks.
pub fn lag(env: &TestEnv, kind: &str) -> anyhow::Result<Option<i64>> {
    tokio::task::block_in_place(|| env.lag(kind))
}
