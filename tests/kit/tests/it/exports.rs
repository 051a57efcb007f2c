//! Order exports through the real binaries: the order service takes the request, the relay
//! publishes its event on the export topic, a consumer process running only the `export` group
//! writes the file; the client polls and downloads it. Checked: the file holds exactly the
//! orders the filters match, its checksum is the bytes downloaded and the job's, a redelivered
//! job event writes no second file, and an expired export's file is removed; the export
//! consumer's metrics count the export, its rows and the expiry.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pipeline_testkit::kafka::committed_lag;
use pipeline_testkit::{metric_sum, scrape, scrape_sum, wait_until, Service, TestEnv};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Orders the filter matches, and orders it does not.
const MATCHING: i64 = 10_000;
const OTHERS: i64 = 2_000;

/// The pipeline for exports: order service, relay, and a consumer running the export group alone
/// on an export topic of the test's own.
struct Exports {
    env: TestEnv,
    topic: String,
    dir: PathBuf,
    url: String,
    http: reqwest::Client,
    services: Vec<Service>,
    /// The first export consumer's metrics address.
    consumer_metrics: String,
}

impl Exports {
    async fn start(name: &str, consumer_args: &[&str]) -> anyhow::Result<(Exports, Service)> {
        let env = TestEnv::new(name, 3).await?;
        let topic = format!("exports-{}", env.topic);
        env.kafka()
            .ensure_topics(std::slice::from_ref(&topic), 3)
            .await?;
        let dir = env.log_dir.join("exports");
        let dir_arg = dir.to_string_lossy().into_owned();
        let (order_service, url) = env
            .order_service_with_args(&["--export-dir", &dir_arg, "--export-topic", &topic])
            .await?;
        let (relay, _) = env.relay("relay").await?;
        let (consumer, consumer_metrics) = env
            .export_consumer("export-consumer", &topic, &dir, consumer_args)
            .await?;
        let exports = Exports {
            env,
            topic,
            dir,
            url,
            http: reqwest::Client::new(),
            services: vec![order_service, relay],
            consumer_metrics,
        };
        Ok((exports, consumer))
    }

    async fn submit(&self, filters: &Value) -> anyhow::Result<Value> {
        let answer = self
            .http
            .post(format!("{}/exports", self.url))
            .json(filters)
            .send()
            .await?;
        assert_eq!(answer.status(), 202, "export accepted at once");
        let location = answer
            .headers()
            .get("location")
            .and_then(|l| l.to_str().ok())
            .map(str::to_owned);
        let job: Value = answer.json().await?;
        assert_eq!(job["state"], "pending");
        assert_eq!(location.as_deref(), job["status_url"].as_str());
        Ok(job)
    }

    async fn get(&self, id: &str) -> anyhow::Result<(u16, Value)> {
        let answer = self
            .http
            .get(format!("{}/exports/{id}", self.url))
            .send()
            .await?;
        Ok((answer.status().as_u16(), answer.json().await?))
    }

    async fn wait_for_state(&self, id: &str, state: &str) -> anyhow::Result<Value> {
        wait_until(
            &format!("export {id} {state}"),
            Duration::from_secs(120),
            || async {
                let (status, job) = self.get(id).await?;
                assert_eq!(status, 200);
                assert_ne!(job["state"], "failed", "export failed: {job}");
                Ok((job["state"] == state).then_some(job))
            },
        )
        .await
    }

    /// The job's row as JSON, to compare before and after.
    async fn job_row(&self, id: Uuid) -> anyhow::Result<Value> {
        Ok(
            sqlx::query_scalar("SELECT to_jsonb(j) FROM export_job j WHERE id = $1")
                .bind(id)
                .fetch_one(&self.env.pool)
                .await?,
        )
    }

    async fn stop(self) -> anyhow::Result<()> {
        for service in self.services {
            service.stop_cleanly(Duration::from_secs(30)).await?;
        }
        Ok(())
    }
}

