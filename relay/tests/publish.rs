//! The relay step against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`) and a real
//! Kafka-protocol broker (`KAFKA_BROKERS`, default 127.0.0.1:9092).

mod common;

use std::time::{Duration, Instant};

use pipeline_core::envelope::Envelope;
use pipeline_testkit::kafka::{brokers, kafka_args};
use prometheus::Registry;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use relay::backoff::RetryPolicy;
use relay::metrics::RelayMetrics;
use relay::publish::{create_producer, ProducerSettings};
use relay::relay::relay_batch;
use sqlx::PgPool;
use uuid::Uuid;

fn settings(delivery_timeout: Duration) -> ProducerSettings {
    ProducerSettings {
        delivery_timeout,
        linger: Duration::from_millis(1),
        compression: "none".into(),
        statistics_interval: Duration::ZERO,
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(1),
        max: Duration::from_millis(5),
        slow_after: 100,
        slow_interval: Duration::from_millis(5),
        permanent_attempts: 2,
    }
}

async fn topic() -> String {
    let topic = format!("relay-test-{}", Uuid::new_v4().simple());
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 3)
        .await
        .expect("topic");
    topic
}

async fn enqueue(
    pool: &PgPool,
    topic: &str,
    order: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> Uuid {
    let mut tx = pool.begin().await.expect("begin");
    let event = producer::outbox::NewEvent {
        business_key: order.to_owned(),
        event_type: event_type.to_owned(),
        aggregate_id: order.to_owned(),
        topic: topic.to_owned(),
        payload,
        headers: vec![(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        )],
    };
    let id = producer::outbox::enqueue(&mut tx, &event)
        .await
        .expect("enqueue")
        .event_id();
    tx.commit().await.expect("commit");
    id
}

async fn row(
    pool: &PgPool,
    event_id: Uuid,
) -> (String, i32, Option<String>, Option<i32>, Option<i64>) {
    sqlx::query_as("SELECT state, attempts, last_error, kafka_partition, kafka_offset FROM outbox_status WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(pool)
        .await
        .expect("row")
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn a_message_too_large_fails_with_its_reason_and_holds_its_order_only(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let topic = topic().await;
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let producer = create_producer(
        &kafka_args(&brokers()),
        &settings(Duration::from_secs(10)),
        metrics.clone(),
    )
    .expect("producer");
    let huge = serde_json::json!({ "blob": "x".repeat(2 * 1024 * 1024) });
    let x1 = enqueue(&pool, &topic, "order-x", "order.placed", huge).await;
    let x2 = enqueue(
        &pool,
        &topic,
        "order-x",
        "order.paid",
        serde_json::json!({"n": 2}),
    )
    .await;
    let y1 = enqueue(
        &pool,
        &topic,
        "order-y",
        "order.placed",
        serde_json::json!({"text": "Robert'); DROP TABLE outbox;-- 顧客 ✓"}),
    )
    .await;

    for _ in 0..20 {
        relay_batch(&pool, &producer, &lease, 100, &policy(), &metrics)
            .await
            .expect("step");
        if row(&pool, x1).await.0 == "failed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (state, attempts, error, _, _) = row(&pool, x1).await;
    assert_eq!(
        (state.as_str(), attempts),
        ("failed", 2),
        "given up after the configured attempts"
    );
    assert!(
        error
            .unwrap_or_default()
            .to_lowercase()
            .contains("too large"),
        "reason recorded"
    );
    let (state, attempts, ..) = row(&pool, x2).await;
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 0),
        "the order's later event is held, never sent"
    );
    let (state, _, _, partition, offset) = row(&pool, y1).await;
    assert_eq!(state, "published", "other orders flow");

    // The published record carries the key, the envelope and the payload byte for byte.
    let consumer: BaseConsumer = kafka_args(&brokers())
        .client_config()
        .set("group.id", "relay-test-reader")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(
        &topic,
        partition.expect("partition"),
        Offset::Offset(offset.expect("offset")),
    )
    .expect("tpl");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(20);
    let msg = loop {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            break m;
        }
        assert!(Instant::now() < deadline, "record not readable");
    };
    assert_eq!(msg.key(), Some("order-y".as_bytes()));
    let env = Envelope::from_record(msg.key(), msg.headers()).expect("envelope");
    assert_eq!(
        (env.event_id, env.sequence, env.event_type.as_str()),
        (y1, 1, "order.placed")
    );
    assert_eq!(
        env.traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    let payload: serde_json::Value =
        serde_json::from_slice(msg.payload().expect("payload")).expect("json");
    assert_eq!(payload["text"], "Robert'); DROP TABLE outbox;-- 顧客 ✓");
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn broker_down_records_backoff_and_the_event_goes_out_once_a_broker_answers(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let topic = topic().await;
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let e1 = enqueue(
        &pool,
        &topic,
        "order-z",
        "order.placed",
        serde_json::json!({}),
    )
    .await;

    // Nothing listens on port 1: every delivery times out.
    let down = create_producer(
        &kafka_args("127.0.0.1:1"),
        &settings(Duration::from_millis(1500)),
        metrics.clone(),
    )
    .expect("producer");
    let retry = RetryPolicy {
        base: Duration::from_secs(2),
        max: Duration::from_secs(10),
        ..policy()
    };
    let outcome = relay_batch(&pool, &down, &lease, 100, &retry, &metrics)
        .await
        .expect("step");
    assert_eq!((outcome.claimed, outcome.failed), (1, 1));
    let (state, attempts, error, ..) = row(&pool, e1).await;
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 1),
        "a transient failure never gives up"
    );
    assert!(error.is_some(), "last error recorded");
    let waiting: bool =
        sqlx::query_scalar("SELECT next_attempt_at > now() FROM outbox_status WHERE event_id = $1")
            .bind(e1)
            .fetch_one(&pool)
            .await
            .expect("next attempt");
    assert!(waiting, "next attempt scheduled in the future");
    let early = relay_batch(&pool, &down, &lease, 100, &retry, &metrics)
        .await
        .expect("step");
    assert_eq!(early.claimed, 0, "not retried before its next attempt time");

    let up = create_producer(
        &kafka_args(&brokers()),
        &settings(Duration::from_secs(10)),
        metrics.clone(),
    )
    .expect("producer");
    let deadline = Instant::now() + Duration::from_secs(15);
    while row(&pool, e1).await.0 != "published" {
        assert!(
            Instant::now() < deadline,
            "not published after the broker came back"
        );
        relay_batch(&pool, &up, &lease, 100, &retry, &metrics)
            .await
            .expect("step");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, attempts, error, ..) = row(&pool, e1).await;
    assert_eq!((attempts, error), (2, None));
}
