//! Placing an order, idempotently when the client sends an `Idempotency-Key`.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::store::fetch_order;
use super::{Order, OrderError, OrderService};
use crate::validation::ValidOrder;

/// The result of [`OrderService::place`].
#[derive(Debug, Clone)]
pub struct Placed {
    pub order: Order,
    /// False when the idempotency key named an order placed earlier by the same request: that
    /// order is returned and nothing was written.
    pub created: bool,
}

impl OrderService {
    /// Places `order`: the order row, its lines and its `order.placed` event in one transaction.
    ///
    /// With an idempotency key, the key's unique constraint decides: the insert either takes the
    /// key, or finds it taken (waiting for a concurrent holder to commit or roll back) and
    /// returns that order if it came from the same request. There is no check-then-insert
    /// window, so concurrent retries of one request place one order.
    pub async fn place(
        &self,
        order: &ValidOrder,
        idempotency_key: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Placed, OrderError> {
        let fingerprint = idempotency_key.map(|_| order.fingerprint());
        let order_id = Uuid::now_v7();
        let mut tx = self.pool.begin().await?;

        let inserted: Option<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
            "INSERT INTO orders (order_id, customer_id, email, status, idempotency_key,
                                 request_hash)
             VALUES ($1, $2, $3, 'placed', $4, $5)
             ON CONFLICT (idempotency_key) DO NOTHING
             RETURNING created_at, updated_at",
        )
        .bind(order_id)
        .bind(&order.customer_id)
        .bind(&order.email)
        .bind(idempotency_key)
        .bind(&fingerprint)
        .fetch_optional(&mut *tx)
        .await?;

        let Some((created_at, updated_at)) = inserted else {
            // Only a non-null key can conflict. Read committed: this statement sees the row
            // the conflicting transaction committed.
            let existing: (Uuid, Option<String>) = sqlx::query_as(
                "SELECT order_id, request_hash FROM orders WHERE idempotency_key = $1",
            )
            .bind(idempotency_key)
            .fetch_one(&mut *tx)
            .await?;
            if existing.1 != fingerprint {
                return Err(OrderError::IdempotencyKeyReused);
            }
            let order = fetch_order(&mut tx, existing.0)
                .await?
                .ok_or(OrderError::NotFound(existing.0))?;
            return Ok(Placed {
                order,
                created: false,
            });
        };

        let product_ids: Vec<&str> = order.lines.iter().map(|l| l.product_id.as_str()).collect();
        let unknown: Vec<String> = sqlx::query_scalar(
            "SELECT u.product_id FROM unnest($1::text[]) WITH ORDINALITY AS u(product_id, n)
             WHERE NOT EXISTS (SELECT 1 FROM product p WHERE p.product_id = u.product_id)
             ORDER BY u.n",
        )
        .bind(&product_ids)
        .fetch_all(&mut *tx)
        .await?;
        if !unknown.is_empty() {
            // Dropping `tx` rolls back the order row and frees the idempotency key.
            return Err(OrderError::UnknownProducts(unknown));
        }
        let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
        let _ = sqlx::query(
            "INSERT INTO order_line (order_id, line_no, product_id, quantity)
             SELECT $1, u.n, u.product_id, u.quantity
             FROM unnest($2::text[], $3::int4[]) WITH ORDINALITY AS u(product_id, quantity, n)",
        )
        .bind(order_id)
        .bind(&product_ids)
        .bind(&quantities)
        .execute(&mut *tx)
        .await?;

        let placed = Order {
            order_id,
            customer_id: order.customer_id.clone(),
            email: order.email.clone(),
            status: pipeline_core::order_events::OrderStatus::Placed,
            lines: order.lines.clone(),
            created_at,
            updated_at,
        };
        let _ = self.record_event(&mut tx, &placed, traceparent).await?;
        tx.commit().await?;
        Ok(Placed {
            order: placed,
            created: true,
        })
    }
}
