//! The monitoring files against a real Prometheus: it scrapes the running pipeline (order service,
//! relay, consumer, export consumer) every second with the repository's alert rules loaded, while
//! ~300 orders go through. Then, through Prometheus's HTTP API: the metrics of the contract exist
//! with this environment's labels, the lag returns to 0 after the drain, the end-to-end histogram
//! counted every event, and every query of the Grafana dashboard and every alert rule evaluates
//! without error (and the dashboard's queries return data, so a misspelt metric name shows).
//!
//! Needs `prometheus` (Debian's package; scripts/test.sh installs it): `PROMETHEUS_BIN`, else
//! `prometheus` on PATH. Without either the test says so and passes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pipeline_testkit::{wait_until, TestEnv};
use serde_json::Value;

const GROUPS: [&str; 2] = ["inventory", "notification"];
const ORDERS: &str = "300";
const PRODUCTS: u32 = 50;
const STOCK: i64 = 1_000_000;

/// Metrics every healthy run exports (histograms by their `_bucket` series). Counters that only
/// appear with their first error (`relay_publish_errors_total`, `consumer_batch_retries_total`,
/// `consumer_offset_commit_failures_total`) are not listed.
const CORE_SERIES: &[&str] = &[
    // order service
    "order_requests_total",
    "order_request_duration_seconds_bucket",
    "order_events_enqueued_total",
    "order_transaction_changes_bucket",
    "order_shared_transaction_failures_total",
    // relay
    "outbox_unpublished_events",
    "outbox_oldest_unpublished_age_seconds",
    "outbox_published_total",
    "relay_batch_size_bucket",
    "relay_batch_duration_seconds_bucket",
    "outbox_publish_delay_seconds_bucket",
    "relay_last_success_timestamp_seconds",
    "relay_active",
    "relay_kafka_producer_queue_messages",
    "relay_kafka_producer_queue_max_messages",
    "relay_kafka_broker_rtt_seconds",
    // consumer
    "consumer_messages_total",
    "consumer_out_of_sequence_events_total",
    "consumer_batch_duration_seconds_bucket",
    "consumer_db_transaction_duration_seconds_bucket",
    "consumer_batch_size_bucket",
    "consumer_transaction_partition_batches_bucket",
    "consumer_shared_transaction_failures_total",
    "pipeline_end_to_end_latency_seconds_bucket",
    "consumer_offset_commit_duration_seconds_bucket",
    "consumer_rebalances_total",
    "consumer_assigned_partitions",
    // lag collector (inside the consumer)
    "consumer_group_lag_messages",
    "consumer_group_lag_seconds",
    "consumer_group_committed_offset",
    "kafka_topic_partition_end_offset",
    "consumer_group_uncommitted_partitions",
    "consumer_group_members",
    "lag_collector_last_success_timestamp_seconds",
    // export consumer
    "export_jobs_total",
    "export_duration_seconds_bucket",
    "export_rows_total",
    "export_expired_total",
    "export_jobs_waiting",
    "export_oldest_waiting_seconds",
];

/// Dashboard queries that may rightly return nothing in a healthy run: they select series that
/// only exist after an error, a dead letter or a retry, or once retention had to wait for a
/// busy pipeline.
const MAY_BE_EMPTY: &[&str] = &[
    "dead_lettered",
    "retention_yielded_seconds_total",
    "relay_publish_errors_total",
    "consumer_batch_retries_total",
    "consumer_offset_commit_failures_total",
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/kit is two levels below the repository root")
        .to_path_buf()
}

/// `PROMETHEUS_BIN`, else `prometheus` on PATH.
fn prometheus_bin() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("PROMETHEUS_BIN").filter(|b| !b.is_empty()) {
        return Some(PathBuf::from(bin));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("prometheus"))
        .find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A Prometheus server of this test: killed and its storage removed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    storage: PathBuf,
    log_path: PathBuf,
    http: reqwest::Client,
}

