//! The relay in `--source wal` on a real PostgreSQL (`wal_level = logical`) and Kafka: events go
//! out keyed by aggregate, in each aggregate's order, with the queue's headers, while writers
//! queue nothing and the relay records no delivery; a relay started after a clean stop publishes
//! nothing twice; a slot that disappeared is recovered from the horizon without losing an event;
//! a relay back on the queue falls back from the horizon; an event Kafka refuses for good joins
//! the queue as failed, for an operator's requeue.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use outbox::NewEvent;
use pipeline_core::envelope::Envelope;
use pipeline_testkit::db::database_url;
use pipeline_testkit::kafka::{brokers, kafka_args, read_topic};
use prometheus::Registry;
use rdkafka::message::{Headers, Message, OwnedMessage};
use relay::{Relay, RelaySettings, Source, SourceSettings};
use serde_json::json;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::common::drop_slot;

async fn topic() -> String {
    let topic = format!("relay-wal-{}", Uuid::new_v4().simple());
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 3)
        .await
        .expect("topic");
    topic
}

fn settings(pool: &PgPool, source: Source, slot: &str, lock_key: i64) -> RelaySettings {
    RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key,
        source: SourceSettings {
            source,
            slot: slot.to_owned(),
            replication_url: Some(database_url(pool)),
        },
        ..RelaySettings::default()
    }
}

fn start(
    pool: &PgPool,
    settings: RelaySettings,
) -> (CancellationToken, JoinHandle<Result<(), relay::RelayError>>) {
    let relay = Relay::new(settings, pool.clone(), &Registry::new()).expect("relay");
    let shutdown = CancellationToken::new();
    (shutdown.clone(), tokio::spawn(relay.run(shutdown)))
}

/// A relay with `settings` (`--source wal`), once the database says it streams.
async fn start_streaming(
    pool: &PgPool,
    settings: RelaySettings,
) -> (CancellationToken, JoinHandle<Result<(), relay::RelayError>>) {
    let lock_key = settings.lock_key;
    let relay = start(pool, settings);
    until("the relay streams", Duration::from_secs(20), || async {
        streaming(pool, lock_key).await == Some(true)
    })
    .await;
    relay
}

async fn stop(relay: (CancellationToken, JoinHandle<Result<(), relay::RelayError>>)) {
    relay.0.cancel();
    relay.1.await.expect("relay task").expect("relay run");
}

/// Whether the relay of `lock_key` streams, by the database (`None`: it never did).
async fn streaming(pool: &PgPool, lock_key: i64) -> Option<bool> {
    sqlx::query_scalar("SELECT streaming FROM outbox_wal_source WHERE lock_key = $1")
        .bind(lock_key)
        .fetch_optional(pool)
        .await
        .expect("source row")
}

async fn until<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes `per_order` events for each of `orders`, one or two events a transaction; returns
/// their event ids.
async fn write(
    pool: &PgPool,
    topic: &str,
    orders: &[&str],
    per_order: u32,
    tag: &str,
) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for n in 0..per_order {
        for order in orders {
            let mut tx = pool.begin().await.expect("begin");
            let events: Vec<NewEvent> = (0..=(n % 2))
                .map(|k| NewEvent {
                    business_key: format!("{tag}:{order}:{n}:{k}"),
                    event_type: "order.updated".to_owned(),
                    aggregate_id: (*order).to_owned(),
                    topic: topic.to_owned(),
                    payload: json!({ "n": n, "k": k }),
                    headers: vec![(
                        "traceparent".to_owned(),
                        format!("00-{:032x}-{:016x}-01", n + 1, k + 1),
                    )],
                })
                .collect();
            for (event_id, _) in outbox::enqueue_all(&mut tx, &events)
                .await
                .expect("enqueue")
            {
                ids.push(event_id);
            }
            tx.commit().await.expect("commit");
        }
    }
    ids
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// How often this database's relays asked the queue about a read's aggregates.
async fn queue_checks(pool: &PgPool) -> i64 {
    pipeline_testkit::db::statement_calls(pool, "DISTINCT aggregate_id FROM outbox_unpublished")
        .await
}

/// The records of `topic`, read until `at_least` arrived and then a little longer (so that
/// duplicates would show). Read on a thread of its own: the relay runs on the test's runtime.
async fn records(topic: &str, at_least: usize) -> Vec<OwnedMessage> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let kafka = kafka_args(&brokers());
        let first = read_topic(&kafka, &topic, at_least, Duration::from_secs(30)).expect("read");
        assert!(
            first.len() >= at_least,
            "{} of {at_least} records",
            first.len()
        );
        read_topic(&kafka, &topic, usize::MAX, Duration::from_secs(2)).expect("read again")
    })
    .await
    .expect("reader thread")
}

