//! The relay waiting for new events without polling, on a real PostgreSQL and Kafka: a writer's
//! insert wakes it, a busy relay tells writers not to notify, and `--listen false` polls.

use std::time::{Duration, Instant};

use pipeline_testkit::kafka::{brokers, kafka_args};
use prometheus::Registry;
use relay::{Relay, RelaySettings};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn topic() -> String {
    let topic = format!("relay-wakeup-{}", Uuid::new_v4().simple());
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 3)
        .await
        .expect("topic");
    topic
}

async fn enqueue(pool: &PgPool, topic: &str, order: &str, n: i64) {
    let mut tx = pool.begin().await.expect("begin");
    let event = outbox::NewEvent {
        business_key: format!("{order}-{n}"),
        event_type: "order.changed".to_owned(),
        aggregate_id: order.to_owned(),
        topic: topic.to_owned(),
        payload: serde_json::json!({ "n": n }),
        headers: Vec::new(),
    };
    let _ = outbox::enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_delivery")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// What the relay of `lock_key` last told writers (`None`: nothing yet).
async fn listening(pool: &PgPool, lock_key: i64) -> Option<bool> {
    sqlx::query_scalar("SELECT listening FROM outbox_relay_wakeup WHERE lock_key = $1")
        .bind(lock_key)
        .fetch_optional(pool)
        .await
        .expect("wakeup row")
}

/// Waits until `count` events are published; returns how long that took.
async fn until_published(pool: &PgPool, count: i64, within: Duration) -> Duration {
    let started = Instant::now();
    while published(pool).await < count {
        assert!(
            started.elapsed() < within,
            "{} of {count} published after {within:?}",
            published(pool).await
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    started.elapsed()
}

fn start(
    pool: &PgPool,
    settings: RelaySettings,
) -> (CancellationToken, JoinHandle<Result<(), relay::RelayError>>) {
    let relay = Relay::new(settings, pool.clone(), &Registry::new()).expect("relay");
    let shutdown = CancellationToken::new();
    (shutdown.clone(), tokio::spawn(relay.run(shutdown)))
}

/// A relay on a topic of its own whose safety poll is a minute away, once it said it waits for
/// the writers' notifications: its topic, lock key, shutdown and task.
async fn start_waiting(
    pool: &PgPool,
) -> (
    String,
    i64,
    CancellationToken,
    JoinHandle<Result<(), relay::RelayError>>,
) {
    let topic = topic().await;
    let lock_key = i64::from(rand::random::<i32>());
    let settings = RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key,
        listen_poll_interval: Duration::from_secs(60),
        ..RelaySettings::default()
    };
    let (shutdown, relay) = start(pool, settings);
    // The relay is active and waiting once it has said it listens.
    let deadline = Instant::now() + Duration::from_secs(20);
    while listening(pool, lock_key).await != Some(true) {
        assert!(Instant::now() < deadline, "the relay never said it waits");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (topic, lock_key, shutdown, relay)
}

/// A relay whose safety poll is a minute away publishes each event within a fraction of a
/// second of its commit: only the insert's notification can have woken it.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_idle_relay_is_woken_by_each_insert_and_does_not_poll(pool: PgPool) {
    let (topic, _, shutdown, relay) = start_waiting(&pool).await;
    let claims_before: i64 = claims(&pool).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_claims = claims(&pool).await - claims_before;
    // The backlog gauges read the queue once a second; a relay polling every 5 ms would scan
    // it some 400 times.
    assert!(
        idle_claims < 20,
        "the queue was scanned {idle_claims} times in 2 s of idling: the relay polls"
    );
    for n in 1..=5 {
        enqueue(&pool, &topic, "order-w", n).await;
        let took = until_published(&pool, n, Duration::from_secs(5)).await;
        assert!(
            took < Duration::from_secs(2),
            "event {n} published {took:?} after its commit, with the safety poll a minute away"
        );
        // Idle again between events.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay ran");
}

/// A backlog keeps the relay claiming: it tells writers not to notify while it works it off,
/// and waits again (listening) once the queue is empty.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_busy_relay_tells_writers_not_to_notify_until_it_waits_again(pool: PgPool) {
    let topic = topic().await;
    let lock_key = i64::from(rand::random::<i32>());
    for order in 0..300 {
        enqueue(&pool, &topic, &format!("order-{order}"), 1).await;
    }
    let settings = RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key,
        batch_size: 50,
        pipeline_depth: 1,
        ..RelaySettings::default()
    };
    let (shutdown, relay) = start(&pool, settings);
    let mut said_busy = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    while published(&pool).await < 300 {
        assert!(Instant::now() < deadline, "the backlog was not published");
        said_busy |= listening(&pool, lock_key).await == Some(false);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        said_busy,
        "six batches in a row, and the relay never said it was busy"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while listening(&pool, lock_key).await != Some(true) {
        assert!(
            Instant::now() < deadline,
            "the relay did not say it waits again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    enqueue(&pool, &topic, "order-late", 1).await;
    until_published(&pool, 301, Duration::from_secs(2)).await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay ran");
}

/// Events trickling in (40 a second, each its own transaction) are each published by about one
/// claim: between them the relay waits for the writers' notifications instead of polling its
/// queue every few milliseconds.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_trickle_of_events_is_published_without_polling_between_them(pool: PgPool) {
    let (topic, lock_key, shutdown, relay) = start_waiting(&pool).await;
    // One scan of the queue a claim at least; the statistics lag by up to a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = claims(&pool).await;
    let events = 80;
    let started = Instant::now();
    for n in 1..=events {
        enqueue(&pool, &topic, &format!("order-t{}", n % 7), n).await;
        tokio::time::sleep_until((started + Duration::from_millis(25) * n as u32).into()).await;
    }
    until_published(&pool, events, Duration::from_secs(5)).await;
    assert_eq!(
        listening(&pool, lock_key).await,
        Some(true),
        "40 events a second made the relay say it is busy"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let scans = claims(&pool).await - before;
    // Polling every 5 ms over the two seconds would scan the queue some 400 times.
    assert!(
        scans < events * 4,
        "{scans} scans of the queue for {events} events trickling in over 2 s"
    );
    eprintln!("{scans} scans of the queue for {events} events");
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay ran");
}

/// With `--listen false` the relay polls, and tells writers they need not notify.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_relay_that_does_not_listen_polls_and_asks_for_no_notification(pool: PgPool) {
    let topic = topic().await;
    let lock_key = i64::from(rand::random::<i32>());
    let settings = RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key,
        listen: false,
        ..RelaySettings::default()
    };
    let (shutdown, relay) = start(&pool, settings);
    let deadline = Instant::now() + Duration::from_secs(20);
    while listening(&pool, lock_key).await != Some(false) {
        assert!(
            Instant::now() < deadline,
            "the relay never said it needs no wake-up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    enqueue(&pool, &topic, "order-p", 1).await;
    until_published(&pool, 1, Duration::from_secs(2)).await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay ran");
}

/// Scans of the relay's queue table so far: each claim scans it (the statistics lag a backend's
/// transactions by up to a second).
async fn claims(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE(seq_scan, 0) + COALESCE(idx_scan, 0)
         FROM pg_stat_user_tables WHERE relname = 'outbox_unpublished'",
    )
    .fetch_one(pool)
    .await
    .expect("scans")
}
