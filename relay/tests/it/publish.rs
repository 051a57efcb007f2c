//! The relay step against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`) and a real
//! Kafka-protocol broker (`KAFKA_BROKERS`, default 127.0.0.1:9092).

use crate::common;

use std::ops::AsyncFnMut;
use std::time::{Duration, Instant};

use common::relay_batch;
use outbox::{EnqueueError, NewEvent, Outbox, OutboxSettings};
use pipeline_core::envelope::Envelope;
use pipeline_testkit::kafka::{brokers, kafka_args};
use prometheus::Registry;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use relay::backlog::refresh_backlog;
use relay::backoff::RetryPolicy;
use relay::lease::Lease;
use relay::metrics::RelayMetrics;
use relay::publish::{create_producer, ProducerSettings, RelayProducer};
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
        max_attempts: 2,
    }
}

/// The relay's metrics on a registry of their own, and a producer with a 10 s delivery timeout
/// reporting to them.
fn metrics_and_producer() -> (RelayMetrics, RelayProducer) {
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let producer = create_producer(
        &kafka_args(&brokers()),
        &settings(Duration::from_secs(10)),
        metrics.clone(),
    )
    .expect("producer");
    (metrics, producer)
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
    enqueue_with(&Outbox::default(), pool, topic, order, event_type, payload).await
}

fn new_event(topic: &str, order: &str, event_type: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent {
        business_key: order.to_owned(),
        event_type: event_type.to_owned(),
        aggregate_id: order.to_owned(),
        topic: topic.to_owned(),
        payload,
        headers: vec![(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        )],
    }
}