/// Orders created over the last hours: `MATCHING` paid ones, `OTHERS` in other states, some
/// with lines, some without e-mail, some whose customer id needs CSV quoting.
async fn seed_orders(env: &TestEnv) -> anyhow::Result<()> {
    env.seed_catalog(5)?;
    sqlx::query(
        "INSERT INTO orders (order_id, customer_id, email, status, created_at, updated_at)
         SELECT gen_random_uuid(),
                CASE WHEN i % 97 = 0 THEN 'acme, \"east\"' ELSE 'customer-' || (i % 50) END,
                CASE WHEN i % 3 = 0 THEN NULL ELSE 'c' || i || '@example.com' END,
                CASE WHEN i <= $1 THEN 'paid'
                     ELSE (ARRAY['placed', 'cancelled', 'shipped'])[1 + i % 3] END,
                now() - make_interval(secs => i), now()
         FROM generate_series(1, $1 + $2) AS i",
    )
    .bind(MATCHING)
    .bind(OTHERS)
    .execute(&env.pool)
    .await?;
    sqlx::query(
        "INSERT INTO order_line (order_id, line_no, product_id, quantity)
         SELECT order_id, n, 'sku-0000' || n, n FROM orders, generate_series(1, 2) AS n
         WHERE customer_id = 'customer-7'",
    )
    .execute(&env.pool)
    .await?;
    Ok(())
}

/// The rows the export of `paid` orders must hold, in its order, as CSV fields.
async fn expected_rows(env: &TestEnv) -> anyhow::Result<Vec<Vec<String>>> {
    let rows: Vec<(String, String, Option<String>, String, i64, i64)> = sqlx::query_as(
        "SELECT o.order_id::text, o.customer_id, o.email, o.status,
                (SELECT count(*) FROM order_line l WHERE l.order_id = o.order_id),
                (SELECT COALESCE(sum(quantity), 0) FROM order_line l WHERE l.order_id = o.order_id)::bigint
         FROM orders o WHERE o.status = 'paid' ORDER BY o.created_at, o.order_id",
    )
    .fetch_all(&env.pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, customer, email, status, lines, items)| {
            vec![
                id,
                customer,
                email.unwrap_or_default(),
                status,
                lines.to_string(),
                items.to_string(),
            ]
        })
        .collect())
}

/// The same fields of each record of a downloaded file (timestamps left out: checked apart).
fn file_rows(csv_bytes: &[u8]) -> anyhow::Result<(Vec<String>, Vec<Vec<String>>)> {
    let mut reader = csv::Reader::from_reader(csv_bytes);
    let header = reader.headers()?.iter().map(str::to_owned).collect();
    let mut rows = Vec::new();
    for record in reader.records() {
        let r = record?;
        chrono::DateTime::parse_from_rfc3339(&r[4])?;
        chrono::DateTime::parse_from_rfc3339(&r[5])?;
        rows.push(
            [0, 1, 2, 3, 6, 7]
                .iter()
                .map(|i| r[*i].to_owned())
                .collect(),
        );
    }
    Ok((header, rows))
}

/// The export directory's entries: name, inode, modification time, size.
fn dir_listing(dir: &Path) -> anyhow::Result<Vec<(String, u64, i64, u64)>> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        entries.push((
            entry.file_name().to_string_lossy().into_owned(),
            meta.ino(),
            meta.mtime_nsec() + meta.mtime() * 1_000_000_000,
            meta.len(),
        ));
    }
    entries.sort();
    Ok(entries)
}

/// Reads the job's event back from the export topic and produces it again, key, headers and
/// payload unchanged: what a relay that crashed before marking it published would do.
async fn produce_again(exports: &Exports, job_id: Uuid) -> anyhow::Result<()> {
    let kafka = exports.env.kafka();
    let topic = exports.topic.clone();
    let record = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let consumer: BaseConsumer = kafka
            .client_config()
            .set("group.id", format!("reader-{}", Uuid::new_v4()))
            .create()?;
        let mut assignment = TopicPartitionList::new();
        for p in 0..3 {
            assignment.add_partition_offset(&topic, p, Offset::Beginning)?;
        }
        consumer.assign(&assignment)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if let Some(m) = consumer.poll(Duration::from_millis(200)) {
                let m = m?;
                if m.key() == Some(job_id.to_string().as_bytes()) {
                    let mut headers = OwnedHeaders::new();
                    if let Some(h) = m.headers() {
                        for header in h.iter() {
                            headers = headers.insert(rdkafka::message::Header {
                                key: header.key,
                                value: header.value,
                            });
                        }
                    }
                    return Ok((
                        m.partition(),
                        m.key().map(<[u8]>::to_vec),
                        m.payload().map(<[u8]>::to_vec),
                        headers,
                    ));
                }
            }
        }
        anyhow::bail!("the job's event is not on the export topic")
    })
    .await??;
    let (partition, key, payload, headers) = record;
    let producer: FutureProducer = exports.env.kafka().client_config().create()?;
    let key = key.unwrap_or_default();
    let payload = payload.unwrap_or_default();
    producer
        .send(
            FutureRecord::to(&exports.topic)
                .partition(partition)
                .key(&key)
                .payload(&payload)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    Ok(())
}

