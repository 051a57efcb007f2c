//! The relay's queue table stays small: published events leave dead rows behind, and the relay's
//! vacuum gives their pages back, so a claim does not read them. Needs `DATABASE_URL` (see
//! `claim.rs`).

mod common;

use relay::claim::claim_batch;
use relay::mark::{mark_published, Published};
use relay::vacuum::vacuum_once;
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn vacuum_gives_back_the_pages_of_published_events(pool: PgPool) {
    let (_elector, lease) = common::hold_lease(&pool).await;
    enqueue_orders(&pool, "first", 3000).await;
    let claimed = claim_batch(&pool, 5000).await.expect("claim");
    assert_eq!(claimed.len(), 3000);
    let published: Vec<Published> = claimed
        .iter()
        .enumerate()
        .map(|(i, e)| Published {
            id: e.id,
            partition: 0,
            offset: i as i64,
        })
        .collect();
    assert_eq!(
        mark_published(&pool, lease.fence(), &published)
            .await
            .expect("mark"),
        3000
    );
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(pending, 0);
    // Every row is gone, but its page is still there for a claim to read.
    assert!(queue_pages(&pool).await > 5);

    vacuum_once(&pool).await.expect("vacuum");
    assert_eq!(queue_pages(&pool).await, 0);

    // The queue goes on working: a new event is claimed.
    enqueue_orders(&pool, "later", 1).await;
    assert_eq!(claim_batch(&pool, 10).await.expect("claim").len(), 1);
}
