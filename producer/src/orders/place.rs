//! Placing an order, idempotently when the client sends an `Idempotency-Key`.

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::store::fetch_order;
use super::{Order, OrderError, OrderService};
use crate::validation::ValidOrder;

type PlaceRow = (Option<DateTime<Utc>>, Option<DateTime<Utc>>, Vec<String>);

/// The result of [`OrderService::place`].
#[derive(Debug, Clone)]
pub struct Placed {
    pub order: Order,
    /// False when the idempotency key named an order placed earlier by the same request: that
    /// order is returned and nothing was written.
    pub created: bool,
}

impl OrderService {
    /// Places `order` inside `tx`: the order row and its lines. The caller records the event
    /// (when `created`) and commits.
    pub(super) async fn place_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        order: &ValidOrder,
        idempotency_key: Option<&str>,
    ) -> Result<Placed, OrderError> {
        let fingerprint = idempotency_key.map(|_| order.fingerprint());
        let order_id = Uuid::now_v7();

        let product_ids: Vec<&str> = order.lines.iter().map(|l| l.product_id.as_str()).collect();
        let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
        // One round trip: the order and its lines are written only when every product exists;
        // otherwise the unknown ones come back and nothing is written.
        let (created_at, updated_at, unknown): PlaceRow = sqlx::query_as(
            "WITH unknown AS (
                 SELECT u.product_id, u.n FROM unnest($6::text[]) WITH ORDINALITY AS u(product_id, n)
                 WHERE NOT EXISTS (SELECT 1 FROM product p WHERE p.product_id = u.product_id)),
             placed AS (
                 INSERT INTO orders (order_id, customer_id, email, status, idempotency_key,
                                     request_hash)
                 SELECT $1, $2, $3, 'placed', $4, $5 WHERE NOT EXISTS (SELECT 1 FROM unknown)
                 ON CONFLICT (idempotency_key) DO NOTHING
                 RETURNING created_at, updated_at),
             lines AS (
                 INSERT INTO order_line (order_id, line_no, product_id, quantity)
                 SELECT $1, u.n, u.product_id, u.quantity
                 FROM unnest($6::text[], $7::int4[]) WITH ORDINALITY AS u(product_id, quantity, n)
                 WHERE EXISTS (SELECT 1 FROM placed))
             SELECT (SELECT created_at FROM placed), (SELECT updated_at FROM placed),
                    ARRAY(SELECT product_id FROM unknown ORDER BY n)",
        )
        .bind(order_id)
        .bind(&order.customer_id)
        .bind(&order.email)
        .bind(idempotency_key)
        .bind(&fingerprint)
        .bind(&product_ids)
        .bind(&quantities)
        .fetch_one(&mut **tx)
        .await?;

        let (Some(created_at), Some(updated_at)) = (created_at, updated_at) else {
            // Not written: the key is taken (only a non-null key can conflict), or a product is
            // unknown. Read committed: this statement sees the row a conflicting transaction
            // committed.
            let existing: Option<(Uuid, Option<String>)> = match idempotency_key {
                Some(key) => {
                    sqlx::query_as(
                        "SELECT order_id, request_hash FROM orders WHERE idempotency_key = $1",
                    )
                    .bind(key)
                    .fetch_optional(&mut **tx)
                    .await?
                }
                None => None,
            };
            let Some((existing_id, existing_hash)) = existing else {
                // Nothing was written.
                return Err(OrderError::UnknownProducts(unknown));
            };
            if existing_hash != fingerprint {
                return Err(OrderError::IdempotencyKeyReused);
            }
            let order = fetch_order(tx, existing_id)
                .await?
                .ok_or(OrderError::NotFound(existing_id))?;
            return Ok(Placed {
                order,
                created: false,
            });
        };

        let placed = Order {
            order_id,
            customer_id: order.customer_id.clone(),
            email: order.email.clone(),
            status: pipeline_core::order_events::OrderStatus::Placed,
            lines: order.lines.clone(),
            created_at,
            updated_at,
        };
        Ok(Placed {
            order: placed,
            created: true,
        })
    }
}