impl Prometheus {
    /// Writes a configuration scraping `targets` (job name, address) every second with the
    /// repository's alert rules, starts Prometheus on a free port and waits until it is ready.
    async fn start(bin: &Path, env: &TestEnv, targets: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = env.log_dir.join("prometheus");
        std::fs::create_dir_all(&dir)?;
        let rules = repo_root().join("deploy/prometheus/alerts.yml");
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {:?}\nscrape_configs:\n",
            rules.display().to_string()
        );
        let mut jobs: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (job, addr) in targets {
            jobs.entry(job).or_default().push(format!("'{addr}'"));
        }
        for (job, addrs) in jobs {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                addrs.join(", ")
            ));
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let storage = std::env::temp_dir().join(format!(
            "pipeline-prometheus-{}",
            env.group_prefix.trim_end_matches('-')
        ));
        let log_path = dir.join("prometheus.log");
        // Another process may take the free port before Prometheus binds it: try a few.
        let mut last_err = None;
        for _ in 0..3 {
            let port = free_port()?;
            let log = File::options().create(true).append(true).open(&log_path)?;
            let child = Command::new(bin)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!("--storage.tsdb.path={}", storage.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn")
                .stdout(log.try_clone()?)
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            let mut prom = Prometheus {
                child,
                url: format!("http://127.0.0.1:{port}"),
                storage: storage.clone(),
                log_path: log_path.clone(),
                http: reqwest::Client::builder()
                    .timeout(Duration::from_secs(10))
                    .build()?,
            };
            match prom.wait_ready(Duration::from_secs(30)).await {
                Ok(()) => return Ok(prom),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("prometheus exited ({status}):\n{}", self.log());
            }
            let ready = self.http.get(format!("{}/-/ready", self.url)).send().await;
            if matches!(ready, Ok(r) if r.status().is_success()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("prometheus not ready within {timeout:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// GET `path` of the HTTP API; the `data` of a `success` answer, an error otherwise.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> anyhow::Result<Value> {
        let body: Value = self
            .http
            .get(format!("{}{path}", self.url))
            .query(params)
            .send()
            .await?
            .json()
            .await?;
        if body["status"] != "success" {
            bail!(
                "{path} {params:?}: {} {}",
                body["errorType"].as_str().unwrap_or("?"),
                body["error"].as_str().unwrap_or("?")
            );
        }
        Ok(body["data"].clone())
    }

    /// An instant query's result vector (or a scalar as one sample).
    async fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api("/api/v1/query", &[("query", expr)]).await?;
        Ok(match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => {
                data["result"].as_array().cloned().unwrap_or_default()
            }
            _ => vec![serde_json::json!({ "metric": {}, "value": data["result"] })],
        })
    }

    /// The single value of `expr`, or `None` while it returns nothing.
    async fn value(&self, expr: &str) -> anyhow::Result<Option<f64>> {
        let result = self.query(expr).await?;
        match result.as_slice() {
            [] => Ok(None),
            [sample] => Ok(Some(sample_value(sample)?)),
            _ => bail!("{expr}: {} series, expected one", result.len()),
        }
    }

    /// Kills Prometheus and waits for it; removes its storage.
    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.storage);
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

fn sample_value(sample: &Value) -> anyhow::Result<f64> {
    let v = sample["value"][1]
        .as_str()
        .with_context(|| format!("no value in {sample}"))?;
    v.parse::<f64>()
        .with_context(|| format!("value {v:?} is not a number"))
}

/// Grafana's variables replaced as the dashboard uses them: `=~"$group"` matchers and range
/// durations.
fn substitute_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1m")
        .replace("${group}", ".+")
        .replace("$group", ".+")
        .replace("${topic}", ".+")
        .replace("$topic", ".+")
}

/// Every panel query of the dashboard (panel title, expression), rows' panels included, and its
/// `label_values(selector, label)` variables as (variable, selector, label).
type DashboardQueries = (Vec<(String, String)>, Vec<(String, String, String)>);

