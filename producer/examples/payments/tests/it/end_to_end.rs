//! The example end to end, on the real broker (`KAFKA_BROKERS`, default 127.0.0.1:9092) and a
//! real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): the payments service appends events in its
//! own transactions, the relay publishes them, the `shipping` group applies every one once and
//! in order per payment.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common;

use payments_example::{program, Payments};
use pipeline_testkit::db::database_url;
use pipeline_testkit::kafka::{brokers, committed_lag, kafka_args};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const PAYMENTS: usize = 60;

#[sqlx::test(migrations = false)]
async fn payments_reach_the_shipping_group_once_and_in_order(pool: PgPool) {
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("payment-events-{run_id}");
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 6)
        .await
        .expect("topic");
    let url = database_url(&pool);
    let shutdown = CancellationToken::new();

    // The example's program: its tables, its registry and router, the shipping group, and the
    // relay, in one process.
    let mut config = common::config(&url, &topic, &format!("{run_id}-"));
    config.relay = Some(relay::RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key: rand_key(),
        ..relay::RelaySettings::default()
    });
    let program = program::start(config, shutdown.clone())
        .await
        .expect("the program starts");
    let addr = program.addr;
    let running = tokio::spawn(program.wait());

    // The service at work: every payment captured, every third one refunded afterwards.
    let payments = Payments::new(pool.clone(), topic.clone());
    let mut expected: BTreeMap<String, Vec<(i64, &str)>> = BTreeMap::new();
    for n in 0..PAYMENTS {
        let id = format!("pay-{n}");
        let captured = payments
            .capture(&id, 1_000 + n as i64)
            .await
            .expect("capture");
        expected
            .entry(id.clone())
            .or_default()
            .push((captured.sequence(), "ship"));
        if n % 3 == 0 {
            let refunded = payments.refund(&id).await.expect("refund");
            expected
                .entry(id)
                .or_default()
                .push((refunded.sequence(), "cancel"));
        }
    }
    let events: usize = expected.values().map(Vec::len).sum();

    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let logged: i64 = sqlx::query_scalar("SELECT count(*) FROM shipment_log")
            .fetch_one(&pool)
            .await
            .expect("count");
        if logged as usize >= events {
            break;
        }
        assert!(!running.is_finished(), "the program stopped");
        assert!(
            Instant::now() < deadline,
            "{logged} of {events} events applied after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Look once nothing more can come: the relay has published everything and the group has
    // committed every offset, so no delivery (a duplicate included) is still on its way.
    let group = format!("{run_id}-shipping");
    loop {
        let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
            .fetch_one(&pool)
            .await
            .expect("count");
        let lag = {
            let (group, topic) = (group.clone(), topic.clone());
            tokio::task::spawn_blocking(move || {
                committed_lag(&kafka_args(&brokers()), &group, &topic)
            })
            .await
            .expect("lag task")
            .expect("lag")
        };
        if unpublished == 0 && lag == Some(0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained after 90 s: {unpublished} unpublished, lag {lag:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT payment_id, sequence, action FROM shipment_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("log");
    let mut applied: BTreeMap<String, Vec<(i64, &str)>> = BTreeMap::new();
    for (payment, sequence, action) in &rows {
        let action = if action == "ship" { "ship" } else { "cancel" };
        applied
            .entry(payment.clone())
            .or_default()
            .push((*sequence, action));
    }
    assert_eq!(rows.len(), events, "every event applied once");
    assert_eq!(applied, expected, "in order per payment");

    // The program's own route and the libraries' metrics, on its one router.
    let http = reqwest::Client::new();
    let refunded: serde_json::Value = http
        .get(format!("http://{addr}/payments/pay-0"))
        .send()
        .await
        .expect("GET /payments/pay-0")
        .json()
        .await
        .expect("json");
    assert_eq!(refunded["status"], "refunded");
    let metrics = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    for name in ["outbox_published_total", "consumer_messages_total"] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }

    shutdown.cancel();
    running
        .await
        .expect("the program's task")
        .expect("the program stops cleanly");
}

fn rand_key() -> i64 {
    i64::from(uuid::Uuid::new_v4().as_fields().0)
}
