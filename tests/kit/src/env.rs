//! One isolated environment for a test: a fresh migrated database, a topic of its own, a prefix
//! for its consumer groups and a log folder; the real binaries started in it.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pipeline_core::kafka::KafkaArgs;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db::{create_database, drop_database, server_url};
use crate::kafka::{brokers, committed_lag, kafka_args};
use crate::service::{bin_dir, Service};
use crate::wait::wait_until;

/// Longest a seeding command may take.
const SEED_TIMEOUT: Duration = Duration::from_secs(60);

/// One isolated environment: a fresh database, topic and group prefix.
pub struct TestEnv {
    pub name: String,
    pub database_url: String,
    pub topic: String,
    pub group_prefix: String,
    pub brokers: String,
    pub log_dir: PathBuf,
    pub pool: PgPool,
    /// `KAFKA_OPTIONS` of every binary and of the test's own clients.
    pub kafka_options: Vec<(String, String)>,
    /// The database's name, dropped with the environment when the test passed.
    database: String,
}

/// How an environment's binaries reach PostgreSQL and Kafka, when not as the other tests do.
pub struct Transport {
    /// The brokers.
    pub brokers: String,
    /// Their client settings (`KAFKA_OPTIONS`).
    pub kafka_options: Vec<(String, String)>,
    /// The host name the binaries reach the test server by (its user and port are
    /// `DATABASE_URL`'s).
    pub database_host: String,
    /// The query string of their database URL (`sslmode=verify-full&sslrootcert=…`).
    pub database_query: String,
}

impl Transport {
    /// The URL of database `db` on the test server through this transport.
    fn database_url(&self, db: &str) -> anyhow::Result<String> {
        let server: sqlx::postgres::PgConnectOptions = server_url().parse()?;
        Ok(format!(
            "postgres://{}@{}:{}/{db}?{}",
            server.get_username(),
            self.database_host,
            server.get_port(),
            self.database_query
        ))
    }
}

impl TestEnv {
    /// Creates the database (migrated), the topic with `partitions` partitions, and a log folder.
    pub async fn new(name: &str, partitions: i32) -> anyhow::Result<TestEnv> {
        TestEnv::with_transport(name, partitions, None).await
    }

    /// [`TestEnv::new`], its binaries and clients reaching PostgreSQL and Kafka through
    /// `transport` when given.
    pub async fn with_transport(
        name: &str,
        partitions: i32,
        transport: Option<Transport>,
    ) -> anyhow::Result<TestEnv> {
        let id = Uuid::new_v4().simple().to_string();
        let short = &id[..10];
        let database = format!("pt_{name}_{short}");
        let mut database_url = create_database(&server_url(), &database).await?;
        let (mut brokers, mut kafka_options) = (brokers(), Vec::new());
        if let Some(t) = transport {
            database_url = t.database_url(&database)?;
            (brokers, kafka_options) = (t.brokers, t.kafka_options);
        }
        let pool = PgPool::connect(&database_url).await?;
        demo_events::MIGRATOR.run(&pool).await?;
        let topic = format!("orders-{name}-{short}");
        KafkaArgs {
            kafka_brokers: brokers.clone(),
            kafka_options: kafka_options.clone(),
        }
        .ensure_topics(std::slice::from_ref(&topic), partitions)
        .await
        .context("creating the test topic (is the broker running? set KAFKA_BROKERS)")?;
        let log_dir = bin_dir().join("test-logs").join(format!("{name}-{short}"));
        std::fs::create_dir_all(&log_dir)?;
        Ok(TestEnv {
            name: name.to_owned(),
            database_url,
            topic,
            group_prefix: format!("t{short}-"),
            brokers,
            log_dir,
            pool,
            kafka_options,
            database,
        })
    }

    pub fn kafka(&self) -> KafkaArgs {
        KafkaArgs {
            kafka_options: self.kafka_options.clone(),
            ..kafka_args(&self.brokers)
        }
    }