fn dashboard_queries() -> anyhow::Result<DashboardQueries> {
    let path = repo_root().join("deploy/grafana/pipeline-dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("").to_owned();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push((title.clone(), expr.to_owned()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut exprs = Vec::new();
    walk(&dash["panels"], &mut exprs);
    let mut variables = Vec::new();
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or("");
        let inner = q
            .trim()
            .strip_prefix("label_values(")
            .and_then(|s| s.strip_suffix(')'))
            .with_context(|| format!("variable {}: not label_values(…): {q}", v["name"]))?;
        let (selector, label) = inner
            .rsplit_once(',')
            .with_context(|| format!("variable {}: no label in {q}", v["name"]))?;
        variables.push((
            v["name"].as_str().unwrap_or("").to_owned(),
            selector.trim().to_owned(),
            label.trim().to_owned(),
        ));
    }
    Ok((exprs, variables))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_pipeline_and_evaluates_dashboard_and_alerts() -> anyhow::Result<()>
{
    let Some(prometheus_bin) = prometheus_bin() else {
        println!(
            "SKIPPED: no Prometheus (set PROMETHEUS_BIN or put `prometheus` on PATH; \
             scripts/test.sh installs Debian's prometheus package)"
        );
        return Ok(());
    };
    let env = TestEnv::new("prom", 12).await?;
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(STOCK))?;
    let (order_service, url) = env.order_service().await?;
    let (relay, relay_metrics) = env.relay("relay").await?;
    let (consumer, consumer_metrics) = env.consumer("consumer").await?;
    let export_topic = format!("exports-{}", env.topic);
    env.kafka()
        .ensure_topics(std::slice::from_ref(&export_topic), 3)
        .await?;
    let (export_consumer, export_metrics) = env
        .export_consumer(
            "export-consumer",
            &export_topic,
            &env.log_dir.join("exports"),
            &[],
        )
        .await?;
    let order_addr = url.trim_start_matches("http://").to_owned();

    let mut prom = Prometheus::start(
        &prometheus_bin,
        &env,
        &[
            ("order-service", &order_addr),
            ("relay", &relay_metrics),
            ("consumer", &consumer_metrics),
            ("consumer", &export_metrics),
        ],
    )
    .await?;
    wait_until(
        "Prometheus scraping all four targets",
        Duration::from_secs(30),
        || async {
            Ok(prom
                .value(r#"sum(up{job=~"order-service|relay|consumer"})"#)
                .await?
                .filter(|&up| up == 4.0))
        },
    )
    .await?;

    // Drive the orders.
    let summary = env.log_dir.join("load.json");
    let summary_path = summary.to_string_lossy().into_owned();
    env.run_to_end(
        "load",
        &[
            "--url",
            &url,
            "--orders",
            ORDERS,
            "--rate",
            "0",
            "--concurrency",
            "16",
            "--products",
            &PRODUCTS.to_string(),
            "--seed",
            "13",
            "--summary-json",
            &summary_path,
        ],
        Duration::from_secs(300),
    )?;
    let load: Value = serde_json::from_str(&std::fs::read_to_string(&summary)?)?;
    let events = load["events"].as_f64().context("events in load summary")?;
    env.wait_drained(&GROUPS, Duration::from_secs(180)).await?;

    // The metrics of the contract exist.
    wait_until(
        "every core series in Prometheus",
        Duration::from_secs(60),
        || async {
            let mut missing = Vec::new();
            for name in CORE_SERIES {
                if prom.value(&format!("count({name})")).await?.is_none() {
                    missing.push(*name);
                }
            }
            if missing.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow::anyhow!("missing: {missing:?}"))
            }
        },
    )
    .await?;
    println!("core series present: {}", CORE_SERIES.join(", "));

    // Lag back to 0 for this environment's groups, one lag series per partition (every
    // partition got events and a commit: none is left uncommitted, none reports -1).
    let groups: Vec<String> = GROUPS.iter().map(|g| env.group(g)).collect();
    let group_re = groups.join("|");
    let topic = &env.topic;
    wait_until("lag 0 in Prometheus", Duration::from_secs(60), || async {
        let lag = prom
            .value(&format!(
                r#"max(consumer_group_lag_messages{{group=~"{group_re}", topic="{topic}"}})"#
            ))
            .await?;
        let time_lag = prom
            .value(&format!(
                r#"max(consumer_group_lag_seconds{{group=~"{group_re}", topic="{topic}"}})"#
            ))
            .await?;
        Ok((lag == Some(0.0) && time_lag == Some(0.0)).then_some(()))
    })
    .await?;
    for group in &groups {
        let partitions = prom
            .value(&format!(
                r#"count(consumer_group_lag_messages{{group="{group}", topic="{topic}"}})"#
            ))
            .await?;
        assert_eq!(
            partitions,
            Some(12.0),
            "{group}: one lag series per partition"
        );
        let uncommitted = prom
            .value(&format!(
                r#"sum(consumer_group_uncommitted_partitions{{group="{group}", topic="{topic}"}})"#
            ))
            .await?;
        assert_eq!(uncommitted, Some(0.0), "{group}: no uncommitted partition");
        let members = prom
            .value(&format!(
                r#"max(consumer_group_members{{group="{group}"}})"#
            ))
            .await?;
        assert!(members >= Some(1.0), "{group}: members {members:?}");
        let negative = prom
            .value(&format!(
                r#"count(consumer_group_lag_messages{{group="{group}"}} < 0)"#
            ))
            .await?;
        assert_eq!(negative, None, "{group}: no negative lag");
    }

    // Every event counted once by the end-to-end histogram and as processed, per group.
    for group in &groups {
        let expr = format!(r#"sum(pipeline_end_to_end_latency_seconds_count{{group="{group}"}})"#);
        let counted = wait_until(
            "end-to-end histogram counted every event",
            Duration::from_secs(30),
            || async { Ok(prom.value(&expr).await?.filter(|&n| n == events)) },
        )
        .await;
        if counted.is_err() {
            bail!(
                "{group}: {expr} = {:?}, expected {events} events",
                prom.value(&expr).await?
            );
        }
        let processed = prom
            .value(&format!(
                r#"sum(consumer_messages_total{{group="{group}", outcome="processed"}})"#
            ))
            .await?;
        assert_eq!(processed, Some(events), "{group}: processed messages");
    }
    let p99 = prom
        .value(&format!(
            r#"histogram_quantile(0.99, sum by (le) (rate(pipeline_end_to_end_latency_seconds_bucket{{group="{}"}}[5m])))"#,
            groups[0]
        ))
        .await?;
    println!(
        "{events} events; end-to-end p99 of {}: {p99:?} s",
        groups[0]
    );

    // The relay: active, outbox drained.
    assert_eq!(
        prom.value("max(relay_active)").await?,
        Some(1.0),
        "relay active"
    );
    wait_until("outbox gauges at 0", Duration::from_secs(30), || async {
        let unpublished = prom.value("max(outbox_unpublished_events)").await?;
        let age = prom
            .value("max(outbox_oldest_unpublished_age_seconds)")
            .await?;
        Ok((unpublished == Some(0.0) && age == Some(0.0)).then_some(()))
    })
    .await?;

    // Every dashboard query evaluates, and returns data unless it selects error-only series
    // (rates need two samples of a series: a series born a moment ago gets a few seconds).
    let (exprs, variables) = dashboard_queries()?;
    let mut failures = Vec::new();
    let mut empty = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        failures.clear();
        empty.clear();
        for (title, expr) in &exprs {
            let expr = substitute_variables(expr);
            match prom.query(&expr).await {
                Ok(result)
                    if result.is_empty() && !MAY_BE_EMPTY.iter().any(|m| expr.contains(m)) =>
                {
                    empty.push(format!("{title}: {expr}"));
                }
                Ok(_) => {}
                Err(e) => failures.push(format!("{title}: {e}")),
            }
        }
        if !failures.is_empty() || empty.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (name, selector, label) in &variables {
        let values = prom
            .api(
                &format!("/api/v1/label/{label}/values"),
                &[("match[]", selector)],
            )
            .await;
        match values {
            Ok(values) => {
                let values: BTreeSet<&str> = values
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                let wanted: Vec<&str> = match name.as_str() {
                    "group" => groups.iter().map(String::as_str).collect(),
                    "topic" => vec![topic.as_str()],
                    _ => Vec::new(),
                };
                for w in wanted {
                    if !values.contains(w) {
                        failures.push(format!("variable ${name} lacks {w}: {values:?}"));
                    }
                }
            }
            Err(e) => failures.push(format!("variable ${name}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "dashboard queries failing:\n{}",
        failures.join("\n")
    );
    assert!(
        empty.is_empty(),
        "dashboard queries returning nothing (a metric name the binaries do not export?):\n{}",
        empty.join("\n")
    );
    println!("{} dashboard queries evaluated", exprs.len());

    // Every alert rule loaded, evaluated by Prometheus without error, and queryable.
    let alerts_yml = std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml"))?;
    let declared = alerts_yml
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    let rules = wait_until(
        "every alert rule evaluated",
        Duration::from_secs(30),
        || async {
            let data = prom.api("/api/v1/rules", &[]).await?;
            let rules: Vec<Value> = data["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            Ok(
                (rules.len() == declared && rules.iter().all(|r| r["health"] != "unknown"))
                    .then_some(rules),
            )
        },
    )
    .await?;
    for rule in &rules {
        let name = rule["name"].as_str().unwrap_or("?");
        assert_eq!(
            rule["health"], "ok",
            "alert rule {name} fails to evaluate: {}",
            rule["lastError"]
        );
        let expr = rule["query"].as_str().context("rule query")?;
        if let Err(e) = prom.query(expr).await {
            failures.push(format!("{name}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "alert rule expressions failing:\n{}",
        failures.join("\n")
    );
    // A drained pipeline fires nothing (alerts with `for: 0s` would show here already).
    let firing = prom.query(r#"ALERTS{alertstate="firing"}"#).await?;
    let pending = prom.query(r#"ALERTS{alertstate="pending"}"#).await?;
    if !pending.is_empty() {
        println!("pending alerts after the drain: {pending:?}");
    }
    assert!(
        firing.is_empty(),
        "alerts firing on a drained pipeline: {firing:?}"
    );
    println!("{} alert rules evaluated, none firing", rules.len());

    prom.stop();
    for service in [export_consumer, consumer, relay, order_service] {
        service.stop_cleanly(Duration::from_secs(30)).await?;
    }
    Ok(())
}