fn envelope(record: &OwnedMessage) -> (Envelope, Vec<(String, String)>) {
    let headers = record.headers().expect("headers");
    let pairs: Vec<(String, String)> = headers
        .iter()
        .map(|h| {
            (
                h.key.to_owned(),
                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
            )
        })
        .collect();
    let envelope = Envelope::from_record(record.key(), record.headers()).expect("envelope");
    (envelope, pairs)
}

/// Runs `scenario` with a fresh slot name and drops the slot whatever happens (a slot keeps WAL,
/// and its database from being dropped).
async fn with_slot<F, Fut>(pool: &PgPool, scenario: F)
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let slot = format!("relay_test_{}", Uuid::new_v4().simple());
    let outcome = AssertUnwindSafe(scenario(slot.clone()))
        .catch_unwind()
        .await;
    let dropped = drop_slot(pool, &slot).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    dropped.expect("drop the slot");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_wal_relay_publishes_in_order_without_queueing_and_a_restart_publishes_nothing_twice(
    pool: PgPool,
) {
    let _ = tracing_subscriber::fmt().with_env_filter("info").try_init();
    let outer = pool.clone();
    with_slot(&outer, |slot| async move {
        let topic = topic().await;
        let lock_key = i64::from(rand::random::<i32>());
        let relay = start_streaming(&pool, settings(&pool, Source::Wal, &slot, lock_key)).await;

        let orders = ["order-a", "order-b", "order-c", "order-d"];
        let mut ids = write(&pool, &topic, &orders, 30, "first").await;
        // A rolled-back transaction's events never go out.
        let mut tx = pool.begin().await.expect("begin");
        let _ = outbox::enqueue(
            &mut tx,
            &NewEvent {
                business_key: "rolled-back".to_owned(),
                event_type: "order.updated".to_owned(),
                aggregate_id: "order-z".to_owned(),
                topic: topic.clone(),
                payload: json!({}),
                headers: Vec::new(),
            },
        )
        .await
        .expect("enqueue");
        tx.rollback().await.expect("rollback");

        let first = records(&topic, ids.len()).await;
        assert_eq!(
            first.len(),
            ids.len(),
            "each event once, the rolled-back one never"
        );
        let mut last: HashMap<String, i64> = HashMap::new();
        let mut seen = HashSet::new();
        for record in &first {
            let (envelope, headers) = envelope(record);
            let key = String::from_utf8(record.key().expect("key").to_vec()).expect("utf-8 key");
            assert_eq!(key, envelope.aggregate_id, "keyed by aggregate");
            let before = last.insert(key.clone(), envelope.sequence).unwrap_or(0);
            assert_eq!(
                envelope.sequence,
                before + 1,
                "{key}: each aggregate's events in order, one partition"
            );
            assert!(
                headers
                    .iter()
                    .any(|(k, v)| k == "traceparent" && v.starts_with("00-")),
                "the writer's headers go along: {headers:?}"
            );
            assert!(seen.insert(envelope.event_id));
        }
        assert_eq!(seen, ids.iter().copied().collect::<HashSet<_>>());
        assert_eq!(
            count(&pool, "SELECT count(*) FROM outbox_unpublished").await,
            0,
            "writers queue nothing while the relay streams"
        );
        assert_eq!(
            count(&pool, "SELECT count(*) FROM outbox_delivery").await,
            0,
            "the relay records no delivery per event"
        );
        until(
            "every event reads published",
            Duration::from_secs(15),
            || async {
                count(
                    &pool,
                    "SELECT count(*) FROM outbox_status WHERE state <> 'published'",
                )
                .await
                    == 0
            },
        )
        .await;

        // A clean stop confirms what Kafka acknowledged: the next relay sends only what is new.
        stop(relay).await;
        ids.extend(write(&pool, &topic, &orders[..2], 3, "second").await);
        let relay = start(&pool, settings(&pool, Source::Wal, &slot, lock_key));
        let all = records(&topic, ids.len()).await;
        assert_eq!(
            all.len(),
            ids.len(),
            "nothing published twice across the restart"
        );

        // The slot disappears while no relay runs and events are written: a relay that finds
        // it gone queues everything past the horizon, so nothing is lost.
        stop(relay).await;
        let during = write(&pool, &topic, &orders[2..], 2, "gap").await;
        drop_slot(&pool, &slot).await.expect("drop the slot");
        let relay = start(&pool, settings(&pool, Source::Wal, &slot, lock_key));
        let expected: HashSet<Uuid> = ids.iter().chain(&during).copied().collect();
        let after = records(&topic, all.len() + during.len()).await;
        let ids_on_topic: HashSet<Uuid> = after.iter().map(|r| envelope(r).0.event_id).collect();
        assert_eq!(
            ids_on_topic, expected,
            "every event, the ones of the gap too"
        );
        stop(relay).await;

        // Back on the queue: writers queue again, and the slot is dropped.
        let relay = start(&pool, settings(&pool, Source::Queue, &slot, lock_key));
        until(
            "the relay falls back to the queue",
            Duration::from_secs(20),
            || async { streaming(&pool, lock_key).await == Some(false) },
        )
        .await;
        let queued = write(&pool, &topic, &orders[..1], 2, "queue").await;
        until(
            "the queue's events are delivered",
            Duration::from_secs(20),
            || async {
                let delivered: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox_delivery d JOIN outbox o USING (id)
                 WHERE o.event_id = ANY ($1)",
                )
                .bind(&queued)
                .fetch_one(&pool)
                .await
                .expect("delivered");
                delivered == queued.len() as i64
            },
        )
        .await;
        until("the slot is dropped", Duration::from_secs(10), || async {
            count(
                &pool,
                &format!("SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}'"),
            )
            .await
                == 0
        })
        .await;
        stop(relay).await;
        assert_eq!(
            count(
                &pool,
                "SELECT count(*) FROM outbox_status WHERE state <> 'published'"
            )
            .await,
            0
        );
    })
    .await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_kafka_refuses_for_good_joins_the_queue_as_failed_and_holds_its_aggregate(
    pool: PgPool,
) {
    let outer = pool.clone();
    with_slot(&outer, |slot| async move {
        let topic = topic().await;
        let lock_key = i64::from(rand::random::<i32>());
        let mut s = settings(&pool, Source::Wal, &slot, lock_key);
        s.max_attempts = 2;
        s.kafka
            .kafka_options
            .push(("message.max.bytes".to_owned(), "4000".to_owned()));
        let relay = start_streaming(&pool, s).await;
        let event = |order: &str, n: u32, size: usize| NewEvent {
            business_key: format!("{order}:{n}"),
            event_type: "order.updated".to_owned(),
            aggregate_id: order.to_owned(),
            topic: topic.clone(),
            payload: json!({ "n": n, "pad": "x".repeat(size) }),
            headers: Vec::new(),
        };
        let mut tx = pool.begin().await.expect("begin");
        let written = outbox::enqueue_all(
            &mut tx,
            &[
                event("big", 1, 10_000),
                event("big", 2, 10),
                event("fine", 1, 10),
            ],
        )
        .await
        .expect("enqueue");
        tx.commit().await.expect("commit");
        let state = |id: Uuid| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, String>(
                    "SELECT state FROM outbox_status WHERE event_id = $1",
                )
                .bind(id)
                .fetch_one(&pool)
                .await
                .expect("state")
            }
        };
        until(
            "the refused event is failed",
            Duration::from_secs(30),
            || async { state(written[0].0).await == "failed" },
        )
        .await;
        assert_eq!(state(written[1].0).await, "pending", "held behind it");
        let on_topic = records(&topic, 1).await;
        let ids: Vec<Uuid> = on_topic.iter().map(|r| envelope(r).0.event_id).collect();
        assert_eq!(
            ids,
            vec![written[2].0],
            "only the other aggregate's event went out"
        );
        let error: String =
            sqlx::query_scalar("SELECT last_error FROM outbox_status WHERE event_id = $1")
                .bind(written[0].0)
                .fetch_one(&pool)
                .await
                .expect("error");
        assert!(error.contains("large"), "{error}");
        // A later transaction's event of the same aggregate waits in the queue behind the
        // failed one; the other aggregate's goes out from the log.
        let mut tx = pool.begin().await.expect("begin");
        let later = outbox::enqueue_all(&mut tx, &[event("big", 3, 10), event("fine", 2, 10)])
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
        let on_topic = records(&topic, 2).await;
        let ids: Vec<Uuid> = on_topic.iter().map(|r| envelope(r).0.event_id).collect();
        assert_eq!(
            ids,
            vec![written[2].0, later[1].0],
            "the held aggregate's later event did not go out"
        );
        assert_eq!(state(later[0].0).await, "pending", "queued behind it");
        // The failed event stays queued until an operator requeues it: meanwhile the stream
        // reads the queue about once a second, not once for each transaction it reads.
        let asked_before = queue_checks(&pool).await;
        let started = std::time::Instant::now();
        let mut ids = ids;
        for n in 3..43 {
            let mut tx = pool.begin().await.expect("begin");
            let written = outbox::enqueue_all(&mut tx, &[event("fine", n, 10)])
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
            ids.push(written[0].0);
        }
        let on_topic = records(&topic, ids.len()).await;
        let seconds = started.elapsed().as_secs();
        let on_topic: Vec<Uuid> = on_topic.iter().map(|r| envelope(r).0.event_id).collect();
        assert_eq!(
            on_topic, ids,
            "the other aggregate's events went out in order"
        );
        let asked = queue_checks(&pool).await - asked_before;
        assert!(
            asked <= 2 * (seconds as i64 + 2),
            "{asked} reads of the queue for 40 transactions in {seconds} s"
        );
        assert_eq!(state(written[0].0).await, "failed", "still queued");
        assert_eq!(state(later[0].0).await, "pending", "still held");
        stop(relay).await;
    })
    .await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_delayed_event_released_while_the_relay_streams_is_published_from_the_log(pool: PgPool) {
    let outer = pool.clone();
    with_slot(&outer, |slot| async move {
        let topic = topic().await;
        let lock_key = i64::from(rand::random::<i32>());
        let relay = start_streaming(&pool, settings(&pool, Source::Wal, &slot, lock_key)).await;
        let mut tx = pool.begin().await.expect("begin");
        let delayed = outbox::enqueue_at(
            &mut tx,
            &NewEvent {
                business_key: "reminder:1".to_owned(),
                event_type: "payment.reminder".to_owned(),
                aggregate_id: "order-r".to_owned(),
                topic: topic.clone(),
                payload: json!({ "remind": true }),
                headers: Vec::new(),
            },
            outbox::PublishAt::After(Duration::from_secs(1)),
        )
        .await
        .expect("delay");
        tx.commit().await.expect("commit");
        let on_topic = records(&topic, 1).await;
        let ids: Vec<Uuid> = on_topic.iter().map(|r| envelope(r).0.event_id).collect();
        assert_eq!(
            ids,
            vec![delayed.event_id()],
            "released when due, then streamed"
        );
        assert_eq!(
            count(&pool, "SELECT count(*) FROM outbox_unpublished").await,
            0,
            "released into the outbox without a queue row"
        );
        stop(relay).await;
    })
    .await;
}