    /// Environment every binary gets.
    fn common_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("DATABASE_URL".into(), self.database_url.clone()),
            ("KAFKA_BROKERS".into(), self.brokers.clone()),
            ("RUST_LOG".into(), "info".into()),
            // Tests run in parallel against one server (max_connections 100 by default): small
            // pools keep them from exhausting it.
            ("DATABASE_MAX_CONNECTIONS".into(), "6".into()),
        ];
        if !self.kafka_options.is_empty() {
            let options: Vec<String> = self
                .kafka_options
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            env.push(("KAFKA_OPTIONS".into(), options.join(",")));
        }
        env
    }

    /// Starts a binary with `args`; its output goes to `<log_dir>/<label>.log`.
    pub fn spawn(&self, bin: &str, label: &str, args: &[&str]) -> anyhow::Result<Service> {
        self.spawn_with_env(bin, label, args, &[])
    }

    /// [`TestEnv::spawn`] with extra environment variables (overriding the common ones).
    pub fn spawn_with_env(
        &self,
        bin: &str,
        label: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Service> {
        let log_path = self.log_dir.join(format!("{label}.log"));
        let log = File::options().create(true).append(true).open(&log_path)?;
        let path = bin_dir().join(bin);
        if !path.exists() {
            bail!(
                "{} is missing: build the binaries first (cargo build --release --bins)",
                path.display()
            );
        }
        let child = Command::new(&path)
            .args(args)
            .envs(self.common_env())
            .envs(env.iter().copied())
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", path.display()))?;
        Ok(Service::new(child, log_path, label))
    }

    /// Starts the order service on a free port and returns it with its base URL.
    pub async fn order_service(&self) -> anyhow::Result<(Service, String)> {
        self.order_service_with_args(&[]).await
    }

    /// [`TestEnv::order_service`] with further `producer serve` arguments (e.g. `--export-dir`).
    pub async fn order_service_with_args(
        &self,
        extra: &[&str],
    ) -> anyhow::Result<(Service, String)> {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--topic", &self.topic];
        args.extend_from_slice(extra);
        let svc = self.spawn("producer", "order-service", &args)?;
        let addr = svc
            .wait_for_log_value("order service listening on ", Duration::from_secs(30))
            .await?;
        Ok((svc, format!("http://{addr}")))
    }

    /// Starts a relay; returns it with its metrics address.
    pub async fn relay(&self, label: &str) -> anyhow::Result<(Service, String)> {
        self.relay_with_args(label, &[]).await
    }

    /// [`TestEnv::relay`] with further `relay run` arguments.
    pub async fn relay_with_args(
        &self,
        label: &str,
        extra: &[&str],
    ) -> anyhow::Result<(Service, String)> {
        let mut args = vec!["run", "--metrics-listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let svc = self.spawn("relay", label, &args)?;
        let addr = svc
            .wait_for_log_value("relay metrics listening on ", Duration::from_secs(30))
            .await?;
        Ok((svc, addr))
    }

    /// Starts a consumer process running both groups.
    pub async fn consumer(&self, label: &str) -> anyhow::Result<(Service, String)> {
        self.consumer_with_args(label, &[]).await
    }

    /// Starts a consumer process running both groups, with further `consumer run` arguments.
    pub async fn consumer_with_args(
        &self,
        label: &str,
        extra: &[&str],
    ) -> anyhow::Result<(Service, String)> {
        let mut args = self.consumer_run_args(&["inventory", "notification"]);
        args.extend_from_slice(extra);
        let svc = self.spawn("consumer", label, &args)?;
        let addr = svc
            .wait_for_log_value("consumer metrics listening on ", Duration::from_secs(30))
            .await?;
        Ok((svc, addr))
    }

    /// `consumer run` arguments for `groups` on the environment's topic and group prefix, the
    /// ops endpoint on a free port.
    pub fn consumer_run_args<'a>(&'a self, groups: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["run"];
        for group in groups {
            args.extend(["--group", group]);
        }
        args.extend([
            "--topic",
            &self.topic,
            "--group-prefix",
            &self.group_prefix,
            "--metrics-listen",
            "127.0.0.1:0",
        ]);
        args
    }

    /// Starts a consumer process running only the `export` group on `topic`, writing files to
    /// `dir`, with further `consumer run` arguments; returns it with its metrics address.
    pub async fn export_consumer(
        &self,
        label: &str,
        topic: &str,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> anyhow::Result<(Service, String)> {
        let dir = dir.to_string_lossy();
        let mut args = vec![
            "run",
            "--group",
            "export",
            "--topic",
            topic,
            "--group-prefix",
            &self.group_prefix,
            "--metrics-listen",
            "127.0.0.1:0",
            "--export-dir",
            &dir,
        ];
        args.extend_from_slice(extra);
        let svc = self.spawn("consumer", label, &args)?;
        let addr = svc
            .wait_for_log_value("consumer metrics listening on ", Duration::from_secs(30))
            .await?;
        Ok((svc, addr))
    }

    /// Runs a binary to completion and returns its stdout.
    pub fn run_to_end(
        &self,
        bin: &str,
        args: &[&str],
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let path = bin_dir().join(bin);
        let mut child = Command::new(&path)
            .args(args)
            .envs(self.common_env())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", path.display()))?;
        let deadline = Instant::now() + timeout;
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("{bin} {args:?} did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "{bin} {args:?} failed ({}): {stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }

    /// Places `orders` orders through the order service at `url` as fast as the `load` binary
    /// can (8 at a time), over products 1 to `products`, the mix drawn from `seed`.
    pub fn place_orders(
        &self,
        url: &str,
        orders: u32,
        products: u32,
        seed: u32,
    ) -> anyhow::Result<()> {
        let (orders, products, seed) = (orders.to_string(), products.to_string(), seed.to_string());
        let args = [
            "--url",
            url,
            "--orders",
            &orders,
            "--rate",
            "0",
            "--concurrency",
            "8",
            "--products",
            &products,
            "--seed",
            &seed,
        ];
        self.run_to_end("load", &args, Duration::from_secs(60))
            .map(drop)
    }

    /// Group id of a group kind in this environment.
    pub fn group(&self, kind: &str) -> String {
        format!("{}{kind}", self.group_prefix)
    }

    /// Total committed lag of a group over the test topic; `None` while a partition with data has
    /// no commit yet. Blocks on the broker.
    pub fn lag(&self, kind: &str) -> anyhow::Result<Option<i64>> {
        committed_lag(&self.kafka(), &self.group(kind), &self.topic)
    }

    /// Seeds the demonstration catalogue with products 1 to `products` (`producer seed-catalog`).
    pub fn seed_catalog(&self, products: u32) -> anyhow::Result<()> {
        let products = products.to_string();
        self.run_to_end(
            "producer",
            &["seed-catalog", "--products", &products],
            SEED_TIMEOUT,
        )
        .map(drop)
    }

    /// Stocks products 1 to `products` with `quantity` each, or the binary's default
    /// (`consumer seed-stock`).
    pub fn seed_stock(&self, products: u32, quantity: Option<i64>) -> anyhow::Result<()> {
        let products = products.to_string();
        let quantity = quantity.map(|q| q.to_string());
        let mut args = vec!["seed-stock", "--products", &products];
        if let Some(q) = &quantity {
            args.extend(["--quantity", q]);
        }
        self.run_to_end("consumer", &args, SEED_TIMEOUT).map(drop)
    }

    /// Waits until the outbox holds nothing unpublished and each group of `kinds` has committed
    /// everything on the topic.
    pub async fn wait_drained(&self, kinds: &[&str], timeout: Duration) -> anyhow::Result<()> {
        wait_until("outbox drained and groups caught up", timeout, || async {
            let pending: i64 = sqlx::query_scalar(crate::db::UNPUBLISHED_SQL)
                .fetch_one(&self.pool)
                .await?;
            if pending > 0 {
                return Ok(None);
            }
            for kind in kinds {
                let (kafka, group, topic) = (self.kafka(), self.group(kind), self.topic.clone());
                let lag =
                    tokio::task::spawn_blocking(move || committed_lag(&kafka, &group, &topic))
                        .await??;
                if lag != Some(0) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await
    }
}

/// A passed test's database is dropped (its sessions ended), so that runs leave no databases
/// behind for autovacuum to visit; a failed test's is kept for a look. The binaries the test
/// started were stopped before (they were made after the environment, so they drop first).
impl Drop for TestEnv {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let (server, name) = (server_url(), std::mem::take(&mut self.database));
        // A runtime of its own on a thread of its own: the test's runtime may be a
        // current-thread one, which cannot block on a future from within.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(drop_database(&server, &name))
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("dropping the test's database: {e:#}");
        }
    }
}
