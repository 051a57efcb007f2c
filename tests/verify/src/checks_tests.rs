//! The checks must see what they are meant to see: a synthetic history and database with one
//! known instance of each failure (needs PostgreSQL, as the end-to-end tests do: `DATABASE_URL`).

use pipeline_testkit::db::{drop_database, migrated_database, server_url};
use sqlx::PgPool;
use uuid::Uuid;

use super::database_checks;
use crate::driver::{AckedEvent, History};

const INVENTORY: &str = "t-inventory";
const NOTIFICATION: &str = "t-notification";

/// One event of the synthetic outbox.
struct Event {
    id: Uuid,
    order: Uuid,
    sequence: i64,
    event_type: &'static str,
}

async fn outbox(pool: &PgPool, e: &Event) -> anyhow::Result<()> {
    let _ = sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic,
                             payload)
         VALUES ($1, $2, $3, $2, $4, 't', '{}')",
    )
    .bind(e.id)
    .bind(e.order.to_string())
    .bind(e.event_type)
    .bind(e.sequence)
    .execute(pool)
    .await?;
    // Published, as the relay would have marked it.
    let _ = sqlx::query(
        "WITH sent AS (DELETE FROM outbox_unpublished u USING outbox o
                       WHERE o.id = u.id AND o.event_id = $1 RETURNING u.id)
         INSERT INTO outbox_delivery (id, kafka_partition, kafka_offset, attempts)
         SELECT id, 0, 0, 1 FROM sent",
    )
    .bind(e.id)
    .execute(pool)
    .await?;
    Ok(())
}

async fn applied(pool: &PgPool, group: &str, e: &Event) -> anyhow::Result<()> {
    let _ = sqlx::query(
        "INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(group)
    .bind(e.id)
    .bind(e.order.to_string())
    .bind(e.sequence)
    .bind(e.event_type)
    .execute(pool)
    .await?;
    Ok(())
}

fn ack(e: &Event) -> AckedEvent {
    AckedEvent {
        order_id: e.order,
        sequence: e.sequence,
        event_type: e.event_type,
    }
}

#[tokio::test]
async fn every_kind_of_failure_is_counted_where_it_happened() -> anyhow::Result<()> {
    let (name, pool) = migrated_database("pv_checks").await?;
    let event = |order: Uuid, sequence: i64, event_type: &'static str| Event {
        id: Uuid::new_v4(),
        order,
        sequence,
        event_type,
    };
    let (a, b, c, d) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let a1 = event(a, 1, "order.placed");
    let a2 = event(a, 2, "order.paid");
    let a3 = event(a, 3, "order.cancelled");
    let b1 = event(b, 1, "order.placed");
    let b2 = event(b, 2, "order.cancelled");
    // Committed, answer lost: never acknowledged, must still be applied.
    let c1 = event(c, 1, "order.placed");
    // Acknowledged, yet not in the outbox.
    let d1 = event(d, 1, "order.placed");
    for e in [&a1, &a2, &a3, &b1, &b2, &c1] {
        outbox(&pool, e).await?;
    }
    let mut acknowledged: Vec<AckedEvent> =
        [&a1, &a2, &b1, &b2, &d1].into_iter().map(ack).collect();
    // The driver believed a3 was a shipment.
    acknowledged.push(AckedEvent {
        event_type: "order.shipped",
        ..ack(&a3)
    });
    let history = History {
        acknowledged,
        ..History::default()
    };

    // inventory: a2 applied twice (a duplicate, and out of sequence after a3), b2 lost.
    for e in [&a1, &a2, &a3, &a2, &b1, &c1] {
        applied(&pool, INVENTORY, e).await?;
    }
    // notification: b1 dead-lettered, b2 never applied (parked behind it), everything else once.
    for e in [&a1, &a2, &a3, &c1] {
        applied(&pool, NOTIFICATION, e).await?;
    }
    let _ = sqlx::query(
        "INSERT INTO dead_letter (group_name, event_id, aggregate_id, sequence, topic, partition,
                                  kafka_offset, reason)
         VALUES ($1, $2, $3, 1, 't', 0, 7, 'test')",
    )
    .bind(NOTIFICATION)
    .bind(b1.id)
    .bind(b.to_string())
    .execute(&pool)
    .await?;

    let groups = [INVENTORY.to_owned(), NOTIFICATION.to_owned()];
    let results = database_checks(&pool, &groups, &history).await;
    pool.close().await;
    drop_database(&server_url(), &name).await?;
    let results = results?;

    assert_eq!(results.outbox_events, 6);
    assert_eq!(results.unacknowledged_committed, 1, "c1");
    assert_eq!(results.acknowledged_not_in_outbox, 1, "d1");
    assert_eq!(results.sequence_type_mismatches, 1, "a3");
    let inventory = &results.by_group[INVENTORY];
    assert_eq!(inventory.lost, 2, "b2 and d1");
    assert_eq!(inventory.duplicate_effects, 1, "a2 twice");
    assert_eq!(inventory.reorders, 1, "a2 after a3");
    let notification = &results.by_group[NOTIFICATION];
    assert_eq!(
        notification.lost, 2,
        "b2 and d1; b1 is dead-lettered, not lost"
    );
    assert_eq!(notification.duplicate_effects, 0);
    assert_eq!(notification.reorders, 0);
    assert_eq!(notification.dead_lettered, 1);
    assert_eq!(
        (results.lost, results.duplicate_effects, results.reorders),
        (4, 1, 1)
    );
    assert_eq!(results.examples["lost"].len(), 4);
    Ok(())
}
