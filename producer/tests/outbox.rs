//! The outbox library on its own: sequences, duplicates and transactions.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use producer::outbox::{enqueue, enqueue_all, EnqueueError, Enqueued, NewEvent};
use serde_json::json;
use sqlx::PgPool;

fn event(business_key: &str, event_type: &str, aggregate_id: &str) -> NewEvent {
    NewEvent {
        business_key: business_key.into(),
        event_type: event_type.into(),
        aggregate_id: aggregate_id.into(),
        topic: "t".into(),
        payload: json!({"k": business_key}),
        headers: vec![("x-source".into(), "test".into())],
    }
}

async fn enqueue_committed(pool: &PgPool, e: &NewEvent) -> Enqueued {
    let mut tx = pool.begin().await.expect("begin");
    let result = enqueue(&mut tx, e).await.expect("enqueue");
    tx.commit().await.expect("commit");
    result
}

async fn sequences(pool: &PgPool, aggregate_id: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT sequence FROM outbox WHERE aggregate_id = $1 ORDER BY id")
        .bind(aggregate_id)
        .fetch_all(pool)
        .await
        .expect("sequences")
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn same_fact_twice_is_a_duplicate_without_a_gap(pool: PgPool) {
    let first = enqueue_committed(&pool, &event("o1", "order.placed", "o1")).await;
    assert!(
        matches!(first, Enqueued::New { sequence: 1, .. }),
        "{first:?}"
    );

    let again = enqueue_committed(&pool, &event("o1", "order.placed", "o1")).await;
    assert_eq!(
        again,
        Enqueued::Duplicate {
            event_id: first.event_id(),
            sequence: 1
        }
    );
    // Twice inside one transaction, too.
    let mut tx = pool.begin().await.expect("begin");
    let a = enqueue(&mut tx, &event("o1", "order.paid", "o1"))
        .await
        .expect("enqueue");
    let b = enqueue(&mut tx, &event("o1", "order.paid", "o1"))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    assert!(matches!(a, Enqueued::New { sequence: 2, .. }));
    assert_eq!(
        b,
        Enqueued::Duplicate {
            event_id: a.event_id(),
            sequence: 2
        }
    );

    let next = enqueue_committed(&pool, &event("o1", "order.shipped", "o1")).await;
    assert!(
        matches!(next, Enqueued::New { sequence: 3, .. }),
        "{next:?}"
    );
    assert_eq!(sequences(&pool, "o1").await, [1, 2, 3]);

    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM outbox WHERE sequence = 3")
            .fetch_one(&pool)
            .await
            .expect("headers");
    assert_eq!(headers, json!({"x-source": "test"}));
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn rollback_leaves_no_row_and_no_gap(pool: PgPool) {
    let mut tx = pool.begin().await.expect("begin");
    let _ = enqueue(&mut tx, &event("o2", "order.placed", "o2"))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(count, 0);

    let mut tx = pool.begin().await.expect("begin");
    let _ = enqueue(&mut tx, &event("o2", "order.placed", "o2"))
        .await
        .expect("enqueue");
    drop(tx); // dropped without commit: rolled back too

    let again = enqueue_committed(&pool, &event("o2", "order.placed", "o2")).await;
    assert!(
        matches!(again, Enqueued::New { sequence: 1, .. }),
        "{again:?}"
    );
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn aggregates_have_their_own_sequences(pool: PgPool) {
    for (key, agg) in [
        ("a1", "a"),
        ("b1", "b"),
        ("a2", "a"),
        ("b2", "b"),
        ("a3", "a"),
    ] {
        let _ = enqueue_committed(&pool, &event(key, "e", agg)).await;
    }
    assert_eq!(sequences(&pool, "a").await, [1, 2, 3]);
    assert_eq!(sequences(&pool, "b").await, [1, 2]);
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn concurrent_writers_of_one_aggregate_get_consecutive_sequences(pool: PgPool) {
    let tasks = (0..20).map(|i| {
        let pool = pool.clone();
        tokio::spawn(async move {
            let e = event(&format!("fact-{i}"), "e", "shared");
            enqueue_committed(&pool, &e).await
        })
    });
    for t in futures::future::join_all(tasks).await {
        assert!(matches!(t.expect("task"), Enqueued::New { .. }));
    }
    let mut seqs = sequences(&pool, "shared").await;
    // Commit order is sequence order: ids (commit-ish order of insert) follow sequences.
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=20).collect::<Vec<i64>>());
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn invalid_events_are_refused_before_the_database(pool: PgPool) {
    let mut tx = pool.begin().await.expect("begin");
    let mut e = event("k", "t", "a");
    e.business_key.clear();
    assert!(matches!(
        enqueue(&mut tx, &e).await,
        Err(EnqueueError::Empty("business_key"))
    ));
    let mut e = event("k", "t", "a");
    e.payload = json!({"nested": ["ok", "bad\u{0}"]});
    assert!(matches!(
        enqueue(&mut tx, &e).await,
        Err(EnqueueError::NulCharacter("payload"))
    ));
    let mut e = event("k", "t", "a");
    e.headers.push(("h".into(), "v\u{0}".into()));
    assert!(matches!(
        enqueue(&mut tx, &e).await,
        Err(EnqueueError::NulCharacter("headers"))
    ));
    // The transaction is still usable: nothing reached PostgreSQL.
    let ok = enqueue(&mut tx, &event("k", "t", "a"))
        .await
        .expect("enqueue");
    assert!(matches!(ok, Enqueued::New { sequence: 1, .. }));
}

async fn enqueue_all_committed(pool: &PgPool, events: &[NewEvent]) -> Vec<(uuid::Uuid, i64)> {
    let mut tx = pool.begin().await.expect("begin");
    let result = enqueue_all(&mut tx, events).await.expect("enqueue_all");
    tx.commit().await.expect("commit");
    result
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn enqueue_all_continues_each_aggregates_sequence_in_the_order_given(pool: PgPool) {
    let _ = enqueue_committed(&pool, &event("a1", "e", "a")).await;
    let events = [
        event("a2", "e", "a"),
        event("b1", "e", "b"),
        event("a3", "e", "a"),
        event("a4", "e", "a"),
        event("b2", "e", "b"),
    ];
    let written = enqueue_all_committed(&pool, &events).await;
    let seqs: Vec<i64> = written.iter().map(|(_, s)| *s).collect();
    assert_eq!(seqs, [2, 1, 3, 4, 2]);
    assert_eq!(sequences(&pool, "a").await, [1, 2, 3, 4]);
    assert_eq!(sequences(&pool, "b").await, [1, 2]);
    // Each returned id is the event written with that business key.
    for ((id, _), e) in written.iter().zip(&events) {
        let key: String = sqlx::query_scalar("SELECT business_key FROM outbox WHERE event_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("row");
        assert_eq!(key, e.business_key);
    }
    // enqueue continues where enqueue_all left off.
    let next = enqueue_committed(&pool, &event("a5", "e", "a")).await;
    assert!(
        matches!(next, Enqueued::New { sequence: 5, .. }),
        "{next:?}"
    );
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn enqueue_all_refuses_a_recorded_fact_and_leaves_no_gap(pool: PgPool) {
    let _ = enqueue_committed(&pool, &event("o1", "order.placed", "o1")).await;
    for events in [
        // Already in the outbox.
        vec![
            event("o2", "order.placed", "o2"),
            event("o1", "order.placed", "o1"),
        ],
        // Twice in the events given.
        vec![
            event("o1", "order.paid", "o1"),
            event("o1", "order.paid", "o1"),
        ],
    ] {
        let mut tx = pool.begin().await.expect("begin");
        assert!(matches!(
            enqueue_all(&mut tx, &events).await,
            Err(EnqueueError::AlreadyRecorded)
        ));
        // PostgreSQL aborted the transaction: it cannot be committed.
        assert!(sqlx::query("SELECT 1").execute(&mut *tx).await.is_err());
        tx.rollback().await.expect("rollback");
    }
    let written = enqueue_all_committed(
        &pool,
        &[
            event("o1", "order.paid", "o1"),
            event("o2", "order.placed", "o2"),
        ],
    )
    .await;
    assert_eq!(written.iter().map(|(_, s)| *s).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(sequences(&pool, "o1").await, [1, 2]);
    assert_eq!(sequences(&pool, "o2").await, [1]);
    assert!(enqueue_all_committed(&pool, &[]).await.is_empty());
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn concurrent_enqueue_all_of_shared_aggregates_neither_deadlocks_nor_skips(pool: PgPool) {
    // Each writer names the two aggregates in the opposite order.
    let tasks = (0..20).map(|i| {
        let pool = pool.clone();
        tokio::spawn(async move {
            let (first, second) = if i % 2 == 0 { ("x", "y") } else { ("y", "x") };
            let events = [
                event(&format!("{first}-{i}"), "e", first),
                event(&format!("{second}-{i}"), "e", second),
            ];
            enqueue_all_committed(&pool, &events).await
        })
    });
    for t in futures::future::join_all(tasks).await {
        assert_eq!(t.expect("task").len(), 2);
    }
    for aggregate in ["x", "y"] {
        let mut seqs = sequences(&pool, aggregate).await;
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=20).collect::<Vec<i64>>());
    }
}
