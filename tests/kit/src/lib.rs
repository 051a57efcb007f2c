//! Harness for end-to-end tests: runs the real `producer`, `relay` and `consumer` binaries
//! against PostgreSQL and a Kafka-protocol broker, each test in its own database, topic and
//! consumer groups.
//!
//! Environment: `DATABASE_URL` (a server URL whose database is used only to create test
//! databases; default `postgres://postgres@127.0.0.1:5432/postgres`), `KAFKA_BROKERS` (default
//! `127.0.0.1:9092`), `PIPELINE_BIN_DIR` (default: the directory of the test executable's
//! parent, i.e. `target/<profile>`). Build the binaries first (`cargo build --release --bins`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pipeline_core::kafka::{group_lag, KafkaArgs};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// One isolated environment: a fresh database, topic and group prefix.
pub struct TestEnv {
    pub name: String,
    pub database_url: String,
    pub topic: String,
    pub group_prefix: String,
    pub brokers: String,
    pub log_dir: PathBuf,
    pub pool: PgPool,
}

fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable".to_owned()
    })
}

fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let root = match base.rfind('/') {
        Some(i) if i > base.find("://").map(|j| j + 2).unwrap_or(0) => &base[..i],
        _ => base,
    };
    match query {
        Some(q) => format!("{root}/{db}?{q}"),
        None => format!("{root}/{db}"),
    }
}

/// Directory of the binaries under test.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PIPELINE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    // target/<profile>/deps/<test binary> -> target/<profile>
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("target directory")
}

impl TestEnv {
    /// Creates the database (migrated), the topic with `partitions` partitions, and a log folder.
    pub async fn new(name: &str, partitions: i32) -> anyhow::Result<TestEnv> {
        let id = Uuid::new_v4().simple().to_string();
        let short = &id[..10];
        let db = format!("pt_{name}_{short}");
        let mut admin = PgConnection::connect(&server_url())
            .await
            .context("connecting to PostgreSQL (is it running? set DATABASE_URL)")?;
        sqlx::query(&format!("CREATE DATABASE \"{db}\""))
            .execute(&mut admin)
            .await?;
        let database_url = with_database(&server_url(), &db);
        let pool = PgPool::connect(&database_url).await?;
        pipeline_core::db::MIGRATOR.run(&pool).await?;
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        let topic = format!("orders-{name}-{short}");
        kafka_args(&brokers)
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
        })
    }

    pub fn kafka(&self) -> KafkaArgs {
        kafka_args(&self.brokers)
    }

    /// Environment every binary gets.
    fn common_env(&self) -> Vec<(String, String)> {
        vec![
            ("DATABASE_URL".into(), self.database_url.clone()),
            ("KAFKA_BROKERS".into(), self.brokers.clone()),
            ("RUST_LOG".into(), "info".into()),
            // Tests run in parallel against one server (max_connections 100 by default): small
            // pools keep them from exhausting it.
            ("DATABASE_MAX_CONNECTIONS".into(), "6".into()),
        ]
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
        Ok(Service {
            child,
            log_path,
            label: label.to_owned(),
        })
    }

    /// Starts the order service on a free port and returns it with its base URL.
    pub async fn order_service(&self) -> anyhow::Result<(Service, String)> {
        let svc = self.spawn(
            "producer",
            "order-service",
            &["serve", "--listen", "127.0.0.1:0", "--topic", &self.topic],
        )?;
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
        let svc = self.spawn(
            "consumer",
            label,
            &[
                "run",
                "--group",
                "inventory",
                "--group",
                "notification",
                "--topic",
                &self.topic,
                "--group-prefix",
                &self.group_prefix,
                "--metrics-listen",
                "127.0.0.1:0",
            ],
        )?;
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

    /// Group id of a group kind in this environment.
    pub fn group(&self, kind: &str) -> String {
        format!("{}{kind}", self.group_prefix)
    }

    /// Total committed lag of a group over the test topic; `None` while a partition with data has
    /// no commit yet.
    pub fn lag(&self, kind: &str) -> anyhow::Result<Option<i64>> {
        let parts = group_lag(
            &self.kafka(),
            &self.group(kind),
            std::slice::from_ref(&self.topic),
            Duration::from_secs(10),
        )?;
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
}

fn kafka_args(brokers: &str) -> KafkaArgs {
    KafkaArgs {
        kafka_brokers: brokers.to_owned(),
        kafka_options: Vec::new(),
    }
}

/// A running binary.
pub struct Service {
    child: Child,
    pub log_path: PathBuf,
    pub label: String,
}

impl Service {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        kill(self.pid(), signal).with_context(|| format!("signalling {}", self.label))
    }

    /// SIGKILL, then reap.
    pub fn kill_hard(mut self) -> anyhow::Result<()> {
        self.signal(Signal::SIGKILL)?;
        let _ = self.child.wait()?;
        Ok(())
    }

    /// SIGTERM, then wait for a clean exit within `timeout`; returns whether it exited successfully.
    pub async fn stop(mut self, timeout: Duration) -> anyhow::Result<bool> {
        self.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!(
                    "{} did not stop within {timeout:?} after SIGTERM",
                    self.label
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits for a log line containing `prefix` and returns the word that follows it.
    pub async fn wait_for_log_value(
        &self,
        prefix: &str,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if let Some(pos) = log.rfind(prefix) {
                let rest = &log[pos + prefix.len()..];
                let value: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',')
                    .collect();
                if !value.is_empty() {
                    return Ok(value);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: no `{prefix}` in its log within {timeout:?}:\n{log}",
                    self.label
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `check` until it returns `Some`, or fails after `timeout` with `what`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} (last error: {last_err:?})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fetches a Prometheus text page and sums the samples of `metric` whose labels contain all of
/// `labels` (each `name="value"`).
pub async fn scrape_sum(addr: &str, metric: &str, labels: &[&str]) -> anyhow::Result<f64> {
    Ok(metric_sum(&scrape(addr).await?, metric, labels))
}

/// The text of the `/metrics` page at `addr`.
pub async fn scrape(addr: &str) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("http://{addr}/metrics"))
        .await?
        .text()
        .await?)
}

/// Sum of the series of `metric` in a scraped `body` whose labels contain all of `labels`.
pub fn metric_sum(body: &str, metric: &str, labels: &[&str]) -> f64 {
    let mut total = 0.0;
    for line in body.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if name == metric && labels.iter().all(|l| series.contains(l)) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}
