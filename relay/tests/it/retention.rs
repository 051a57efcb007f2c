//! Retention of the outbox's tables on a real PostgreSQL (`DATABASE_URL`): published events go
//! with their delivery and attempts, and nothing still needed does (pending, failed and delayed
//! events, events an open dead letter points to).

use chrono::Utc;
use pipeline_core::retention::Runner;
use pipeline_testkit::db::{drop_database, migrated_database, server_url};
use pipeline_testkit::history::{append, attempt, publish};
use relay::retention::{groups_here, rules, RetentionSettings};
use sqlx::PgPool;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

#[tokio::test]
async fn published_events_go_and_everything_still_needed_stays() {
    let (name, pool) = migrated_database("relay_retention")
        .await
        .expect("database");
    let ids = append(&pool, 6, 20).await;
    publish(&pool, &ids[..4], 20).await;
    // ids[1] failed once before it was published: its attempt goes with it.
    attempt(&pool, ids[1], false).await;
    // ids[3] is published, but a group's open dead letter points to it.
    sqlx::query(
        "INSERT INTO dead_letter (group_name, event_id, aggregate_id, topic, partition, kafka_offset,
                                  reason)
         SELECT 'billing', event_id, aggregate_id, 'orders', 0, id, 'rejected'
         FROM outbox WHERE id = $1",
    )
    .bind(ids[3])
    .execute(&pool)
    .await
    .expect("letter");
    // ids[4] failed for good; ids[5] is still pending.
    sqlx::query("UPDATE outbox_unpublished SET state = 'failed', attempts = 5 WHERE id = $1")
        .bind(ids[4])
        .execute(&pool)
        .await
        .expect("fail");
    attempt(&pool, ids[4], true).await;
    // A delayed event, due in a month.
    sqlx::query(
        "INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
                                     payload, publish_at, delayed_at)
         VALUES (gen_random_uuid(), 'reminder', 'order.reminder', 'order-x', 'orders', '{}',
                 now() + interval '30 days', now() - interval '20 days')",
    )
    .execute(&pool)
    .await
    .expect("delayed");
    assert!(groups_here(&pool).await.expect("tables"));

    let runner = Runner::new(rules(&RetentionSettings::default(), true), "test");
    let dry = runner
        .run_once(&pool, Utc::now(), true)
        .await
        .expect("dry run");
    assert_eq!(dry.tables[0].removed, 3);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 6);

    // A consumer's runner at work on the groups' tables of the same database does not hold up
    // the outbox's.
    let mut consumer_runner = pool.begin().await.expect("begin");
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(pipeline_core::retention::runner::GROUPS_LOCK)
        .fetch_one(&mut *consumer_runner)
        .await
        .expect("lock");
    assert!(held);
    let run = runner
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("run");
    assert!(!run.skipped);
    consumer_runner.rollback().await.expect("release");
    assert_eq!(
        (run.tables[0].table.as_str(), run.tables[0].removed),
        ("outbox", 3)
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("left");
    assert_eq!(left, ids[3..].to_vec());
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_delivery").await,
        1
    );
    let attempts: Vec<i64> = sqlx::query_scalar("SELECT event FROM outbox_attempt")
        .fetch_all(&pool)
        .await
        .expect("attempts");
    assert_eq!(attempts, vec![ids[4]]);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_unpublished").await,
        2
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_delayed").await, 1);

    // Once the letter is resolved, its event goes too.
    sqlx::query("UPDATE dead_letter SET status = 'discarded', resolved_at = now()")
        .execute(&pool)
        .await
        .expect("resolve");
    let run = runner
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("run");
    assert_eq!(run.tables[0].removed, 1);
    pool.close().await;
    drop_database(&server_url(), &name).await.expect("drop");
}

/// Events streamed from the write-ahead log have no delivery record: they go once they are older
/// than the window and the stream's horizon has passed them, and not before.
#[tokio::test]
async fn streamed_events_go_once_the_horizon_has_passed_them() {
    let (name, pool) = migrated_database("relay_retention_wal")
        .await
        .expect("database");
    // A relay streams: writers queue nothing. Its horizon is still before the events.
    sqlx::query(
        "INSERT INTO outbox_wal_source (lock_key, slot, streaming, horizon)
         VALUES (1, 'relay_retention_test', true, now() - interval '30 days')",
    )
    .execute(&pool)
    .await
    .expect("stream");
    let streamed = append(&pool, 3, 20).await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_unpublished").await,
        0,
        "nothing queued while a relay streams"
    );
    let runner = Runner::new(rules(&RetentionSettings::default(), false), "test");
    let run = runner
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("run");
    assert_eq!(
        run.tables[0].removed, 0,
        "not published yet: the horizon is before them"
    );

    // One of them did not go out and waits in the queue; the horizon passes all three.
    sqlx::query(
        "INSERT INTO outbox_unpublished (id, aggregate_id, sequence, created_at)
         SELECT id, aggregate_id, sequence, created_at FROM outbox WHERE id = $1",
    )
    .bind(streamed[2])
    .execute(&pool)
    .await
    .expect("queue one");
    sqlx::query("UPDATE outbox_wal_source SET horizon = now() - interval '10 days'")
        .execute(&pool)
        .await
        .expect("horizon");
    let run = runner
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("run");
    assert_eq!(run.tables[0].removed, 2);
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("left");
    assert_eq!(left, vec![streamed[2]], "the queued one stays");
    pool.close().await;
    drop_database(&server_url(), &name).await.expect("drop");
}
