//! Reading orders back: the SQL shared by placing, transitions and the API's reads.

use chrono::{DateTime, Utc};
use demo_events::order_events::{OrderLine, OrderStatus};
use sqlx::PgConnection;
use uuid::Uuid;

use super::error::OrderError;
use super::model::Order;

/// An order row with its lines' products and quantities, in line order.
pub(super) type OrderRow = (
    Uuid,
    String,
    Option<String>,
    String,
    DateTime<Utc>,
    DateTime<Utc>,
    Vec<String>,
    Vec<i32>,
);

/// Reads the order `order_id` with its lines, as `conn` sees it, in one round trip.
pub async fn fetch_order(
    conn: &mut PgConnection,
    order_id: Uuid,
) -> Result<Option<Order>, OrderError> {
    let row: Option<OrderRow> = sqlx::query_as(
        "SELECT o.order_id, o.customer_id, o.email, o.status, o.created_at, o.updated_at,
                COALESCE(l.products, '{}'), COALESCE(l.quantities, '{}')
         FROM orders o
         LEFT JOIN LATERAL (
             SELECT array_agg(product_id ORDER BY line_no) AS products,
                    array_agg(quantity ORDER BY line_no) AS quantities
             FROM order_line WHERE order_id = o.order_id) l ON true
         WHERE o.order_id = $1",
    )
    .bind(order_id)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(order_from_row).transpose()
}

/// The order an [`OrderRow`] holds.
pub(super) fn order_from_row(row: OrderRow) -> Result<Order, OrderError> {
    let (order_id, customer_id, email, status, created_at, updated_at, products, quantities) = row;
    Ok(Order {
        order_id,
        customer_id,
        email,
        status: parse_status(&status)?,
        lines: products
            .into_iter()
            .zip(quantities)
            .map(|(product_id, quantity)| OrderLine {
                product_id,
                quantity,
            })
            .collect(),
        created_at,
        updated_at,
        payment_reminder_at: None,
    })
}

/// Reads a status column, which the table's CHECK constraint keeps to the four known values.
pub(super) fn parse_status(status: &str) -> Result<OrderStatus, OrderError> {
    OrderStatus::parse(status).ok_or_else(|| OrderError::CorruptStatus(status.to_owned()))
}
