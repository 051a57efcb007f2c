//! Paying, cancelling and shipping an order.

use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use pipeline_core::order_events::OrderStatus;

use super::store::{order_from_row, parse_status, OrderRow};
use super::{Action, IllegalTransition, Order, OrderError, OrderService};

impl OrderService {
    /// Applies `action` to the order inside `tx`. The caller records the event and commits.
    pub(super) async fn transition_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        order_id: Uuid,
        action: Action,
    ) -> Result<Order, OrderError> {
        use OrderStatus::{Cancelled, Paid, Placed, Shipped};
        // The statuses this action may leave, as the lifecycle says.
        let from: Vec<&str> = [Placed, Paid, Cancelled, Shipped]
            .into_iter()
            .filter(|s| action.apply(*s).is_ok())
            .map(OrderStatus::as_str)
            .collect();
        // One round trip for the change and the order with its lines.
        let changed: Option<OrderRow> = sqlx::query_as(
            "UPDATE orders o SET status = $2, updated_at = clock_timestamp()
             WHERE o.order_id = $1 AND o.status = ANY($3)
             RETURNING o.order_id, o.customer_id, o.email, o.status, o.created_at, o.updated_at,
                       (SELECT COALESCE(array_agg(product_id ORDER BY line_no), '{}')
                        FROM order_line WHERE order_id = $1),
                       (SELECT COALESCE(array_agg(quantity ORDER BY line_no), '{}')
                        FROM order_line WHERE order_id = $1)",
        )
        .bind(order_id)
        .bind(action.target().as_str())
        .bind(&from)
        .fetch_optional(&mut **tx)
        .await?;
        let Some(row) = changed else {
            let status: Option<String> =
                sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1")
                    .bind(order_id)
                    .fetch_optional(&mut **tx)
                    .await?;
            let status = status.ok_or(OrderError::NotFound(order_id))?;
            // The lifecycle only moves forward: the status the UPDATE did not accept, or a
            // later one, is the reason.
            return Err(OrderError::IllegalTransition(IllegalTransition {
                action,
                status: parse_status(&status)?,
            }));
        };
        order_from_row(row)
    }
}
