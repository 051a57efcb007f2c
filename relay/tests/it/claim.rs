//! Claim and mark against a real PostgreSQL (`#[sqlx::test]` creates a migrated database per test
//! from `DATABASE_URL`, e.g. postgres://postgres@127.0.0.1:5432/postgres).

use crate::common;

use std::time::Duration;

use relay::claim::{claim_batch, claim_batch_excluding, ClaimSessions};
use relay::mark::{mark_published, record_failures, FailedAttempt, Published};
use sqlx::PgPool;

async fn append(pool: &PgPool, order: &str, event_type: &str) -> i64 {
    let mut tx = pool.begin().await.expect("begin");
    let id = append_in(&mut tx, order, event_type).await;
    tx.commit().await.expect("commit");
    id
}

async fn append_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: &str,
    event_type: &str,
) -> i64 {
    let event = outbox::NewEvent {
        business_key: order.to_owned(),
        event_type: event_type.to_owned(),
        aggregate_id: order.to_owned(),
        topic: "orders".to_owned(),
        payload: serde_json::json!({"order": order}),
        headers: vec![],
    };
    let enqueued = outbox::enqueue(tx, &event).await.expect("enqueue");
    sqlx::query_scalar("SELECT id FROM outbox WHERE event_id = $1")
        .bind(enqueued.event_id())
        .fetch_one(&mut **tx)
        .await
        .expect("id")
}

