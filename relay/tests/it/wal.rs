//! The relay's write-ahead-log reader on a real PostgreSQL (`wal_level = logical`, which
//! deploy/postgres/pipeline.conf sets and the scripts apply): the outbox's committed inserts
//! arrive once, a transaction at a time, in commit order, a rolled-back one never; a session
//! opened after a confirmation starts right after it.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;

use outbox::NewEvent;
use pipeline_testkit::db::database_url;
use relay::wal::reader::{WalError, WalRead, WalReader};
use serde_json::json;
use sqlx::PgPool;

use crate::common::drop_slot;

fn event(order: &str, n: u32) -> NewEvent {
    NewEvent {
        business_key: format!("{order}:{n}"),
        event_type: "order.updated".to_owned(),
        aggregate_id: order.to_owned(),
        topic: "wal-test".to_owned(),
        payload: json!({ "n": n, "note": "ünïcode \"quoted\"" }),
        headers: vec![("traceparent".to_owned(), format!("00-{n:032x}-{n:016x}-01"))],
    }
}

/// Commits `events` in one transaction (or rolls it back).
async fn write(pool: &PgPool, events: &[NewEvent], commit: bool) {
    let mut tx = pool.begin().await.expect("begin");
    let _ = outbox::enqueue_all(&mut tx, events).await.expect("enqueue");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
}

/// The transactions with events `reader` reads until `events` events arrived (or 15 s passed),
/// each as its events' (aggregate, sequence, n) and the position that confirms it.
async fn read(
    reader: &mut WalReader,
    events: usize,
) -> Vec<(Vec<(String, i64, u64)>, pgwire_replication::Lsn)> {
    let mut transactions = Vec::new();
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while seen < events {
        let next = tokio::time::timeout_at(deadline, reader.next())
            .await
            .unwrap_or_else(|_| panic!("{seen} of {events} events after 15 s"))
            .expect("read")
            .expect("the stream goes on");
        if let WalRead::Transaction { events, confirm } = next {
            if events.is_empty() {
                continue;
            }
            seen += events.len();
            let rows = events
                .iter()
                .map(|e| {
                    let payload: serde_json::Value =
                        serde_json::from_str(&e.payload).expect("json");
                    (
                        e.aggregate_id.clone(),
                        e.sequence,
                        payload["n"].as_u64().expect("n"),
                    )
                })
                .collect();
            transactions.push((rows, confirm));
        }
    }
    transactions
}

fn rows(order: &str, from: i64, ns: &[u64]) -> Vec<(String, i64, u64)> {
    ns.iter()
        .zip(from..)
        .map(|(n, sequence)| (order.to_owned(), sequence, *n))
        .collect()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn committed_events_stream_in_commit_order_and_a_new_session_starts_after_the_confirmed(
    pool: PgPool,
) {
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&pool)
        .await
        .expect("wal_level");
    assert_eq!(
        wal_level, "logical",
        "the server needs wal_level = logical (deploy/postgres/pipeline.conf; the scripts apply it)"
    );
    let url = database_url(&pool);
    let slot = format!("relay_test_{}", uuid::Uuid::new_v4().simple());
    // A slot keeps WAL, and its database from being dropped, until it is dropped itself: drop
    // it whatever the scenario does.
    let outcome = AssertUnwindSafe(stream_confirm_and_reopen(&pool, &url, &slot))
        .catch_unwind()
        .await;
    let dropped = drop_slot(&pool, &slot).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    dropped.expect("drop the slot");
}

async fn stream_confirm_and_reopen(pool: &PgPool, url: &str, slot: &str) {
    let mut reader = WalReader::open(url, slot).await.expect("open");
    write(pool, &[event("order-1", 1), event("order-1", 2)], true).await;
    write(pool, &[event("order-9", 3)], false).await;
    write(pool, &[event("order-2", 4)], true).await;
    write(pool, &[event("order-1", 5)], true).await;
    let first = read(&mut reader, 4).await;
    let events: Vec<_> = first.iter().map(|(rows, _)| rows.clone()).collect();
    assert_eq!(
        events,
        vec![
            rows("order-1", 1, &[1, 2]),
            rows("order-2", 1, &[4]),
            rows("order-1", 3, &[5])
        ],
        "one transaction at a time, in commit order, the rolled-back one never"
    );

    // Confirm the first transaction only, as a relay does once Kafka acknowledged its events.
    reader.confirm(first[0].1);
    reader.close().await.expect("close");
    let mut again = WalReader::open(url, slot).await.expect("open again");
    let second = read(&mut again, 2).await;
    let reread: Vec<_> = second.iter().map(|(rows, _)| rows.clone()).collect();
    assert_eq!(
        reread,
        vec![rows("order-2", 1, &[4]), rows("order-1", 3, &[5])],
        "a new session starts right after the confirmed transaction"
    );
    again.confirm(second[1].1);
    again.close().await.expect("close");

    // Everything confirmed: a third session reads no event.
    let mut third = WalReader::open(url, slot).await.expect("open a third");
    let mut later = Vec::new();
    let quiet = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(next) = tokio::time::timeout_at(quiet, third.next()).await {
        if let Some(WalRead::Transaction { events, .. }) = next.expect("read") {
            later.extend(events.into_iter().map(|e| e.sequence));
        }
    }
    third.close().await.expect("close");
    assert!(
        later.is_empty(),
        "read again after every confirmation: {later:?}"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bad_slot_name_or_url_is_refused_before_connecting(pool: PgPool) {
    let url = database_url(&pool);
    for slot in ["", "Upper", "dash-ed", "semi;colon", &"x".repeat(64)] {
        assert!(
            matches!(
                WalReader::open(&url, slot).await,
                Err(WalError::SlotName(_))
            ),
            "{slot:?}"
        );
    }
    assert!(matches!(
        WalReader::open("mysql://h/db", "relay_test_url").await,
        Err(WalError::Url(_))
    ));
}
