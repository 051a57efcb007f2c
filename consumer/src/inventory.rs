//! The inventory group: reserves stock when an order is placed, releases it when the order is
//! cancelled, and settles it when the order ships. Insufficient stock is a business outcome (the
//! reservation is rejected), not an error.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use pipeline_core::order_events::{
    OrderSnapshot, ORDER_CANCELLED, ORDER_PAID, ORDER_PLACED, ORDER_SHIPPED,
};
use sqlx::PgConnection;

use crate::handler::{order_snapshot, Event, Handler, HandlerError};

/// The inventory handler.
pub struct Inventory {
    group: String,
}

impl Inventory {
    pub fn new(group: impl Into<String>) -> Self {
        Inventory {
            group: group.into(),
        }
    }
}

impl Handler for Inventory {
    fn group(&self) -> &str {
        &self.group
    }

    fn prepare<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            // Lock every stock row the batch may touch, in product order, before changing any.
            let mut products: Vec<String> = events
                .iter()
                .filter_map(|e| order_snapshot(e).ok())
                .flat_map(|s| s.lines.into_iter().map(|l| l.product_id))
                .collect();
            products.sort();
            products.dedup();
            if !products.is_empty() {
                sqlx::query(
                    "SELECT 1 FROM inventory_stock WHERE product_id = ANY($1)
                     ORDER BY product_id FOR UPDATE",
                )
                .bind(&products)
                .execute(&mut *conn)
                .await?;
            }
            Ok(())
        })
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let order = order_snapshot(event)?;
            match event.envelope.event_type.as_str() {
                ORDER_PLACED => reserve(conn, &order).await,
                ORDER_CANCELLED => release(conn, &order).await,
                ORDER_SHIPPED => fulfil(conn, &order).await,
                ORDER_PAID => Ok(()),
                other => Err(HandlerError::Rejected(format!(
                    "unknown event type `{other}`"
                ))),
            }
        })
    }
}

fn quantities(order: &OrderSnapshot) -> Result<BTreeMap<String, i32>, HandlerError> {
    let mut wanted: BTreeMap<String, i32> = BTreeMap::new();
    for line in &order.lines {
        if line.quantity <= 0 {
            return Err(HandlerError::Rejected(format!(
                "line for {} has quantity {}",
                line.product_id, line.quantity
            )));
        }
        let q = wanted.entry(line.product_id.clone()).or_insert(0);
        *q = q.checked_add(line.quantity).ok_or_else(|| {
            HandlerError::Rejected(format!("quantity of {} overflows", line.product_id))
        })?;
    }
    Ok(wanted)
}

async fn reserve(conn: &mut PgConnection, order: &OrderSnapshot) -> Result<(), HandlerError> {
    let order_id = order.order_id.to_string();
    let wanted = quantities(order)?;
    let products: Vec<String> = wanted.keys().cloned().collect();
    let available: Vec<(String, i32)> = sqlx::query_as(
        "SELECT product_id, available FROM inventory_stock WHERE product_id = ANY($1)
         ORDER BY product_id FOR UPDATE",
    )
    .bind(&products)
    .fetch_all(&mut *conn)
    .await?;
    let available: BTreeMap<String, i32> = available.into_iter().collect();
    let short: Vec<String> = wanted
        .iter()
        .filter(|(p, q)| available.get(*p).copied().unwrap_or(0) < **q)
        .map(|(p, q)| {
            format!(
                "{p} (wanted {q}, available {})",
                available.get(p).copied().unwrap_or(0)
            )
        })
        .collect();
    let (status, reason) = if short.is_empty() {
        ("reserved", None)
    } else {
        (
            "rejected",
            Some(format!("insufficient stock: {}", short.join(", "))),
        )
    };
    let recorded = sqlx::query(
        "INSERT INTO inventory_reservation (order_id, status, reason) VALUES ($1, $2, $3)
         ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(&order_id)
    .bind(status)
    .bind(&reason)
    .execute(&mut *conn)
    .await?;
    if recorded.rows_affected() == 0 {
        return Err(HandlerError::Rejected(format!(
            "order {order_id} already has a reservation"
        )));
    }
    if reason.is_some() {
        return Ok(());
    }
    let qty: Vec<i32> = wanted.values().copied().collect();
    sqlx::query(
        "UPDATE inventory_stock s SET available = s.available - w.qty, reserved = s.reserved + w.qty
         FROM unnest($1::text[], $2::int[]) AS w(product_id, qty) WHERE s.product_id = w.product_id",
    )
    .bind(&products)
    .bind(&qty)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO inventory_reservation_line (order_id, product_id, quantity)
         SELECT $1, * FROM unnest($2::text[], $3::int[])",
    )
    .bind(&order_id)
    .bind(&products)
    .bind(&qty)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Moves a reservation from `reserved` to `to`, returning its lines; none when not reserved.
async fn close_reservation(
    conn: &mut PgConnection,
    order_id: &str,
    to: &str,
) -> Result<Vec<(String, i32)>, HandlerError> {
    let changed = sqlx::query(
        "UPDATE inventory_reservation SET status = $2, updated_at = clock_timestamp()
         WHERE order_id = $1 AND status = 'reserved'",
    )
    .bind(order_id)
    .bind(to)
    .execute(&mut *conn)
    .await?;
    if changed.rows_affected() == 0 {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_as(
        "SELECT product_id, quantity FROM inventory_reservation_line WHERE order_id = $1
         ORDER BY product_id",
    )
    .bind(order_id)
    .fetch_all(&mut *conn)
    .await?)
}

async fn release(conn: &mut PgConnection, order: &OrderSnapshot) -> Result<(), HandlerError> {
    let lines = close_reservation(conn, &order.order_id.to_string(), "released").await?;
    let (products, qty): (Vec<String>, Vec<i32>) = lines.into_iter().unzip();
    sqlx::query(
        "UPDATE inventory_stock s SET available = s.available + w.qty, reserved = s.reserved - w.qty
         FROM unnest($1::text[], $2::int[]) AS w(product_id, qty) WHERE s.product_id = w.product_id",
    )
    .bind(&products)
    .bind(&qty)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn fulfil(conn: &mut PgConnection, order: &OrderSnapshot) -> Result<(), HandlerError> {
    let lines = close_reservation(conn, &order.order_id.to_string(), "fulfilled").await?;
    let (products, qty): (Vec<String>, Vec<i32>) = lines.into_iter().unzip();
    sqlx::query(
        "UPDATE inventory_stock s SET reserved = s.reserved - w.qty
         FROM unnest($1::text[], $2::int[]) AS w(product_id, qty) WHERE s.product_id = w.product_id",
    )
    .bind(&products)
    .bind(&qty)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