/// A transaction larger than the reader hands over at once goes out in pieces as it arrives, in
/// each aggregate's order, and is confirmed once: a restart sends none of it again.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_large_transaction_is_published_in_order_as_it_arrives(pool: PgPool) {
    let outer = pool.clone();
    with_slot(&outer, |slot| async move {
        let topic = topic().await;
        let lock_key = i64::from(rand::random::<i32>());
        let relay = start_streaming(&pool, settings(&pool, Source::Wal, &slot, lock_key)).await;
        let events: Vec<NewEvent> = (0..2_500u32)
            .map(|n| NewEvent {
                business_key: format!("big:{n}"),
                event_type: "order.updated".to_owned(),
                aggregate_id: format!("order-{}", n % 3),
                topic: topic.clone(),
                payload: json!({ "n": n }),
                headers: Vec::new(),
            })
            .collect();
        let mut tx = pool.begin().await.expect("begin");
        let _ = outbox::enqueue_all(&mut tx, &events)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
        let first = records(&topic, events.len()).await;
        assert_eq!(first.len(), events.len(), "each event once");
        let mut last: HashMap<String, i64> = HashMap::new();
        for record in &first {
            let (envelope, _) = envelope(record);
            let before = last
                .insert(envelope.aggregate_id.clone(), envelope.sequence)
                .unwrap_or(0);
            assert_eq!(envelope.sequence, before + 1, "in each aggregate's order");
        }
        stop(relay).await;
        let relay = start(&pool, settings(&pool, Source::Wal, &slot, lock_key));
        let mut tx = pool.begin().await.expect("begin");
        let _ = outbox::enqueue(
            &mut tx,
            &NewEvent {
                business_key: "after".to_owned(),
                event_type: "order.updated".to_owned(),
                aggregate_id: "order-after".to_owned(),
                topic: topic.clone(),
                payload: json!({}),
                headers: Vec::new(),
            },
        )
        .await
        .expect("enqueue");
        tx.commit().await.expect("commit");
        let all = records(&topic, events.len() + 1).await;
        assert_eq!(all.len(), events.len() + 1, "confirmed once, sent once");
        stop(relay).await;
    })
    .await;
}
