//! The relay's queue table stays small: published events leave dead rows behind, and the relay's
//! vacuum frees them for new events; a table grown by a backlog is given back its pages, so a
//! claim does not read them. Needs `DATABASE_URL` (see
//! `claim.rs`).

use crate::common;

use relay::claim::{claim_batch, ClaimSessions};
use relay::mark::{mark_published, Published};
use relay::vacuum::{vacuum_once, SHRINK_ABOVE_PAGES};
use sqlx::PgPool;

async fn enqueue_orders(pool: &PgPool, prefix: &str, orders: usize) {
    let events: Vec<outbox::NewEvent> = (0..orders)
        .map(|i| outbox::NewEvent {
            business_key: format!("{prefix}-{i}"),
            event_type: "order.placed".to_owned(),
            aggregate_id: format!("{prefix}-{i}"),
            topic: "orders".to_owned(),
            payload: serde_json::json!({"order": i}),
            headers: vec![],
        })
        .collect();
    let mut tx = pool.begin().await.expect("begin");
    outbox::enqueue_all(&mut tx, &events)
        .await
        .expect("enqueue_all");
    tx.commit().await.expect("commit");
}

/// Pages of the queue table.
async fn queue_pages(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT pg_relation_size('outbox_unpublished') / current_setting('block_size')::bigint",
    )
    .fetch_one(pool)
    .await
    .expect("relation size")
}

/// Claims and marks published every pending event, as the relay does.
async fn publish_all(pool: &PgPool, lease: &relay::lease::Lease) {
    loop {
        let claimed = claim_batch(&ClaimSessions::new(pool), 5000)
            .await
            .expect("claim");
        if claimed.is_empty() {
            return;
        }
        let published: Vec<Published> = claimed
            .iter()
            .enumerate()
            .map(|(i, e)| Published {
                id: e.id,
                partition: 0,
                offset: Some(i as i64),
            })
            .collect();
        let marked = mark_published(pool, lease.fence(), &published)
            .await
            .expect("mark");
        assert_eq!(marked, published.len() as u64);
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn vacuum_frees_the_rows_of_published_events_and_shrinks_only_a_grown_table(pool: PgPool) {
    // The relay's own vacuum is under test: autovacuum, which the table's settings start after
    // 20,000 inserted or deleted rows, would hold the table while it runs, and the relay's vacuum
    // skips a table someone else holds (the next round takes it), so it stays out here.
    sqlx::raw_sql("ALTER TABLE outbox_unpublished SET (autovacuum_enabled = false)")
        .execute(&pool)
        .await
        .expect("autovacuum off");
    let (_elector, lease) = common::hold_lease(&pool).await;
    enqueue_orders(&pool, "first", 3000).await;
    publish_all(&pool, &lease).await;
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(pending, 0);
    let small = queue_pages(&pool).await;
    assert!(small > 5 && small <= SHRINK_ABOVE_PAGES, "{small} pages");

    // A small table keeps its pages (no ACCESS EXCLUSIVE lock for claims and writers to queue
    // behind); its dead rows are freed, so new events fill the same pages.
    vacuum_once(&pool).await.expect("vacuum");
    assert_eq!(queue_pages(&pool).await, small);
    enqueue_orders(&pool, "again", 3000).await;
    assert_eq!(
        queue_pages(&pool).await,
        small,
        "the freed pages are reused"
    );
    publish_all(&pool, &lease).await;

    // A backlog grows the table past the threshold: once drained, its pages are given back.
    enqueue_orders(&pool, "backlog", 20_000).await;
    publish_all(&pool, &lease).await;
    assert!(queue_pages(&pool).await > SHRINK_ABOVE_PAGES);
    // The relay vacuums every round; a round whose vacuum found the table held, or rows a
    // transaction of this database could still see, gives the pages back on a later one.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    for round in 1.. {
        vacuum_once(&pool).await.expect("vacuum");
        let pages = queue_pages(&pool).await;
        if pages == 0 {
            if round > 1 {
                eprintln!("the queue table shrank on vacuum round {round}");
            }
            break;
        }
        if std::time::Instant::now() >= deadline {
            // What held the pages: sessions of this database with an old snapshot or a lock.
            let held: Vec<String> = sqlx::query_scalar(
                "SELECT format('%s %s xmin=%s %s', pid, state, backend_xmin, left(query, 80))
                 FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_all(&pool)
            .await
            .expect("sessions");
            panic!("{pages} pages left after 20 s of vacuum rounds; sessions: {held:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }

    // The queue goes on working: a new event is claimed.
    enqueue_orders(&pool, "later", 1).await;
    assert_eq!(
        claim_batch(&ClaimSessions::new(&pool), 10)
            .await
            .expect("claim")
            .len(),
        1
    );
}
