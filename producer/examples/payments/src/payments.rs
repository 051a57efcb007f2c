//! The payments service: each change to a payment and the event describing it are written in one
//! transaction of the service's own, through the outbox library.

use outbox::{enqueue, EnqueueError, Enqueued, NewEvent};
use sqlx::PgPool;

/// The payments service: each change to a payment and the event describing it are written in
/// one transaction of the service's own.
#[derive(Clone)]
pub struct Payments {
    pool: PgPool,
    topic: String,
}

impl Payments {
    /// A service writing to `pool`, its events bound for `topic`.
    pub fn new(pool: PgPool, topic: impl Into<String>) -> Payments {
        Payments {
            pool,
            topic: topic.into(),
        }
    }

    /// Records a captured payment and its `payment.captured` event.
    pub async fn capture(
        &self,
        payment_id: &str,
        amount_cents: i64,
    ) -> Result<Enqueued, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO payment (payment_id, amount_cents, status) VALUES ($1, $2, 'captured')",
        )
        .bind(payment_id)
        .bind(amount_cents)
        .execute(&mut *tx)
        .await?;
        let event = self.event(payment_id, "payment.captured", amount_cents);
        let enqueued = enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    /// Refunds a payment and records its `payment.refunded` event.
    pub async fn refund(&self, payment_id: &str) -> Result<Enqueued, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        let amount_cents: i64 = sqlx::query_scalar(
            "UPDATE payment SET status = 'refunded', updated_at = clock_timestamp()
             WHERE payment_id = $1 RETURNING amount_cents",
        )
        .bind(payment_id)
        .fetch_one(&mut *tx)
        .await?;
        let event = self.event(payment_id, "payment.refunded", amount_cents);
        let enqueued = enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    fn event(&self, payment_id: &str, event_type: &str, amount_cents: i64) -> NewEvent {
        NewEvent {
            business_key: payment_id.to_owned(),
            event_type: event_type.to_owned(),
            aggregate_id: payment_id.to_owned(),
            topic: self.topic.clone(),
            payload: serde_json::json!({ "payment_id": payment_id, "amount_cents": amount_cents }),
            headers: vec![],
        }
    }
}
