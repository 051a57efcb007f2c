//! Outbox rows written straight into a test database, as the outbox library and the relay
//! would have written them at a given age: for the tests of retention.

use sqlx::PgPool;
use uuid::Uuid;

/// Appends `n` events of one aggregate per event (so none holds another back), created
/// `days_ago`; returns their outbox ids.
pub async fn append(pool: &PgPool, n: i64, days_ago: i64) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload, created_at)
         SELECT (lpad(to_hex((extract(epoch FROM now() - make_interval(days => $1::int)) * 1000)::bigint), 12, '0')
                 || '7' || substr(md5(random()::text), 1, 3) || '8'
                 || substr(md5(random()::text), 1, 15))::uuid,
                'fact-' || g || '-' || $2, 'order.placed',
                'order-' || g || '-' || $2, 1, 'orders', '{}'::jsonb,
                now() - make_interval(days => $1::int)
         FROM generate_series(1, $3) g
         RETURNING id",
    )
    .bind(days_ago as i32)
    .bind(Uuid::new_v4().simple().to_string())
    .bind(n)
    .fetch_all(pool)
    .await
    .expect("append")
}

/// Marks `ids` published `days_ago`, as the relay does.
pub async fn publish(pool: &PgPool, ids: &[i64], days_ago: i64) {
    sqlx::query(
        "WITH sent AS (DELETE FROM outbox_unpublished WHERE id = ANY($1) RETURNING id)
         INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts, published_at)
         SELECT id, 0, id, 1, now() - make_interval(days => $2::int) FROM sent",
    )
    .bind(ids)
    .bind(days_ago as i32)
    .execute(pool)
    .await
    .expect("publish");
}

/// Records a failed publish attempt of event `id`, 20 days ago.
pub async fn attempt(pool: &PgPool, id: i64, gave_up: bool) {
    sqlx::query(
        "INSERT INTO outbox_attempt (event, attempt, error, gave_up, relay_epoch, attempted_at)
         VALUES ($1, 1, 'broker down', $2, 1, now() - interval '20 days')",
    )
    .bind(id)
    .bind(gave_up)
    .execute(pool)
    .await
    .expect("attempt");
}
