//! `pipeline status` on an outbox a relay streams from the write-ahead log: the slot, its session,
//! the WAL it keeps, and the events past the horizon, read from a real PostgreSQL
//! (`wal_level = logical`).

use clap::Parser;
use consumer::Groups;
use operator::cli::Cli;
use operator::targets::Targets;
use pipeline_testkit::db::database_url;
use sqlx::PgPool;

fn targets(pool: &PgPool) -> Targets {
    let url = database_url(pool);
    let cli = Cli::try_parse_from(["pipeline", "--database-url", &url, "status"]).expect("args");
    Targets::new(cli.targets, &Groups::new())
}

async fn append(pool: &PgPool, n: u32) {
    let mut tx = pool.begin().await.expect("begin");
    let events: Vec<outbox::NewEvent> = (0..n)
        .map(|i| outbox::NewEvent {
            business_key: format!("order-1:{i}"),
            event_type: "order.updated".to_owned(),
            aggregate_id: "order-1".to_owned(),
            topic: "orders".to_owned(),
            payload: serde_json::json!({ "i": i }),
            headers: Vec::new(),
        })
        .collect();
    let _ = outbox::enqueue_all(&mut tx, &events).await.expect("append");
    tx.commit().await.expect("commit");
}

#[sqlx::test(migrations = false)]
async fn the_status_shows_the_stream_its_slot_and_the_events_past_the_horizon(pool: PgPool) {
    outbox::MIGRATOR.run(&pool).await.expect("outbox tables");
    let status = operator::status::read(&targets(&pool))
        .await
        .expect("status");
    assert!(status.stream.is_empty(), "no relay ever streamed");

    let slot = format!("status_test_{}", uuid::Uuid::new_v4().simple());
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(&pool)
        .await
        .expect("a slot");
    // A relay streams (by the database): writers queue nothing, and the horizon is behind the
    // events written since.
    sqlx::query(
        "INSERT INTO outbox_wal_source (lock_key, slot, streaming, horizon, horizon_id)
         VALUES (7, $1, true, now() - interval '1 minute', 0)",
    )
    .bind(&slot)
    .execute(&pool)
    .await
    .expect("stream row");
    append(&pool, 3).await;
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
        .fetch_one(&pool)
        .await
        .expect("queue");
    assert_eq!(queued, 0, "writers queue nothing while a relay streams");

    let status = operator::status::read(&targets(&pool))
        .await
        .expect("status");
    let dropped = sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&pool)
        .await;
    let [w] = status.stream.as_slice() else {
        panic!("one stream: {:?}", status.stream);
    };
    assert_eq!((w.lease_key, w.slot.as_str()), (7, slot.as_str()));
    assert!(w.streaming && w.slot_exists && !w.slot_active, "{w:?}");
    assert_eq!(w.wal_status.as_deref(), Some("reserved"));
    assert_eq!(w.past_horizon, 3, "the three events are past the horizon");
    assert!(
        w.lag_bytes.unwrap_or(0) > 0,
        "the slot confirmed nothing: {w:?}"
    );
    assert!(w.retained_bytes.unwrap_or(0) > 0, "{w:?}");
    assert!(w.horizon_seconds >= 59.0, "{w:?}");
    let states: Vec<String> = sqlx::query_scalar("SELECT state FROM outbox_status ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("states");
    assert_eq!(
        states, ["pending"; 3],
        "not published before the horizon passes them"
    );
    let transitions = |trace: &operator::trace::Trace| -> Vec<String> {
        trace.steps.iter().map(|s| s.transition.clone()).collect()
    };
    let trace = operator::trace::read(&targets(&pool), "order-1")
        .await
        .expect("trace");
    assert_eq!(transitions(&trace), ["written"; 3], "nothing published yet");

    // The horizon passes them: each event's history says it was published from the log.
    sqlx::query("UPDATE outbox_wal_source SET horizon = clock_timestamp()")
        .execute(&pool)
        .await
        .expect("horizon");
    let trace = operator::trace::read(&targets(&pool), "order-1")
        .await
        .expect("trace");
    assert_eq!(
        transitions(&trace),
        [
            "written",
            "published",
            "written",
            "published",
            "written",
            "published"
        ]
    );
    let published = &trace.steps[1];
    assert!(
        published
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("write-ahead log")),
        "{published:?}"
    );
    assert_eq!(
        published.kafka_partition, None,
        "not known for a streamed event"
    );
    dropped.expect("drop the slot");
}
