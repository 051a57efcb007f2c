//! Paying, cancelling and shipping an order.

use uuid::Uuid;

use super::store::{fetch_order, parse_status};
use super::{Action, Order, OrderError, OrderService};

impl OrderService {
    /// Applies `action` to the order and records its event, in one transaction.
    ///
    /// The order row is locked first, so concurrent actions on one order are applied one after
    /// the other and each sees the status the previous one left: of two concurrent `pay` calls,
    /// exactly one succeeds.
    pub async fn transition(
        &self,
        order_id: Uuid,
        action: Action,
        traceparent: Option<&str>,
    ) -> Result<Order, OrderError> {
        let mut tx = self.pool.begin().await?;
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1 FOR UPDATE")
                .bind(order_id)
                .fetch_optional(&mut *tx)
                .await?;
        let status = status.ok_or(OrderError::NotFound(order_id))?;
        let target = action.apply(parse_status(&status)?)?;

        let _ = sqlx::query(
            "UPDATE orders SET status = $2, updated_at = clock_timestamp() WHERE order_id = $1",
        )
        .bind(order_id)
        .bind(target.as_str())
        .execute(&mut *tx)
        .await?;
        let order = fetch_order(&mut tx, order_id)
            .await?
            .ok_or(OrderError::NotFound(order_id))?;
        let _ = self.record_event(&mut tx, &order, traceparent).await?;
        tx.commit().await?;
        Ok(order)
    }
}
