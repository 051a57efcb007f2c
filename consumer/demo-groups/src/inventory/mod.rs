//! The inventory group: reserves stock when an order is placed, releases it when the order is
//! cancelled, and settles it when the order ships. Insufficient stock is a business outcome (the
//! reservation is rejected), not an error.
//!
//! A transaction locks the reservations its events touch (in key order) and reads the stock rows
//! without locking them, keeps both in memory while deciding each event (`decide`), and locks the
//! stock rows only at the end, in the statement before the write (`rows`): stock rows are shared
//! by every order, so a lock taken at the start of the transaction would make the group's
//! concurrent transactions run one after the other. When another transaction changed a stock row
//! in between, the transaction's decisions are made again, in the same order, on the locked
//! values, so the outcome is the one it would have had holding the lock from the start.

mod decide;
mod rows;

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context;
use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use demo_events::order_events::{
    demo_product_id, OrderSnapshot, DAILY_DIGEST, ORDER_CANCELLED, ORDER_PAID,
    ORDER_PAYMENT_REMINDER, ORDER_PLACED, ORDER_SHIPPED,
};
use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool};

use crate::order::order_snapshot;
use decide::quantities;

/// The inventory handler.
pub struct Inventory {
    group: String,
}

impl Inventory {
    /// The handler of the inventory group with id `group` (its dedupe scope).
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

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::<InventoryTransaction>::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stock {
    available: i32,
    reserved: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Reservation {
    status: &'static str,
    reason: Option<String>,
    lines: BTreeMap<String, i32>,
    /// Lines not yet written (a reservation made by this transaction).
    new_lines: bool,
}

/// A decision the transaction made, kept so that it can be made again on other stock values.
#[derive(Debug, Clone)]
enum Decision {
    /// Reserve these quantities for the order, or reject the reservation when stock is short.
    Reserve {
        order_id: String,
        wanted: BTreeMap<String, i32>,
    },
    /// Move the order's reservation, if `reserved`, to `to`, returning its stock.
    Close { order_id: String, to: &'static str },
}

/// One transaction's view of the stock and reservations it touches.
#[derive(Default)]
struct InventoryTransaction {
    /// Stock rows as decided so far; a product without a row has no stock.
    stock: BTreeMap<String, Option<Stock>>,
    /// Stock rows as read (not locked) before any decision.
    stock_read: BTreeMap<String, Option<Stock>>,
    /// Locked reservations as decided so far; `None`: the order has none.
    reservations: BTreeMap<String, Option<Reservation>>,
    /// Reservations as read (and locked) before any decision.
    reservations_read: BTreeMap<String, Option<Reservation>>,
    changed_stock: BTreeSet<String>,
    changed_reservations: BTreeSet<String>,
    /// Every decision made, in order.
    decisions: Vec<Decision>,
}

impl HandlerTransaction for InventoryTransaction {
    fn prepare<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let snapshots: Vec<OrderSnapshot> = events
                .iter()
                .filter_map(|e| order_snapshot(e).ok())
                .collect();
            let orders: Vec<String> = snapshots.iter().map(|s| s.order_id.to_string()).collect();
            let products: Vec<String> = snapshots
                .iter()
                .flat_map(|s| s.lines.iter().map(|l| l.product_id.clone()))
                .collect();
            // With the products of the reservations the transaction may release or settle.
            self.load(conn, orders, products).await
        })
    }

    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            // The digest names no order: nothing for the stock.
            if event.envelope.event_type == DAILY_DIGEST {
                return Ok(());
            }
            let order = order_snapshot(event)?;
            let order_id = order.order_id.to_string();
            match event.envelope.event_type.as_str() {
                ORDER_PLACED => {
                    let wanted = quantities(&order)?;
                    self.load_reservations(conn, vec![order_id.clone()]).await?;
                    if matches!(self.reservations.get(&order_id), Some(Some(_))) {
                        return Err(HandlerError::Rejected(format!(
                            "order {order_id} already has a reservation"
                        )));
                    }
                    self.load_stock(conn, wanted.keys().cloned().collect())
                        .await?;
                    self.decide(Decision::Reserve { order_id, wanted });
                    Ok(())
                }
                ORDER_CANCELLED => self.close(conn, order_id, "released").await,
                ORDER_SHIPPED => self.close(conn, order_id, "fulfilled").await,
                // Stock moves only when an order is placed, cancelled or shipped.
                ORDER_PAID | ORDER_PAYMENT_REMINDER => Ok(()),
                other => Err(HandlerError::Rejected(format!(
                    "unknown event type `{other}`"
                ))),
            }
        })
    }

    fn flush<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.lock_stock(conn).await?;
            self.write(conn).await
        })
    }
}

impl InventoryTransaction {
    /// Reads what closing `order_id`'s reservation needs, then decides it.
    async fn close(
        &mut self,
        conn: &mut PgConnection,
        order_id: String,
        to: &'static str,
    ) -> Result<(), HandlerError> {
        self.load_reservations(conn, vec![order_id.clone()]).await?;
        if let Some(Some(r)) = self.reservations.get(&order_id) {
            if r.status == "reserved" {
                let products = r.lines.keys().cloned().collect();
                self.load_stock(conn, products).await?;
            }
        }
        self.decide(Decision::Close { order_id, to });
        Ok(())
    }
}

/// Sets the available stock of products 1..=`products` of the demonstration catalogue.
pub async fn seed_stock(pool: &PgPool, products: u32, quantity: i32) -> anyhow::Result<()> {
    let ids: Vec<String> = (1..=products).map(demo_product_id).collect();
    sqlx::query(
        "INSERT INTO inventory_stock (product_id, available)
         SELECT p, $2 FROM unnest($1::text[]) AS p
         ON CONFLICT (product_id) DO UPDATE SET available = EXCLUDED.available",
    )
    .bind(&ids)
    .bind(quantity)
    .execute(pool)
    .await
    .context("seeding stock")?;
    Ok(())
}
