//! The release step against a real PostgreSQL and a real Kafka-protocol broker: delayed events
//! are released into the outbox when due and not before, in their aggregate's sequence at that moment (never holding
//! the aggregate's other events), once per business fact, withdrawn when cancelled, and only by
//! the lease's holder.

use crate::common;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::relay_batch;
use outbox::{Delayed, NewEvent, PublishAt};
use pipeline_core::envelope::Envelope;
use pipeline_testkit::kafka::{brokers, kafka_args};
use prometheus::Registry;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use relay::backoff::RetryPolicy;
use relay::mark::MarkError;
use relay::metrics::RelayMetrics;
use relay::publish::{create_producer, ProducerSettings};
use relay::release::release_due;
use sqlx::PgPool;
use uuid::Uuid;

fn event(topic: &str, order: &str, event_type: &str) -> NewEvent {
    NewEvent {
        business_key: order.to_owned(),
        event_type: event_type.to_owned(),
        aggregate_id: order.to_owned(),
        topic: topic.to_owned(),
        payload: serde_json::json!({ "order": order, "type": event_type }),
        headers: vec![],
    }
}

async fn enqueue_now(pool: &PgPool, e: &NewEvent) -> Uuid {
    let mut tx = pool.begin().await.expect("begin");
    let id = outbox::enqueue(&mut tx, e)
        .await
        .expect("enqueue")
        .event_id();
    tx.commit().await.expect("commit");
    id
}

async fn enqueue_later(pool: &PgPool, e: &NewEvent, when: PublishAt) -> Delayed {
    let mut tx = pool.begin().await.expect("begin");
    let s = outbox::enqueue_at(&mut tx, e, when)
        .await
        .expect("enqueue_at");
    tx.commit().await.expect("commit");
    s
}

async fn topic() -> String {
    let topic = format!("relay-sched-{}", Uuid::new_v4().simple());
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 1)
        .await
        .expect("topic");
    topic
}

/// (event id, sequence) of the aggregate's events in the outbox, in sequence order.
async fn in_outbox(pool: &PgPool, order: &str) -> Vec<(Uuid, i64)> {
    sqlx::query_as(
        "SELECT event_id, sequence FROM outbox WHERE aggregate_id = $1 ORDER BY sequence",
    )
    .bind(order)
    .fetch_all(pool)
    .await
    .expect("outbox")
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_delayed_event_goes_out_when_due_after_what_its_order_committed_before(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let topic = topic().await;
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let producer = create_producer(
        &kafka_args(&brokers()),
        &ProducerSettings {
            delivery_timeout: Duration::from_secs(10),
            linger: Duration::from_millis(1),
            compression: "none".into(),
            statistics_interval: Duration::ZERO,
        },
        metrics.clone(),
    )
    .expect("producer");
    let retry = RetryPolicy {
        base: Duration::from_millis(1),
        max: Duration::from_millis(5),
        slow_after: 100,
        slow_interval: Duration::from_millis(5),
        max_attempts: 2,
    };

    let placed = enqueue_now(&pool, &event(&topic, "order-a", "order.placed")).await;
    let reminder = enqueue_later(
        &pool,
        &event(&topic, "order-a", "order.payment_reminder"),
        PublishAt::After(Duration::from_secs(5)),
    )
    .await;
    let Delayed::New {
        event_id: reminder,
        publish_at,
    } = reminder
    else {
        panic!("delayed anew: {reminder:?}")
    };
    let paid = enqueue_now(&pool, &event(&topic, "order-a", "order.paid")).await;

    // Not due: nothing is released, and the order's later event is not held by it.
    assert_eq!(
        release_due(&pool, lease.fence(), 100)
            .await
            .expect("release")
            .events,
        0
    );
    relay_batch(&pool, &producer, &lease, 100, &retry, &metrics)
        .await
        .expect("step");
    assert_eq!(
        in_outbox(&pool, "order-a").await,
        vec![(placed, 1), (paid, 2)]
    );
    let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delivery")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(published, 2, "the immediate events are published at once");

    // Due: released with the order's next sequence number, then published.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let released = release_due(&pool, lease.fence(), 100)
            .await
            .expect("release")
            .events;
        if released > 0 {
            assert_eq!(released, 1);
            break;
        }
        assert!(Instant::now() < deadline, "never released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let entered: DateTime<Utc> =
        sqlx::query_scalar("SELECT created_at FROM outbox WHERE event_id = $1")
            .bind(reminder)
            .fetch_one(&pool)
            .await
            .expect("released row");
    assert!(
        entered >= publish_at,
        "released at {entered}, due {publish_at}"
    );
    relay_batch(&pool, &producer, &lease, 100, &retry, &metrics)
        .await
        .expect("step");
    assert_eq!(
        in_outbox(&pool, "order-a").await,
        vec![(placed, 1), (paid, 2), (reminder, 3)]
    );

    // In Kafka: the order's records in sequence order, the reminder last, with its times.
    let consumer: BaseConsumer = kafka_args(&brokers())
        .client_config()
        .set("group.id", "relay-sched-reader")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&topic, 0, Offset::Beginning)
        .expect("tpl");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    while seen.len() < 3 {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let env = Envelope::from_record(m.key(), m.headers()).expect("envelope");
            let header = |name: &str| {
                m.headers().and_then(|h| {
                    h.iter()
                        .find(|x| x.key == name)
                        .and_then(|x| x.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                })
            };
            seen.push((env.event_id, env.sequence, header("publish-at")));
        }
        assert!(Instant::now() < deadline, "records not readable: {seen:?}");
    }
    assert_eq!(
        seen.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(),
        vec![(placed, 1), (paid, 2), (reminder, 3)]
    );
    assert!(seen[0].2.is_none() && seen[1].2.is_none());
    let header_at: DateTime<Utc> = seen[2]
        .2
        .as_deref()
        .expect("publish-at header")
        .parse()
        .expect("RFC 3339");
    assert_eq!(header_at, publish_at);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_delayed_fact_is_recorded_once_and_a_cancelled_one_never_published(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let soon = PublishAt::After(Duration::from_millis(200));
    let first = enqueue_later(
        &pool,
        &event("t", "order-b", "order.payment_reminder"),
        soon,
    )
    .await;
    let again = enqueue_later(
        &pool,
        &event("t", "order-b", "order.payment_reminder"),
        soon,
    )
    .await;
    assert!(matches!(first, Delayed::New { .. }));
    assert_eq!(
        again,
        Delayed::Duplicate {
            event_id: first.event_id()
        }
    );
    // A fact already in the outbox is not delayed again.
    let now = enqueue_now(&pool, &event("t", "order-c", "order.placed")).await;
    let late = enqueue_later(&pool, &event("t", "order-c", "order.placed"), soon).await;
    assert_eq!(late, Delayed::Duplicate { event_id: now });

    // Cancelled before it is due: never released.
    let cancel = event("t", "order-d", "order.payment_reminder");
    let _ = enqueue_later(&pool, &cancel, soon).await;
    let mut tx = pool.begin().await.expect("begin");
    let withdrawn = outbox::cancel_delayed(&mut tx, &[("order-d", "order.payment_reminder")])
        .await
        .expect("cancel");
    tx.commit().await.expect("commit");
    assert_eq!(withdrawn, 1);

    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        release_due(&pool, lease.fence(), 100)
            .await
            .expect("release")
            .events,
        1,
        "only order-b's reminder, once"
    );
    assert_eq!(in_outbox(&pool, "order-b").await.len(), 1);
    assert!(in_outbox(&pool, "order-d").await.is_empty());
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delayed")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(waiting, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn only_the_lease_holder_releases(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let _ = enqueue_later(
        &pool,
        &event("t", "order-e", "order.payment_reminder"),
        PublishAt::At(Utc::now() - chrono::Duration::seconds(5)),
    )
    .await;
    let mut stale = lease.fence();
    stale.epoch += 1;
    assert!(matches!(
        release_due(&pool, stale, 100).await,
        Err(MarkError::LeaseLost(_))
    ));
    assert!(in_outbox(&pool, "order-e").await.is_empty());
    assert_eq!(
        release_due(&pool, lease.fence(), 100)
            .await
            .expect("release")
            .events,
        1,
        "an event already due when written is released at once"
    );
}

