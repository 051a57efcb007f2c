//! A fatal error of the idempotent producer, with the relay loop running against a real
//! PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`).
//!
//! librdkafka raises a fatal idempotence error only when a broker's answers break the sequence
//! bookkeeping, which no healthy broker does on demand; librdkafka's own mock cluster can answer
//! the first produce request with such an error, so Kafka is that mock cluster here and only here.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pipeline_core::envelope::Envelope;
use pipeline_core::kafka::KafkaArgs;
use prometheus::Registry;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{Offset, TopicPartitionList};
use relay::{Relay, RelaySettings};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "orders";

async fn enqueue(pool: &PgPool, order: &str, n: i64) {
    let mut tx = pool.begin().await.expect("begin");
    let event = outbox::NewEvent {
        business_key: format!("{order}-{n}"),
        event_type: "order.changed".to_owned(),
        aggregate_id: order.to_owned(),
        topic: TOPIC.to_owned(),
        payload: serde_json::json!({ "n": n }),
        headers: Vec::new(),
    };
    let _ = outbox::enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_status WHERE state = 'published'")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Every record of the topic's one partition, as (aggregate, sequence) in log order.
fn read_all(bootstrap: &str, expected: usize) -> Vec<(String, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "fatal-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(TOPIC, 0, Offset::Beginning)
        .expect("partition");
    consumer.assign(&tpl).expect("assign");
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.len() < expected && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let env = Envelope::from_record(m.key(), m.headers()).expect("envelope headers");
            seen.push((env.aggregate_id, env.sequence));
        }
    }
    seen
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn after_a_fatal_producer_error_the_relay_renews_its_producer_and_publishes_everything_in_order(
    pool: PgPool,
) {
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic(TOPIC, 1, 1).expect("topic");
    // The first produce request fails at the head of the line with a sequence error: librdkafka
    // can no longer vouch for once-and-in-order and fails the producer instance for good.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let orders = ["order-a", "order-b", "order-c"];
    for n in 1..=4 {
        for order in orders {
            enqueue(&pool, order, n).await;
        }
    }
    let total = (orders.len() * 4) as i64;

    let settings = RelaySettings {
        kafka: KafkaArgs {
            kafka_brokers: mock.bootstrap_servers(),
            // The mock fails only the request it was told to fail; a real broker also refuses
            // every request in flight behind it (their sequences follow a gap). One request at
            // a time gives the mock the real broker's outcome: nothing after the failed one is
            // written.
            kafka_options: vec![(
                "max.in.flight.requests.per.connection".to_owned(),
                "1".to_owned(),
            )],
        },
        retry_base: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        lock_key: i64::from(rand::random::<i32>()),
        ..RelaySettings::default()
    };
    let registry = Registry::new();
    let relay = Relay::new(settings, pool.clone(), &registry).expect("relay");
    let metrics = relay.metrics().clone();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(relay.run(shutdown.clone()));

    let deadline = Instant::now() + Duration::from_secs(30);
    while published(&pool).await < total {
        assert!(
            Instant::now() < deadline,
            "{} of {total} published after 30 s",
            published(&pool).await
        );
        assert!(!relay.is_finished(), "the relay stopped: {:?}", relay.await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay ran");

    let renewals: f64 = registry
        .gather()
        .iter()
        .filter(|f| f.name() == "relay_producer_renewals_total")
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value())
        .sum();
    assert!(renewals >= 1.0, "the broken producer was replaced");
    assert!(
        metrics
            .publish_errors
            .with_label_values(&["producer_fatal"])
            .get()
            >= 1,
        "the failed attempt is counted as a fatal producer error"
    );

    // Every event reached the topic, and each order's first appearances follow its sequence.
    let seen = read_all(&mock.bootstrap_servers(), total as usize);
    let mut next: HashMap<&str, i64> = orders.iter().map(|o| (*o, 1)).collect();
    for (order, sequence) in &seen {
        let want = next.get_mut(order.as_str()).expect("known order");
        if *sequence == *want {
            *want += 1;
        } else {
            assert!(
                *sequence < *want,
                "{order}: sequence {sequence} before {want} in {seen:?}"
            );
        }
    }
    assert!(
        next.values().all(|n| *n == 5),
        "every event of every order on the topic: {seen:?}"
    );
}
