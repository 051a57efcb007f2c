//! The outbox library on its own: sequences, duplicates, transactions, and the events it refuses
//! before writing anything. Needs `DATABASE_URL` (see `common/mod.rs`).

use std::time::Duration;

use outbox::{
    enqueue, enqueue_all, enqueue_all_and_delay, enqueue_all_at, enqueue_at, EnqueueError,
    Enqueued, NewEvent, Outbox, OutboxSettings, PublishAt, DEFAULT_MAX_MESSAGE_BYTES,
    MAX_AGGREGATE_ID_BYTES, MAX_BUSINESS_KEY_BYTES, MAX_EVENT_TYPE_BYTES,
};
use serde_json::json;
use sqlx::{Connection, PgPool, Postgres, Transaction};

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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

/// An event PostgreSQL or Kafka would refuse: what is wrong with it, the event, and whether an
/// error is the one the library gives instead.
type RefusedEvent = (&'static str, NewEvent, fn(&EnqueueError) -> bool);

fn refused_events() -> Vec<RefusedEvent> {
    let with = |change: fn(&mut NewEvent)| {
        let mut e = event("bad", "order.placed", "order-bad");
        change(&mut e);
        e
    };
    vec![
        (
            "NUL in the aggregate id (the Kafka key)",
            with(|e| e.aggregate_id.push('\0')),
            |e| matches!(e, EnqueueError::NulCharacter("aggregate_id")),
        ),
        (
            "NUL in the event type",
            with(|e| e.event_type = "order.\0placed".into()),
            |e| matches!(e, EnqueueError::NulCharacter("event_type")),
        ),
        (
            "NUL in the business key",
            with(|e| e.business_key.insert(0, '\0')),
            |e| matches!(e, EnqueueError::NulCharacter("business_key")),
        ),
        ("NUL in the topic", with(|e| e.topic.push('\0')), |e| {
            matches!(e, EnqueueError::NulCharacter("topic"))
        }),
        (
            "NUL in a header name",
            with(|e| e.headers.push(("x-\0".into(), "v".into()))),
            |e| matches!(e, EnqueueError::NulCharacter("headers")),
        ),
        (
            "NUL in a header value",
            with(|e| e.headers.push(("x-tenant".into(), "v\0".into()))),
            |e| matches!(e, EnqueueError::NulCharacter("headers")),
        ),
        (
            "\\u0000 in a payload string",
            with(|e| e.payload = json!({"note": ["ok", "bad\u{0}"]})),
            |e| matches!(e, EnqueueError::NulCharacter("payload")),
        ),
        (
            "\\u0000 in a payload key",
            with(|e| e.payload = json!({"no\u{0}te": 1})),
            |e| matches!(e, EnqueueError::NulCharacter("payload")),
        ),
        (
            "an escape sequence in the event type",
            with(|e| e.event_type = "t\u{1b}[31mRED\u{1b}[0m".into()),
            |e| matches!(e, EnqueueError::ControlCharacter("event_type")),
        ),
        (
            "a line break in the event type",
            with(|e| e.event_type = "order.placed\nforged".into()),
            |e| matches!(e, EnqueueError::ControlCharacter("event_type")),
        ),
        (
            "an aggregate id longer than consumer groups take",
            with(|e| e.aggregate_id = "o".repeat(MAX_AGGREGATE_ID_BYTES + 1)),
            |e| {
                matches!(e, EnqueueError::TooLong { field: "aggregate_id", len, limit }
                         if *len == MAX_AGGREGATE_ID_BYTES + 1 && *limit == MAX_AGGREGATE_ID_BYTES)
            },
        ),
        (
            "an event type longer than consumer groups take",
            with(|e| e.event_type = "é".repeat(128)),
            |e| {
                matches!(
                    e,
                    EnqueueError::TooLong {
                        field: "event_type",
                        len: 256,
                        limit: 255
                    }
                )
            },
        ),
        (
            "a business key longer than its index takes",
            with(|e| e.business_key = "k".repeat(MAX_BUSINESS_KEY_BYTES + 1)),
            |e| {
                matches!(
                    e,
                    EnqueueError::TooLong {
                        field: "business_key",
                        ..
                    }
                )
            },
        ),
        (
            "a topic name Kafka refuses",
            with(|e| e.topic = "order events".into()),
            |e| matches!(e, EnqueueError::InvalidTopic(t) if t == "order events"),
        ),
        (
            "a payload larger than the default message size",
            with(|e| e.payload = json!({"blob": "x".repeat(DEFAULT_MAX_MESSAGE_BYTES)})),
            |e| {
                matches!(e, EnqueueError::TooLarge { size, limit: DEFAULT_MAX_MESSAGE_BYTES }
                         if *size > DEFAULT_MAX_MESSAGE_BYTES)
            },
        ),
    ]
}

/// Rows in every table an append writes to.
async fn rows_written(tx: &mut Transaction<'_, Postgres>) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_unpublished)
              + (SELECT count(*) FROM outbox_delayed) + (SELECT count(*) FROM outbox_sequence)",
    )
    .fetch_one(&mut **tx)
    .await
    .expect("count")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn every_entry_point_refuses_what_postgresql_or_kafka_would_and_writes_nothing(pool: PgPool) {
    let soon = PublishAt::After(Duration::from_secs(60));
    let good = event("good", "order.placed", "order-good");
    let mut tx = pool.begin().await.expect("begin");
    for (case, bad, expected) in refused_events() {
        let outcomes = [
            ("enqueue", enqueue(&mut tx, &bad).await.map(|_| ())),
            (
                "enqueue_all",
                enqueue_all(&mut tx, &[good.clone(), bad.clone()])
                    .await
                    .map(|_| ()),
            ),
            (
                "enqueue_at",
                enqueue_at(&mut tx, &bad, soon).await.map(|_| ()),
            ),
            (
                "enqueue_all_at",
                enqueue_all_at(&mut tx, &[(good.clone(), soon), (bad.clone(), soon)])
                    .await
                    .map(|_| ()),
            ),
            (
                "enqueue_all_and_delay (immediate)",
                enqueue_all_and_delay(&mut tx, &[good.clone(), bad.clone()], &[], &[])
                    .await
                    .map(|_| ()),
            ),
            (
                "enqueue_all_and_delay (delayed)",
                enqueue_all_and_delay(
                    &mut tx,
                    std::slice::from_ref(&good),
                    &[(bad.clone(), soon)],
                    &[("o1", "order.payment_reminder")],
                )
                .await
                .map(|_| ()),
            ),
            (
                "enqueue_all_and_delay (delayed only)",
                enqueue_all_and_delay(&mut tx, &[], &[(bad.clone(), soon)], &[])
                    .await
                    .map(|_| ()),
            ),
        ];
        for (entry_point, outcome) in outcomes {
            match outcome {
                Err(e) => assert!(expected(&e), "{case}, {entry_point}: wrong error {e:?}"),
                Ok(()) => panic!("{case}: {entry_point} accepted it"),
            }
            // Refused before any statement: the transaction is still usable and holds nothing.
            assert_eq!(rows_written(&mut tx).await, 0, "{case}, {entry_point}");
        }
    }
    // A NUL in a fact to withdraw matches no recorded event: nothing to withdraw, no error.
    let withdrawn = outbox::cancel_delayed(&mut tx, &[("o\0", "order.payment_reminder")])
        .await
        .expect("cancel");
    assert_eq!(withdrawn, 0);
    let written = enqueue_all_and_delay(
        &mut tx,
        std::slice::from_ref(&good),
        &[],
        &[("o\0", "order.payment_reminder")],
    )
    .await
    .expect("enqueue_all_and_delay");
    assert_eq!(written.len(), 1);
    tx.commit().await.expect("commit");
    assert_eq!(sequences(&pool, "order-good").await, [1]);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn without_the_checks_postgresql_would_refuse_the_nul_characters(pool: PgPool) {
    // What the checks spare callers: a database error that aborts their transaction, which they
    // could not tell from a transient fault.
    for (column, text, payload, code) in [
        ("aggregate_id", "order\0", json!({}), "22021"),
        ("payload", "order", json!({"note": "\u{0}"}), "22P05"),
    ] {
        let e = sqlx::query(
            "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                                 payload)
             VALUES (gen_random_uuid(), 'k', 'e', $1, 1, 't', $2)",
        )
        .bind(text)
        .bind(&payload)
        .execute(&pool)
        .await
        .expect_err("PostgreSQL refuses it");
        let code_seen = e
            .as_database_error()
            .and_then(|db| db.code())
            .map(|c| c.into_owned());
        assert_eq!(code_seen.as_deref(), Some(code), "{column}: {e}");
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_size_limit_is_a_setting_and_counts_key_headers_and_payload(pool: PgPool) {
    let limit = 10_000;
    let outbox = Outbox::new(OutboxSettings {
        max_message_bytes: limit,
    });
    // A payload that brings the event to exactly the limit, then one byte over.
    let mut at_limit = event("fits", "order.placed", "order-1");
    at_limit.payload = json!({"k": ""});
    let base = at_limit.message_size().expect("size");
    at_limit.payload = json!({"k": "x".repeat(limit - base)});
    assert_eq!(at_limit.message_size(), Some(limit));
    let mut over = at_limit.clone();
    over.business_key = "too-big".into();
    over.payload = json!({"k": "x".repeat(limit - base + 1)});
    // Escaped characters count as PostgreSQL writes them out: a newline is two bytes.
    let mut escaped = at_limit.clone();
    escaped.business_key = "escaped".into();
    escaped.payload = json!({"k": format!("\n{}", "x".repeat(limit - base - 1))});
    // The key and the headers count as well as the payload.
    let mut longer_key = at_limit.clone();
    longer_key.business_key = "longer-key".into();
    longer_key.aggregate_id = "order-10".into();
    let mut more_headers = at_limit.clone();
    more_headers.business_key = "more-headers".into();
    more_headers.headers.push(("x-tenant".into(), "a".into()));

    let mut tx = pool.begin().await.expect("begin");
    for too_big in [&over, &escaped, &longer_key, &more_headers] {
        let size = too_big.message_size().expect("size");
        assert!(size > limit, "{size}");
        let refused = outbox.enqueue(&mut tx, too_big).await;
        assert!(
            matches!(refused, Err(EnqueueError::TooLarge { size: s, limit: l }) if s == size && l == limit),
            "{refused:?}"
        );
        assert!(matches!(
            outbox.check(too_big),
            Err(EnqueueError::TooLarge { .. })
        ));
    }
    let written = outbox
        .enqueue(&mut tx, &at_limit)
        .await
        .expect("at the limit");
    assert!(matches!(written, Enqueued::New { sequence: 1, .. }));
    tx.commit().await.expect("commit");
    let stored: i32 =
        sqlx::query_scalar("SELECT octet_length(payload::text) FROM outbox WHERE event_id = $1")
            .bind(written.event_id())
            .fetch_one(&pool)
            .await
            .expect("stored");
    assert_eq!(
        stored as usize,
        limit - base + 9,
        "the payload as the relay reads it"
    );

    // The default settings: the producer's default message.max.bytes.
    assert_eq!(
        OutboxSettings::default().max_message_bytes,
        DEFAULT_MAX_MESSAGE_BYTES
    );
    assert_eq!(DEFAULT_MAX_MESSAGE_BYTES, 1_000_000);
    let mut big = event("big", "order.placed", "order-2");
    big.payload = json!({"k": ""});
    let base = big.message_size().expect("size");
    big.payload = json!({"k": "x".repeat(DEFAULT_MAX_MESSAGE_BYTES - base)});
    let mut tx = pool.begin().await.expect("begin");
    let _ = enqueue(&mut tx, &big)
        .await
        .expect("a 1,000,000-byte event");
    big.business_key = "bigger".into();
    big.payload = json!({"k": "x".repeat(DEFAULT_MAX_MESSAGE_BYTES - base + 1)});
    assert!(matches!(
        enqueue(&mut tx, &big).await,
        Err(EnqueueError::TooLarge {
            size: 1_000_001,
            limit: DEFAULT_MAX_MESSAGE_BYTES
        })
    ));
    tx.commit().await.expect("commit");
}

#[test]
fn the_outbox_takes_no_key_or_event_type_consumer_groups_would_dead_letter() {
    assert_eq!(
        MAX_AGGREGATE_ID_BYTES,
        pipeline_core::envelope::MAX_KEY_BYTES
    );
    assert_eq!(
        MAX_EVENT_TYPE_BYTES,
        pipeline_core::envelope::MAX_EVENT_TYPE_BYTES
    );
}

/// (generic plans, custom plans) of the outbox's append statement after ten orders of one event
/// each, appended as the order service does, on a new session that plans with `settings` (not
/// one of the pool's: a session the pool handed out before holds the statement's earlier plans).
async fn plans_of_ten_appends(pool: &PgPool, settings: &[(&str, &str)]) -> (i64, i64) {
    let options = pool.connect_options();
    let mut conn = sqlx::PgConnection::connect_with(&options)
        .await
        .expect("connection");
    for (setting, value) in settings {
        sqlx::raw_sql(&format!("SET {setting} = {value}"))
            .execute(&mut conn)
            .await
            .expect("SET");
    }
    for i in 0..10 {
        let mut tx = conn.begin().await.expect("begin");
        let order = format!("order-{i}-{settings:?}");
        // With its payment reminder, as the order service places an order.
        let reminder = (
            event(&order, "order.payment_reminder", &order),
            PublishAt::After(Duration::from_secs(600)),
        );
        enqueue_all_and_delay(
            &mut tx,
            &[event(&order, "order.placed", &order)],
            &[reminder],
            &[],
        )
        .await
        .expect("append");
        tx.commit().await.expect("commit");
    }
    sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement LIKE '%INSERT INTO outbox %' ORDER BY generic_plans + custom_plans DESC
         LIMIT 1",
    )
    .fetch_one(&mut conn)
    .await
    .expect("pg_prepared_statements")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_key_lookup_session_plans_the_append_once_however_few_events_it_carries(pool: PgPool) {
    // Without the planner's generic plans, a plan made with the one-element arrays in view looks
    // cheaper than the generic one, which prices each array at ten elements, so the statement is
    // planned again on every append.
    let planner = pipeline_core::db::KEY_LOOKUP_PLANNER;
    let without: Vec<(&str, &str)> = planner
        .into_iter()
        .filter(|(setting, _)| *setting != "plan_cache_mode")
        .collect();
    let (_, custom) = plans_of_ten_appends(&pool, &without).await;
    assert_eq!(custom, 10);
    let (generic, custom) = plans_of_ten_appends(&pool, &planner).await;
    assert_eq!((generic, custom), (10, 0));
}