async fn wait_group_caught_up(exports: &Exports) -> anyhow::Result<()> {
    wait_until(
        "export group caught up",
        Duration::from_secs(60),
        || async {
            let (kafka, group, topic) = (
                exports.env.kafka(),
                exports.env.group("export"),
                exports.topic.clone(),
            );
            let lag = tokio::task::spawn_blocking(move || committed_lag(&kafka, &group, &topic))
                .await??;
            Ok((lag == Some(0)).then_some(()))
        },
    )
    .await
}

async fn processed_rows(exports: &Exports) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM processed_message WHERE group_name = $1")
            .bind(exports.env.group("export"))
            .fetch_one(&exports.env.pool)
            .await?,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_orders_are_exported_downloaded_and_never_written_twice() -> anyhow::Result<()>
{
    let (exports, consumer) = Exports::start("export-e2e", &[]).await?;
    seed_orders(&exports.env).await?;

    let job = exports
        .submit(&json!({
            "status": "paid",
            "created_from": "2000-01-01T00:00:00Z",
            "created_to": "2100-01-01T00:00:00Z"
        }))
        .await?;
    let id = job["id"].as_str().unwrap_or_default().to_owned();
    let job_id = Uuid::parse_str(&id)?;
    let done = exports.wait_for_state(&id, "succeeded").await?;
    assert_eq!(done["row_count"], MATCHING);
    // The worker's metrics count the one export, its rows and its duration (counted just
    // after the job is recorded).
    wait_until("export counted", Duration::from_secs(10), || async {
        let done = scrape_sum(&exports.consumer_metrics, "export_jobs_total", &[]).await?;
        Ok((done > 0.0).then_some(()))
    })
    .await?;
    let metrics = scrape(&exports.consumer_metrics).await?;
    assert_eq!(
        metric_sum(&metrics, "export_jobs_total", &[r#"outcome="succeeded""#]),
        1.0
    );
    assert_eq!(metric_sum(&metrics, "export_jobs_total", &[]), 1.0);
    assert_eq!(
        metric_sum(&metrics, "export_rows_total", &[]),
        MATCHING as f64
    );
    assert_eq!(
        metric_sum(&metrics, "export_duration_seconds_count", &[]),
        1.0
    );

    // The download: every matching order, once, in creation order, and the checksum of the
    // bytes received is the one announced and the one recorded.
    let answer = exports
        .http
        .get(format!(
            "{}{}",
            exports.url,
            done["download_url"].as_str().unwrap_or_default()
        ))
        .send()
        .await?;
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers()["content-type"].to_str()?,
        "text/csv; charset=utf-8"
    );
    let announced = answer.headers()["x-checksum-sha256"].to_str()?.to_owned();
    let body = answer.bytes().await?;
    let received = format!("{:x}", Sha256::digest(&body));
    assert_eq!(received, announced, "checksum header matches the bytes");
    assert_eq!(done["checksum"].as_str(), Some(received.as_str()));
    let (header, rows) = file_rows(&body)?;
    assert_eq!(
        header,
        [
            "order_id",
            "customer_id",
            "email",
            "status",
            "created_at",
            "updated_at",
            "line_count",
            "item_count"
        ]
    );
    let expected = expected_rows(&exports.env).await?;
    assert_eq!(rows.len(), expected.len());
    assert_eq!(rows, expected, "the file holds exactly the matching orders");
    assert!(
        rows.iter().any(|r| r[1] == "acme, \"east\""),
        "quoted fields survive"
    );

    // One finished file, no temporary file.
    let name = format!("export-{job_id}.csv");
    let before = dir_listing(&exports.dir)?;
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0].0, name);
    let row_before = exports.job_row(job_id).await?;

    // Redelivery 1: the same record produced again (a relay's duplicate) is skipped.
    produce_again(&exports, job_id).await?;
    wait_group_caught_up(&exports).await?;
    assert_eq!(processed_rows(&exports).await?, 1);

    // Redelivery 2: the group re-reads its topic with its dedupe rows cleared, so the handler
    // sees the job's event a second time; the job is no longer pending and is left as it is.
    consumer.stop_cleanly(Duration::from_secs(30)).await?;
    let prefix = exports.env.group_prefix.clone();
    exports.env.run_to_end(
        "pipeline",
        &[
            "reprocess",
            "--group",
            "export",
            "--group-prefix",
            &prefix,
            "--topic",
            &exports.topic,
            "--from",
            "0",
            "--clear-dedupe",
            "--actor",
            "test",
            "--note",
            "redeliver the export job",
        ],
        Duration::from_secs(60),
    )?;
    assert_eq!(processed_rows(&exports).await?, 0, "dedupe rows cleared");
    let (consumer, consumer_metrics) = exports
        .env
        .export_consumer("export-consumer-2", &exports.topic, &exports.dir, &[])
        .await?;
    wait_until(
        "job event applied again",
        Duration::from_secs(60),
        || async { Ok((processed_rows(&exports).await? >= 1).then_some(())) },
    )
    .await?;
    wait_group_caught_up(&exports).await?;
    // The handler saw the job's event again and left the job as it was.
    let _ = consumer
        .wait_for_log_value(
            "export event redelivered; job left as it is ",
            Duration::from_secs(30),
        )
        .await?;
    assert_eq!(exports.get(&id).await?.1["state"], "succeeded");
    assert_eq!(
        dir_listing(&exports.dir)?,
        before,
        "same file, same inode and mtime, no temporary file"
    );
    assert_eq!(exports.job_row(job_id).await?, row_before, "job unchanged");
    assert_eq!(
        scrape_sum(&consumer_metrics, "export_jobs_total", &[]).await?,
        0.0,
        "the second consumer attempted no export"
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letter WHERE group_name = $1")
        .bind(exports.env.group("export"))
        .fetch_one(&exports.env.pool)
        .await?;
    assert_eq!(dead, 0);

    consumer.stop_cleanly(Duration::from_secs(30)).await?;
    exports.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_export_is_removed_and_answers_gone() -> anyhow::Result<()> {
    let (exports, consumer) = Exports::start(
        "export-expiry",
        &["--export-ttl", "2s", "--export-sweep-interval", "200ms"],
    )
    .await?;
    seed_orders(&exports.env).await?;
    let job = exports
        .submit(&json!({ "customer_id": "customer-7" }))
        .await?;
    let id = job["id"].as_str().unwrap_or_default().to_owned();
    let done = exports.wait_for_state(&id, "succeeded").await?;
    let expected: i64 =
        sqlx::query_scalar("SELECT count(*) FROM orders WHERE customer_id = 'customer-7'")
            .fetch_one(&exports.env.pool)
            .await?;
    assert_eq!(done["row_count"], expected);
    let file = exports.dir.join(format!("export-{id}.csv"));
    assert!(file.exists());

    let expired = exports.wait_for_state(&id, "expired").await?;
    assert_eq!(expired["checksum"], done["checksum"], "the record stays");
    wait_until("file removed", Duration::from_secs(30), || async {
        Ok((!file.exists()).then_some(()))
    })
    .await?;
    wait_until("job marked expired", Duration::from_secs(30), || async {
        let state: String = sqlx::query_scalar("SELECT state FROM export_job WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&exports.env.pool)
            .await?;
        Ok((state == "expired").then_some(()))
    })
    .await?;
    let answer = exports
        .http
        .get(format!("{}/exports/{id}/download", exports.url))
        .send()
        .await?;
    assert_eq!(answer.status(), 410);
    let reason: Value = answer.json().await?;
    assert!(
        reason["error"]
            .as_str()
            .unwrap_or_default()
            .contains("expired"),
        "{reason}"
    );
    assert!(dir_listing(&exports.dir)?.is_empty());
    wait_until("expiry counted", Duration::from_secs(10), || async {
        let expired = scrape_sum(&exports.consumer_metrics, "export_expired_total", &[]).await?;
        Ok((expired > 0.0).then_some(()))
    })
    .await?;
    let metrics = scrape(&exports.consumer_metrics).await?;
    assert_eq!(metric_sum(&metrics, "export_expired_total", &[]), 1.0);
    assert_eq!(metric_sum(&metrics, "export_jobs_waiting", &[]), 0.0);
    assert_eq!(
        metric_sum(&metrics, "export_oldest_waiting_seconds", &[]),
        0.0
    );

    consumer.stop_cleanly(Duration::from_secs(30)).await?;
    exports.stop().await
}