fn ids(events: &[relay::claim::OutboxEvent]) -> Vec<i64> {
    events.iter().map(|e| e.id).collect()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_committed_late_is_claimed_not_skipped(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    // Transaction A takes an id first but commits after B.
    let mut slow = pool.begin().await.expect("begin");
    let late = append_in(&mut slow, "order-a", "order.placed").await;
    let early = append(&pool, "order-b", "order.placed").await;
    assert!(late < early);

    let first = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    assert_eq!(ids(&first), vec![early], "only committed rows are visible");
    mark_published(
        &pool,
        lease.fence(),
        &[Published {
            id: early,
            partition: 0,
            offset: Some(0),
        }],
    )
    .await
    .expect("mark");

    slow.commit().await.expect("commit");
    let second = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    assert_eq!(
        ids(&second),
        vec![late],
        "the lower id committed later is still claimed"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_order_waits_behind_its_failed_or_retrying_event_while_others_flow(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let a1 = append(&pool, "order-a", "order.placed").await;
    let a2 = append(&pool, "order-a", "order.paid").await;
    let b1 = append(&pool, "order-b", "order.placed").await;
    let claimed = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    assert_eq!(
        ids(&claimed),
        vec![a1, a2, b1],
        "one order's events go together, in order"
    );

    // a1's attempt failed and waits for its retry: a2 must not go ahead of it; b1 flows.
    record_failures(
        &pool,
        lease.fence(),
        &[FailedAttempt {
            id: a1,
            error: "broker down".into(),
            retry_in: Duration::from_secs(60),
            give_up: false,
        }],
    )
    .await
    .expect("failure");
    let claimed = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    assert_eq!(ids(&claimed), vec![b1]);

    let (attempts, state, error, later): (i32, String, Option<String>, bool) = sqlx::query_as(
        "SELECT attempts, state, last_error, next_attempt_at > now() + interval '50 seconds'
         FROM outbox_status WHERE id = $1",
    )
    .bind(a1)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(
        (attempts, state.as_str(), error.as_deref(), later),
        (1, "pending", Some("broker down"), true)
    );

    // Out of attempts: failed, and it still holds a2.
    record_failures(
        &pool,
        lease.fence(),
        &[FailedAttempt {
            id: a1,
            error: "message too large".into(),
            retry_in: Duration::ZERO,
            give_up: true,
        }],
    )
    .await
    .expect("failure");
    let state: String = sqlx::query_scalar("SELECT state FROM outbox_status WHERE id = $1")
        .bind(a1)
        .fetch_one(&pool)
        .await
        .expect("state");
    assert_eq!(state, "failed");
    let claimed = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    assert_eq!(ids(&claimed), vec![b1]);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn marking_records_partition_and_offset_once(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let a = append(&pool, "order-a", "order.placed").await;
    let marked = mark_published(
        &pool,
        lease.fence(),
        &[Published {
            id: a,
            partition: 3,
            offset: Some(42),
        }],
    )
    .await
    .expect("mark");
    assert_eq!(marked, 1);
    let again = mark_published(
        &pool,
        lease.fence(),
        &[Published {
            id: a,
            partition: 4,
            offset: Some(43),
        }],
    )
    .await
    .expect("mark");
    assert_eq!(again, 0, "a published row is not rewritten");
    let (p, o): (i32, i64) =
        sqlx::query_as("SELECT kafka_partition, kafka_offset FROM outbox_delivery WHERE id = $1")
            .bind(a)
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!((p, o), (3, 42));
    assert!(claim_batch(&ClaimSessions::new(&pool), 10)
        .await
        .expect("claim")
        .is_empty());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_write_confirmed_without_its_offset_is_recorded_as_offset_unknown(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    let a = append(&pool, "order-a", "order.placed").await;
    // The idempotent producer's report of a retry the broker had already written, after a
    // leader change: the partition, and librdkafka's "offset unknown".
    let marked = mark_published(&pool, lease.fence(), &[Published::reported(a, 2, -1001)])
        .await
        .expect("mark");
    assert_eq!(marked, 1);
    let (state, p, o): (String, i32, Option<i64>) = sqlx::query_as(
        "SELECT state, kafka_partition, kafka_offset FROM outbox_status WHERE id = $1",
    )
    .bind(a)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!((state.as_str(), p, o), ("published", 2, None));
    // No writer can store a sentinel as if it were a position.
    let b = append(&pool, "order-b", "order.placed").await;
    let refused = sqlx::query(
        "INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts)
         VALUES ($1, 0, -1001, 1)",
    )
    .bind(b)
    .execute(&pool)
    .await;
    assert!(refused.is_err(), "a negative offset is refused");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claim_stays_an_index_scan_with_a_million_published_rows(pool: PgPool) {
    claim_plan_and_time(&pool, 1_000_000, 50).await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claim_stays_cheap_with_a_large_pending_backlog(pool: PgPool) {
    claim_plan_and_time(&pool, 0, 100_000).await;
}

async fn claim_plan_and_time(pool: &PgPool, published: i64, pending: i64) {
    sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
         SELECT gen_random_uuid(), 'o' || g, 'order.placed', 'o' || g, 1, 'orders', '{}'::jsonb
         FROM generate_series(1, $1) AS g",
    )
    .bind(published)
    .execute(pool)
    .await
    .expect("bulk insert");
    sqlx::query(
        "WITH sent AS (DELETE FROM outbox_unpublished RETURNING id)
         INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts)
         SELECT id, 0, id, 1 FROM sent",
    )
    .execute(pool)
    .await
    .expect("published");
    // As autovacuum does on the queue after every 20,000 deleted rows: its space is reused.
    sqlx::query("VACUUM outbox_unpublished")
        .execute(pool)
        .await
        .expect("vacuum");
    sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
         SELECT gen_random_uuid(), 'p' || g, 'order.placed', 'p' || (g / 3), 1 + g % 3, 'orders', '{}'::jsonb
         FROM generate_series(1, $1) AS g",
    )
    .bind(pending)
    .execute(pool)
    .await
    .expect("pending rows");
    sqlx::query("VACUUM ANALYZE outbox, outbox_unpublished")
        .execute(pool)
        .await
        .expect("vacuum");
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {}", relay::claim::CLAIM_SQL))
        .bind(2000_i64)
        .bind(Vec::<String>::new())
        .fetch_all(pool)
        .await
        .expect("explain");
    let plan = plan.join("\n");
    // The queue holds only unpublished events, so the planner may read a small one whole; the
    // outbox itself, which keeps every event, must be read by id only.
    assert!(
        !plan.contains("Seq Scan on outbox "),
        "claim must not scan the outbox:\n{plan}"
    );
    let started = std::time::Instant::now();
    let claimed = claim_batch(&ClaimSessions::new(pool), 2000)
        .await
        .expect("claim");
    assert_eq!(claimed.len() as i64, pending.min(2000));
    println!(
        "claim of {} from {published} published + {pending} pending rows took {:?}\n{plan}",
        claimed.len(),
        started.elapsed()
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn any_writer_s_insert_joins_the_queue_in_its_own_transaction(pool: PgPool) {
    // A writer that inserts outbox rows itself (not through the library), several per statement,
    // with ON CONFLICT DO NOTHING skipping a duplicate business fact.
    let insert = "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence,
                                      topic, payload)
                  SELECT gen_random_uuid(), 'k' || g, 'order.placed', 'w' || g, 1, 'orders', '{}'
                  FROM generate_series(1, $1) AS g
                  ON CONFLICT (business_key, event_type) DO NOTHING";
    let mut rolled_back = pool.begin().await.expect("begin");
    sqlx::query(insert)
        .bind(5_i32)
        .execute(&mut *rolled_back)
        .await
        .expect("insert");
    rolled_back.rollback().await.expect("rollback");
    assert!(
        claim_batch(&ClaimSessions::new(&pool), 100)
            .await
            .expect("claim")
            .is_empty(),
        "a rolled-back insert queues nothing"
    );

    sqlx::query(insert)
        .bind(3_i32)
        .execute(&pool)
        .await
        .expect("insert");
    let again = sqlx::query(insert)
        .bind(4_i32)
        .execute(&pool)
        .await
        .expect("insert with duplicates");
    assert_eq!(again.rows_affected(), 1, "three duplicates skipped");
    let claimed = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim");
    let keys: Vec<&str> = claimed.iter().map(|e| e.aggregate_id.as_str()).collect();
    assert_eq!(
        keys,
        vec!["w1", "w2", "w3", "w4"],
        "each inserted row queued once"
    );
    let status: Vec<String> = sqlx::query_scalar("SELECT state FROM outbox_status ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("status");
    assert_eq!(status, vec!["pending"; 4]);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_aggregate_with_a_batch_in_flight_is_left_out_until_it_settles(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    // order-a's first event is on its way to Kafka in an earlier batch; its second event, and
    // nothing of order-a, may go out in the next batch, whatever the first one's fate.
    let a1 = append(&pool, "order-a", "order.placed").await;
    let b1 = append(&pool, "order-b", "order.placed").await;
    let a2 = append(&pool, "order-a", "order.paid").await;
    let next = claim_batch_excluding(&ClaimSessions::new(&pool), 100, &["order-a"])
        .await
        .expect("claim");
    assert_eq!(
        ids(&next),
        vec![b1],
        "only aggregates without a batch in flight"
    );

    // order-a's batch failed: a1 waits for its retry, and a2 stays behind it.
    record_failures(
        &pool,
        lease.fence(),
        &[FailedAttempt {
            id: a1,
            error: "broker unavailable".into(),
            retry_in: Duration::from_secs(60),
            give_up: false,
        }],
    )
    .await
    .expect("record failure");
    let after = claim_batch_excluding(&ClaimSessions::new(&pool), 100, &[])
        .await
        .expect("claim");
    assert_eq!(ids(&after), vec![b1], "a2 is held behind a1's retry: {a2}");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claims_are_prepared_and_planned_once_with_a_plan_that_holds_for_any_queue(pool: PgPool) {
    append(&pool, "order-a", "order.placed").await;
    let claims = ClaimSessions::new(&pool);
    for _ in 0..10 {
        assert_eq!(claim_batch(&claims, 100).await.expect("claim").len(), 1);
    }
    let settings: (String, String, String) = sqlx::query_as(
        "SELECT current_setting('plan_cache_mode'), current_setting('enable_nestloop'),
                current_setting('enable_seqscan')",
    )
    .fetch_one(&mut *claims.session().await.expect("session"))
    .await
    .expect("settings");
    assert_eq!(
        settings,
        ("force_generic_plan".into(), "off".into(), "off".into())
    );
    let prepared: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement LIKE 'WITH q AS MATERIALIZED%'",
    )
    .fetch_all(&mut *claims.session().await.expect("session"))
    .await
    .expect("pg_prepared_statements");
    assert_eq!(
        prepared,
        vec![(10, 0)],
        "one statement, its one plan used on each of its ten runs"
    );

    // The plan made for a one-row queue, as a claim session makes it: no step reads a table
    // once per row of another, or whole: the queue in id order through its primary key (the
    // limit stops it), each row's earlier retried events looked up in their partial index, the
    // aggregates left out a hashed set, the outbox by the claimed ids.
    sqlx::raw_sql("ANALYZE outbox, outbox_unpublished")
        .execute(&pool)
        .await
        .expect("analyze");
    let mut conn = claims.session().await.expect("session");
    sqlx::raw_sql(&format!(
        "PREPARE claim(bigint, text[]) AS {}",
        relay::claim::CLAIM_SQL
    ))
    .execute(&mut *conn)
    .await
    .expect("prepare");
    let plan: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE claim(5000, '{a,b,c}')")
        .fetch_all(&mut *conn)
        .await
        .expect("EXPLAIN");
    let plan = plan.join("\n");
    assert!(!plan.contains("Nested Loop"), "{plan}");
    assert!(!plan.contains("Seq Scan"), "{plan}");
    assert!(plan.contains("hashed SubPlan"), "{plan}");
    assert!(plan.contains("outbox_unpublished_retrying_idx"), "{plan}");
    assert!(
        plan.contains("Index Scan using outbox_unpublished_pkey"),
        "{plan}"
    );
}