/// The backlog reading every relay makes each second counts the delayed events that are due from
/// the head of the due-time index: with thousands waiting a day ahead it reads only the due one,
/// and reports it.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_backlog_reading_reads_only_the_due_delayed_events(pool: PgPool) {
    let ahead = 3000;
    let later: Vec<(NewEvent, PublishAt)> = (0..ahead)
        .map(|i| {
            (
                event("t", &format!("order-a{i}"), "order.payment_reminder"),
                PublishAt::At(Utc::now() + chrono::Duration::days(1)),
            )
        })
        .collect();
    let mut tx = pool.begin().await.expect("begin");
    let _ = outbox::enqueue_all_at(&mut tx, &later)
        .await
        .expect("enqueue_all_at");
    tx.commit().await.expect("commit");
    let _ = enqueue_later(
        &pool,
        &event("t", "order-due", "order.payment_reminder"),
        PublishAt::At(Utc::now() - chrono::Duration::seconds(5)),
    )
    .await;
    sqlx::raw_sql("ANALYZE outbox_delayed")
        .execute(&pool)
        .await
        .expect("analyze");

    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {}",
        relay::backlog::BACKLOG_SQL
    ))
    .bind(1_i64)
    .fetch_all(&pool)
    .await
    .expect("explain");
    let plan = plan.join("\n");
    // Every node over the delayed events reads the due one alone: none reads the table whole,
    // and none reads the events ahead only to throw them away.
    assert!(!plan.contains("Seq Scan on outbox_delayed"), "{plan}");
    let thrown_away: i64 = plan
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Rows Removed by Filter: "))
        .filter_map(|n| n.parse::<i64>().ok())
        .sum();
    assert!(
        thrown_away < 10,
        "{thrown_away} rows read and dropped:\n{plan}"
    );

    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    relay::backlog::refresh_backlog(&pool, 1, &metrics)
        .await
        .expect("backlog");
    assert_eq!(metrics.delayed_due.get(), 1);
    assert!(metrics.delayed_overdue.get() >= 5.0);
}
