//! Bad input through the real binaries: records written to the topic by another Kafka client,
//! strings that look like SQL or are not ASCII, and a burst far larger than one relay batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use pipeline_core::envelope::Envelope;
use pipeline_testkit::kafka::read_topic;
use pipeline_testkit::{scrape_sum, wait_until, TestEnv};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

const GROUPS: [&str; 2] = ["inventory", "notification"];

fn snapshot(order: Uuid, status: OrderStatus) -> Vec<u8> {
    serde_json::to_vec(&OrderSnapshot {
        order_id: order,
        customer_id: "c-raw".into(),
        email: None,
        status,
        lines: vec![OrderLine {
            product_id: "sku-00001".into(),
            quantity: 1,
        }],
    })
    .expect("json")
}

fn envelope(order: Uuid, sequence: i64, event_type: &str) -> OwnedHeaders {
    Envelope {
        event_id: Uuid::new_v4(),
        event_type: event_type.into(),
        aggregate_id: order.to_string(),
        sequence,
        occurred_at: chrono::Utc::now(),
        traceparent: None,
    }
    .to_headers(&[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_bad_records_are_dead_lettered_with_their_cause_and_the_rest_flows(
) -> anyhow::Result<()> {
    let env = TestEnv::new("badrec", 3).await?;
    env.seed_stock(1, None)?;
    let (_consumer, metrics) = env.consumer("consumer").await?;

    let producer: FutureProducer = env.kafka().client_config().set("acks", "all").create()?;
    let (bad_json, unknown, missing, good) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let send = |key: Option<String>, payload: Vec<u8>, headers: Option<OwnedHeaders>| {
        let producer = producer.clone();
        let topic = env.topic.clone();
        async move {
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&topic).payload(payload.as_slice());
            if let Some(k) = &key {
                record = record.key(k.as_bytes());
            }
            if let Some(h) = headers {
                record = record.headers(h);
            }
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
        }
    };
    send(
        Some(bad_json.to_string()),
        b"{\"order_id\": oops".to_vec(),
        Some(envelope(bad_json, 1, "order.placed")),
    )
    .await?;
    send(
        Some(unknown.to_string()),
        snapshot(unknown, OrderStatus::Placed),
        Some(envelope(unknown, 1, "order.teleported")),
    )
    .await?;
    send(
        None,
        snapshot(good, OrderStatus::Placed),
        Some(envelope(good, 1, "order.placed")),
    )
    .await?;
    send(
        Some(missing.to_string()),
        snapshot(missing, OrderStatus::Placed),
        None,
    )
    .await?;
    send(
        Some(good.to_string()),
        snapshot(good, OrderStatus::Placed),
        Some(envelope(good, 1, "order.placed")),
    )
    .await?;
    send(
        Some(good.to_string()),
        snapshot(good, OrderStatus::Paid),
        Some(envelope(good, 2, "order.paid")),
    )
    .await?;

    env.wait_drained(&GROUPS, Duration::from_secs(90)).await?;
    for kind in GROUPS {
        let group = env.group(kind);
        let reasons: Vec<String> = sqlx::query_scalar(
            "SELECT reason FROM dead_letter WHERE group_name = $1 ORDER BY reason",
        )
        .bind(&group)
        .fetch_all(&env.pool)
        .await?;
        let all = reasons.join(" | ");
        assert_eq!(reasons.len(), 4, "{kind}: {all}");
        for expected in ["not JSON", "unknown event type", "no key", "missing header"] {
            assert!(
                all.contains(expected),
                "{kind}: no dead letter saying `{expected}`: {all}"
            );
        }
        let applied: Vec<i64> = sqlx::query_scalar(
            "SELECT sequence FROM applied_effect WHERE group_name = $1 AND aggregate_id = $2 ORDER BY id",
        )
        .bind(&group)
        .bind(good.to_string())
        .fetch_all(&env.pool)
        .await?;
        assert_eq!(
            applied,
            vec![1, 2],
            "{kind}: the good order still flows, in order"
        );
        let dead = scrape_sum(
            &metrics,
            "consumer_messages_total",
            &[&format!("group=\"{group}\""), "outcome=\"dead_lettered\""],
        )
        .await?;
        assert_eq!(dead as i64, 4, "{kind}: dead letters counted");
    }

    // The dead-letter topic has each of them, with the cause and the origin in headers.
    let dlq = format!("{}.dlq", env.topic);
    let records: Vec<HashMap<String, String>> =
        read_topic(&env.kafka(), &dlq, 8, Duration::from_secs(30))?
            .iter()
            .map(|m| {
                m.headers()
                    .map(|h| {
                        h.iter()
                            .map(|Header { key, value }| {
                                (
                                    key.to_owned(),
                                    String::from_utf8_lossy(value.unwrap_or_default()).into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();
    assert_eq!(
        records.len(),
        8,
        "one dead-letter record per bad record and group"
    );
    for h in &records {
        for name in [
            "dlq-reason",
            "dlq-group",
            "dlq-original-topic",
            "dlq-original-partition",
            "dlq-original-offset",
            "dlq-attempts",
            "dlq-first-failure-at",
            "dlq-last-failure-at",
        ] {
            assert!(h.contains_key(name), "missing {name} in {h:?}");
        }
        assert_eq!(h["dlq-original-topic"], env.topic);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_looking_and_non_ascii_strings_arrive_byte_for_byte() -> anyhow::Result<()> {
    let env = TestEnv::new("strings", 3).await?;
    env.seed_catalog(1)?;
    env.seed_stock(1, None)?;
    let (_svc, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let (_consumer, _) = env.consumer("consumer").await?;

    let customer = "Robert'); DROP TABLE orders;-- \\ \" % _ $1";
    let email = "zoë.ünïcödé+✓🚀@例え.jp";
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{url}/orders"))
        .json(&serde_json::json!({
            "customer_id": customer,
            "email": email,
            "lines": [{"product_id": "sku-00001", "quantity": 1}],
        }))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 201);
    let order: serde_json::Value = response.json().await?;
    assert_eq!(order["customer_id"], customer);
    let order_id = order["order_id"].as_str().expect("order id").to_owned();

    wait_until("notification recorded", Duration::from_secs(60), || async {
        let n: Option<(String, String)> =
            sqlx::query_as("SELECT recipient, order_id FROM notification WHERE order_id = $1")
                .bind(&order_id)
                .fetch_optional(&env.pool)
                .await?;
        Ok(n)
    })
    .await
    .map(|(recipient, _)| assert_eq!(recipient, email, "delivered byte for byte"))?;
    let stored: String =
        sqlx::query_scalar("SELECT customer_id FROM orders WHERE order_id::text = $1")
            .bind(&order_id)
            .fetch_one(&env.pool)
            .await?;
    assert_eq!(stored, customer);
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(tables, 1, "and the orders table is still there");
    Ok(())
}

fn peak_rss_mb(pid: nix::unistd::Pid) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
    Ok(kb / 1024.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_far_larger_than_a_batch_is_paged_through_in_bounded_memory() -> anyhow::Result<()>
{
    const EVENTS: i64 = 60_000;
    const BATCH: i64 = 2_000;
    let env = TestEnv::new("burst", 12).await?;
    sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
         SELECT gen_random_uuid(), 'o' || (g / 3), CASE g % 3 WHEN 0 THEN 'order.placed'
                WHEN 1 THEN 'order.paid' ELSE 'order.shipped' END,
                'o' || (g / 3), 1 + g % 3, $2,
                jsonb_build_object('order', g / 3, 'note', repeat('x', 300))
         FROM generate_series(0, $1 - 1) AS g",
    )
    .bind(EVENTS)
    .bind(&env.topic)
    .execute(&env.pool)
    .await?;
    let started = Instant::now();
    let (relay, metrics) = env
        .relay_with_args("relay", &["--batch-size", &BATCH.to_string()])
        .await?;
    wait_until("burst drained", Duration::from_secs(240), || async {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
            .fetch_one(&env.pool)
            .await?;
        Ok((left == 0).then_some(()))
    })
    .await?;
    let elapsed = started.elapsed();
    let batches = scrape_sum(&metrics, "relay_batch_size_count", &[]).await?;
    let peak = peak_rss_mb(relay.pid())?;
    println!(
        "burst: {EVENTS} events in {elapsed:.1?} ({:.0}/s), {batches} batches, relay peak RSS {peak:.0} MB",
        EVENTS as f64 / elapsed.as_secs_f64()
    );
    assert!(
        batches >= (EVENTS / BATCH) as f64,
        "paged through in batches, not loaded at once"
    );
    assert!(
        peak < 150.0,
        "relay memory bounded by the batch size, not the backlog: {peak:.0} MB"
    );
    Ok(())
}