/// Appends one event through `outbox` (its settings decide what it refuses).
async fn enqueue_with(
    outbox: &Outbox,
    pool: &PgPool,
    topic: &str,
    order: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> Uuid {
    let mut tx = pool.begin().await.expect("begin");
    let event = new_event(topic, order, event_type, payload);
    let id = outbox
        .enqueue(&mut tx, &event)
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

/// Steps the relay until `done` holds or 20 s pass.
async fn relay_until(
    pool: &PgPool,
    producer: &RelayProducer,
    lease: &Lease,
    metrics: &RelayMetrics,
    what: &str,
    mut done: impl AsyncFnMut() -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done().await {
        assert!(Instant::now() < deadline, "not within 20 s: {what}");
        relay_batch(pool, producer, lease, 100, &policy(), metrics)
            .await
            .expect("step");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_message_too_large_fails_with_its_reason_and_holds_its_order_only(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let topic = topic().await;
    let (metrics, producer) = metrics_and_producer();
    // The library refuses it with its default limit (the producer's message.max.bytes); a
    // service configured with a limit above the producer's gets it into the outbox.
    let huge = serde_json::json!({ "blob": "x".repeat(2 * 1024 * 1024) });
    let too_lenient = Outbox::new(OutboxSettings {
        max_message_bytes: 4_000_000,
    });
    let mut tx = pool.begin().await.expect("begin");
    let refused = Outbox::default()
        .enqueue(
            &mut tx,
            &new_event(&topic, "order-x", "order.placed", huge.clone()),
        )
        .await;
    assert!(
        matches!(refused, Err(EnqueueError::TooLarge { .. })),
        "{refused:?}"
    );
    drop(tx);
    let x1 = enqueue_with(&too_lenient, &pool, &topic, "order-x", "order.placed", huge).await;
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

    relay_until(
        &pool,
        &producer,
        &lease,
        &metrics,
        "x1 failed",
        async || row(&pool, x1).await.0 == "failed",
    )
    .await;
    let (state, attempts, error, _, _) = row(&pool, x1).await;
    assert_eq!(
        (state.as_str(), attempts),
        ("failed", 2),
        "given up after the configured attempts"
    );
    let error = error.unwrap_or_default();
    let payload_bytes: i32 = sqlx::query_scalar(
        "SELECT octet_length(payload::text) FROM outbox_status WHERE event_id = $1",
    )
    .bind(x1)
    .fetch_one(&pool)
    .await
    .expect("payload size");
    assert!(
        error.to_lowercase().contains("too large")
            && error.contains(&format!("payload {payload_bytes} bytes")),
        "the reason names the size: {error}"
    );
    let gave_up: (String, String) = sqlx::query_as(
        "SELECT transition, detail FROM outbox_history WHERE event_id = $1 ORDER BY at DESC LIMIT 1",
    )
    .bind(x1)
    .fetch_one(&pool)
    .await
    .expect("history");
    assert_eq!(gave_up.0, "failed", "{gave_up:?}");
    assert!(gave_up.1.contains("too large"), "{gave_up:?}");
    let (state, attempts, ..) = row(&pool, x2).await;
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 0),
        "the order's later event is held, never sent"
    );
    let (state, _, _, partition, offset) = row(&pool, y1).await;
    assert_eq!(state, "published", "other orders flow");

    // Later events: the failed order's wait behind it, other orders' keep flowing.
    let x3 = enqueue(
        &pool,
        &topic,
        "order-x",
        "order.shipped",
        serde_json::json!({"n": 3}),
    )
    .await;
    let y2 = enqueue(
        &pool,
        &topic,
        "order-y",
        "order.paid",
        serde_json::json!({"n": 2}),
    )
    .await;
    relay_until(
        &pool,
        &producer,
        &lease,
        &metrics,
        "y2 published",
        async || row(&pool, y2).await.0 == "published",
    )
    .await;
    for _ in 0..3 {
        let outcome = relay_batch(&pool, &producer, &lease, 100, &policy(), &metrics)
            .await
            .expect("step");
        assert_eq!(
            outcome.claimed, 0,
            "the failed order's events are not claimed"
        );
    }
    for held in [x2, x3] {
        let (state, attempts, error, ..) = row(&pool, held).await;
        assert_eq!((state.as_str(), attempts, error), ("pending", 0, None));
    }

    // Said so: counted as failed once, each attempt's reason counted, and the gauges every
    // relay reports show the failed event and the two it holds.
    let failed = metrics.published.with_label_values(&["failed"]).get();
    let too_large = metrics
        .publish_errors
        .with_label_values(&["message_too_large"])
        .get();
    assert_eq!((failed, too_large), (1, 2));
    refresh_backlog(&pool, lease.fence().lock_key, &metrics)
        .await
        .expect("backlog");
    assert_eq!(
        (
            metrics.failed.get(),
            metrics.held.get(),
            metrics.unpublished.get()
        ),
        (1, 2, 3)
    );

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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_the_outbox_takes_at_its_limit_is_published_by_a_producer_with_that_limit(
    pool: PgPool,
) {
    const LIMIT: usize = 100_000;
    let (_elector, lease) = common::hold_lease(&pool).await;
    let topic = topic().await;
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let mut kafka = kafka_args(&brokers());
    kafka
        .kafka_options
        .push(("message.max.bytes".into(), LIMIT.to_string()));
    let producer = create_producer(&kafka, &settings(Duration::from_secs(10)), metrics.clone())
        .expect("producer");
    let outbox = Outbox::new(OutboxSettings {
        max_message_bytes: LIMIT,
    });

    // Exactly the limit by the outbox's count, then one byte more.
    let sized = |order: &str, blob: usize| {
        new_event(
            &topic,
            order,
            "order.placed",
            serde_json::json!({ "blob": "x".repeat(blob) }),
        )
    };
    let base = sized("order-a", 0).message_size().expect("size");
    let fits = sized("order-a", LIMIT - base);
    assert_eq!(fits.message_size(), Some(LIMIT));
    let mut tx = pool.begin().await.expect("begin");
    let refused = outbox
        .enqueue(&mut tx, &sized("order-b", LIMIT - base + 1))
        .await;
    assert!(
        matches!(refused, Err(EnqueueError::TooLarge { size, limit: LIMIT }) if size == LIMIT + 1),
        "{refused:?}"
    );
    let at_limit = outbox.enqueue(&mut tx, &fits).await.expect("at the limit");
    tx.commit().await.expect("commit");
    // A payload alone over the producer's limit, let in by a more lenient outbox.
    let lenient = Outbox::new(OutboxSettings {
        max_message_bytes: 2 * LIMIT,
    });
    let over = enqueue_with(
        &lenient,
        &pool,
        &topic,
        "order-c",
        "order.placed",
        serde_json::json!({ "blob": "x".repeat(LIMIT) }),
    )
    .await;

    let at_limit = at_limit.event_id();
    relay_until(
        &pool,
        &producer,
        &lease,
        &metrics,
        "the event at the limit published, the one over it failed",
        async || {
            row(&pool, at_limit).await.0 == "published" && row(&pool, over).await.0 == "failed"
        },
    )
    .await;
    assert_eq!(
        metrics
            .publish_errors
            .with_label_values(&["message_too_large"])
            .get(),
        2,
        "only the event over the producer's limit failed, once per attempt"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
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
    assert!(waiting, "next attempt due in the future");
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_for_a_topic_kafka_refuses_fails_and_holds_its_order(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let (metrics, producer) = metrics_and_producer();
    let bad_topic = "orders events!";
    // The library refuses it; another writer of the outbox table may not.
    let mut tx = pool.begin().await.expect("begin");
    let refused = Outbox::default()
        .enqueue(
            &mut tx,
            &new_event(bad_topic, "order-t", "order.placed", serde_json::json!({})),
        )
        .await;
    assert!(
        matches!(&refused, Err(EnqueueError::InvalidTopic(t)) if t == bad_topic),
        "{refused:?}"
    );
    drop(tx);
    let t1: Uuid = sqlx::query_scalar(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload)
         VALUES (gen_random_uuid(), 'order-t', 'order.placed', 'order-t', 1, $1, '{}')
         RETURNING event_id",
    )
    .bind(bad_topic)
    .fetch_one(&pool)
    .await
    .expect("insert");
    sqlx::query("INSERT INTO outbox_sequence (aggregate_id, last_sequence) VALUES ('order-t', 1)")
        .execute(&pool)
        .await
        .expect("sequence");
    // The order's next event comes after the first refusal (in the same batch, the broker's
    // refusal would come too late to hold it: see publish::published_ahead_of_failures).
    let first = relay_batch(&pool, &producer, &lease, 100, &policy(), &metrics)
        .await
        .expect("step");
    assert_eq!((first.claimed, first.failed), (1, 1));
    let t2 = enqueue(
        &pool,
        &topic().await,
        "order-t",
        "order.paid",
        serde_json::json!({}),
    )
    .await;

    relay_until(
        &pool,
        &producer,
        &lease,
        &metrics,
        "t1 failed",
        async || row(&pool, t1).await.0 == "failed",
    )
    .await;
    let (_, attempts, error, ..) = row(&pool, t1).await;
    assert_eq!(attempts, 2, "given up after the configured attempts");
    assert!(
        error.as_deref().unwrap_or_default().contains("topic"),
        "{error:?}"
    );
    let (state, attempts, ..) = row(&pool, t2).await;
    assert_eq!((state.as_str(), attempts), ("pending", 0), "held");
    let topic_errors: u64 = ["invalid_topic", "unknown_topic"]
        .iter()
        .map(|r| metrics.publish_errors.with_label_values(&[r]).get())
        .sum();
    assert_eq!(topic_errors, 2);
    refresh_backlog(&pool, lease.fence().lock_key, &metrics)
        .await
        .expect("backlog");
    assert_eq!((metrics.failed.get(), metrics.held.get()), (1, 1));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_creation_time_the_relay_cannot_carry_is_refused_when_written(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let (metrics, producer) = metrics_and_producer();
    let topic = topic().await;
    // A writer of the outbox table that sets `created_at` itself: a time no envelope can carry
    // (`occurred_at`) would stop the relay at that row.
    for (n, created_at) in ["infinity", "-infinity", "290000-01-01 00:00:00+00"]
        .into_iter()
        .enumerate()
    {
        let written = sqlx::query(
            "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                                 payload, created_at)
             VALUES (gen_random_uuid(), $1, 'order.placed', $1, 1, $2, '{}', $3::timestamptz)",
        )
        .bind(format!("order-time-{n}"))
        .bind(&topic)
        .bind(created_at)
        .execute(&pool)
        .await;
        match written {
            Err(sqlx::Error::Database(e)) => assert_eq!(
                e.constraint(),
                Some("outbox_created_at_range"),
                "{created_at}: {e}"
            ),
            other => {
                let step = relay_batch(&pool, &producer, &lease, 100, &policy(), &metrics).await;
                panic!("{created_at} written ({other:?}); the relay's next step: {step:?}")
            }
        }
    }
    let fine = enqueue(
        &pool,
        &topic,
        "order-time-fine",
        "order.placed",
        serde_json::json!({}),
    )
    .await;
    relay_until(
        &pool,
        &producer,
        &lease,
        &metrics,
        "the next event published",
        async || row(&pool, fine).await.0 == "published",
    )
    .await;
}
