//! The inventory group: reserves stock when an order is placed, releases it when the order is
//! cancelled, and settles it when the order ships. Insufficient stock is a business outcome (the
//! reservation is rejected), not an error.
//!
//! A batch locks the reservations its events touch (in key order) and reads the stock rows without
//! locking them, keeps both in memory while deciding each event, and locks the stock rows only at
//! the end, in the statement before the write (see `InventoryBatch::lock_stock`): stock rows are
//! shared by every order, so a lock taken at the start of the transaction made the group's
//! concurrent transactions run one after the other. When another transaction changed a stock row
//! in between, the batch's decisions are made again, in the same order, on the locked values, so
//! the outcome is the one the batch would have had holding the lock from the start.

use std::collections::{BTreeMap, BTreeSet};

use futures::future::BoxFuture;
use pipeline_core::order_events::{
    OrderSnapshot, ORDER_CANCELLED, ORDER_PAID, ORDER_PLACED, ORDER_SHIPPED,
};
use sqlx::PgConnection;

use crate::handler::{order_snapshot, Event, Handler, HandlerBatch, HandlerError};

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

    fn batch(&self) -> Box<dyn HandlerBatch + '_> {
        Box::<InventoryBatch>::default()
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
    /// Lines not yet written (a reservation made by this batch).
    new_lines: bool,
}

/// A decision the batch made, kept so that it can be made again on other stock values.
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

/// One batch's view of the stock and reservations it touches.
#[derive(Default)]
struct InventoryBatch {
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

impl HandlerBatch for InventoryBatch {
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
            // With the products of the reservations the batch may release or settle.
            self.load(conn, orders, products).await
        })
    }

    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
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
                ORDER_PAID => Ok(()),
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

impl InventoryBatch {
    /// Reads the stock rows of `products` not read yet.
    async fn load_stock(
        &mut self,
        conn: &mut PgConnection,
        products: Vec<String>,
    ) -> Result<(), HandlerError> {
        self.load(conn, Vec::new(), products).await
    }

    /// Locks and reads the reservations (with lines) of `orders` not read yet, and reads the
    /// stock rows of their lines.
    async fn load_reservations(
        &mut self,
        conn: &mut PgConnection,
        orders: Vec<String>,
    ) -> Result<(), HandlerError> {
        self.load(conn, orders, Vec::new()).await
    }

    /// Reads, in one statement, the reservations (with lines) of `orders`, locked in key order,
    /// and the stock rows of `products` and of those reservations' lines, not locked, skipping
    /// what the batch read already.
    async fn load(
        &mut self,
        conn: &mut PgConnection,
        mut orders: Vec<String>,
        mut products: Vec<String>,
    ) -> Result<(), HandlerError> {
        orders.retain(|o| !self.reservations.contains_key(o));
        orders.sort();
        orders.dedup();
        products.retain(|p| !self.stock.contains_key(p));
        products.sort();
        products.dedup();
        if orders.is_empty() && products.is_empty() {
            return Ok(());
        }
        let read: Vec<&str> = self.stock.keys().map(String::as_str).collect();
        let rows: Vec<LoadRow> = sqlx::query_as(
            // The lines' own `= ANY` lets their primary key find them: the planner does not carry
            // it over the join (seen: every batch reading the whole line table).
            "WITH r AS (
                 SELECT order_id, status, reason FROM inventory_reservation
                 WHERE order_id = ANY($1) ORDER BY order_id FOR UPDATE),
             l AS (
                 SELECT order_id, product_id, quantity FROM inventory_reservation_line
                 WHERE order_id = ANY($1)),
             s AS (
                 SELECT product_id, available, reserved FROM inventory_stock
                 WHERE product_id = ANY(ARRAY(
                           SELECT unnest($2::text[])
                           UNION SELECT product_id FROM l WHERE product_id <> ALL($3))))
             SELECT true, r.order_id, r.status, r.reason, l.product_id, l.quantity, NULL::int
             FROM r LEFT JOIN l ON l.order_id = r.order_id
             UNION ALL
             SELECT false, product_id, NULL, NULL, NULL, available, reserved FROM s",
        )
        .bind(&orders)
        .bind(&products)
        .bind(&read)
        .fetch_all(&mut *conn)
        .await?;
        for o in orders {
            let _ = self.reservations.insert(o, None);
        }
        for p in products {
            let _ = self.stock.insert(p, None);
        }
        for (is_reservation, key, status, reason, product, quantity, reserved) in rows {
            if !is_reservation {
                let (Some(available), Some(reserved)) = (quantity, reserved) else {
                    continue;
                };
                let _ = self.stock.insert(
                    key,
                    Some(Stock {
                        available,
                        reserved,
                    }),
                );
                continue;
            }
            let entry = self.reservations.entry(key).or_insert(None);
            let r = entry.get_or_insert_with(|| Reservation {
                status: status_name(status.as_deref().unwrap_or_default()),
                reason,
                lines: BTreeMap::new(),
                new_lines: false,
            });
            if let (Some(p), Some(q)) = (product, quantity) {
                let _ = r.lines.insert(p, q);
            }
        }
        // What was just read, before any decision touches it.
        for (k, v) in &self.stock {
            if !self.stock_read.contains_key(k) {
                let _ = self.stock_read.insert(k.clone(), *v);
            }
        }
        for (k, v) in &self.reservations {
            if !self.reservations_read.contains_key(k) {
                let _ = self.reservations_read.insert(k.clone(), v.clone());
            }
        }
        Ok(())
    }

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

    /// Makes `decision` on the batch's view (everything it needs is read) and remembers it.
    fn decide(&mut self, decision: Decision) {
        match &decision {
            Decision::Reserve { order_id, wanted } => self.reserve(order_id, wanted),
            Decision::Close { order_id, to } => self.close_reservation(order_id, to),
        }
        self.decisions.push(decision);
    }

    /// Reserves `wanted` for `order_id` when every product has enough available, and otherwise
    /// records the reservation as rejected with what was short.
    fn reserve(&mut self, order_id: &str, wanted: &BTreeMap<String, i32>) {
        let short: Vec<String> = wanted
            .iter()
            .filter_map(|(p, q)| {
                let have = self
                    .stock
                    .get(p)
                    .copied()
                    .flatten()
                    .map(|s| s.available)
                    .unwrap_or(0);
                (have < *q).then(|| format!("{p} (wanted {q}, available {have})"))
            })
            .collect();
        let reservation = if short.is_empty() {
            for (p, q) in wanted {
                if let Some(Some(s)) = self.stock.get_mut(p) {
                    s.available -= q;
                    s.reserved += q;
                    let _ = self.changed_stock.insert(p.clone());
                }
            }
            Reservation {
                status: "reserved",
                reason: None,
                lines: wanted.clone(),
                new_lines: true,
            }
        } else {
            let reason = Some(format!("insufficient stock: {}", short.join(", ")));
            Reservation {
                status: "rejected",
                reason,
                lines: BTreeMap::new(),
                new_lines: false,
            }
        };
        let _ = self
            .reservations
            .insert(order_id.to_owned(), Some(reservation));
        let _ = self.changed_reservations.insert(order_id.to_owned());
    }

    /// Moves a `reserved` reservation to `to`, returning its stock: to available when released,
    /// out of the warehouse when fulfilled. Anything else (rejected, none) changes nothing.
    fn close_reservation(&mut self, order_id: &str, to: &'static str) {
        let lines = match self.reservations.get(order_id) {
            Some(Some(r)) if r.status == "reserved" => r.lines.clone(),
            _ => return,
        };
        for (p, q) in &lines {
            if let Some(Some(s)) = self.stock.get_mut(p) {
                s.reserved -= q;
                if to == "released" {
                    s.available += q;
                }
                let _ = self.changed_stock.insert(p.clone());
            }
        }
        if let Some(Some(r)) = self.reservations.get_mut(order_id) {
            r.status = to;
        }
        let _ = self.changed_reservations.insert(order_id.to_owned());
    }

    /// Locks, in key order, the stock rows the batch's decisions read, and reads them again. A row
    /// another transaction changed since the batch read it means the decisions were made on old
    /// values: they are made again, in the same order, from the reservations as read and the
    /// locked stock. Held until commit, the locks make the written values final.
    async fn lock_stock(&mut self, conn: &mut PgConnection) -> Result<(), HandlerError> {
        if self.decisions.is_empty() {
            return Ok(());
        }
        let products: Vec<&str> = self.stock.keys().map(String::as_str).collect();
        let rows: Vec<(String, i32, i32)> = sqlx::query_as(
            "SELECT product_id, available, reserved FROM inventory_stock
             WHERE product_id = ANY($1) ORDER BY product_id FOR UPDATE",
        )
        .bind(&products)
        .fetch_all(&mut *conn)
        .await?;
        let mut locked: BTreeMap<String, Option<Stock>> =
            self.stock.keys().map(|p| (p.clone(), None)).collect();
        for (p, available, reserved) in rows {
            let _ = locked.insert(
                p,
                Some(Stock {
                    available,
                    reserved,
                }),
            );
        }
        if locked == self.stock_read {
            return Ok(());
        }
        self.stock = locked;
        self.reservations = self.reservations_read.clone();
        self.changed_stock.clear();
        self.changed_reservations.clear();
        for decision in std::mem::take(&mut self.decisions) {
            self.decide(decision);
        }
        Ok(())
    }

    /// Writes the changed stock rows, reservations and new reservation lines in one statement.
    async fn write(&self, conn: &mut PgConnection) -> Result<(), HandlerError> {
        let (mut products, mut available, mut reserved) = (Vec::new(), Vec::new(), Vec::new());
        for p in &self.changed_stock {
            if let Some(Some(s)) = self.stock.get(p) {
                products.push(p.as_str());
                available.push(s.available);
                reserved.push(s.reserved);
            }
        }
        let (mut orders, mut statuses, mut reasons) = (Vec::new(), Vec::new(), Vec::new());
        let (mut line_orders, mut line_products, mut line_qty) =
            (Vec::new(), Vec::new(), Vec::new());
        for o in &self.changed_reservations {
            if let Some(Some(r)) = self.reservations.get(o) {
                orders.push(o.as_str());
                statuses.push(r.status);
                reasons.push(r.reason.as_deref());
                if r.new_lines {
                    for (p, q) in &r.lines {
                        line_orders.push(o.as_str());
                        line_products.push(p.as_str());
                        line_qty.push(*q);
                    }
                }
            }
        }
        if products.is_empty() && orders.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "WITH stock AS (
                 UPDATE inventory_stock s SET available = u.available, reserved = u.reserved
                 FROM unnest($1::text[], $2::int[], $3::int[]) AS u(product_id, available, reserved)
                 WHERE s.product_id = u.product_id),
             reservations AS (
                 INSERT INTO inventory_reservation (order_id, status, reason)
                 SELECT * FROM unnest($4::text[], $5::text[], $6::text[])
                 ON CONFLICT (order_id) DO UPDATE
                 SET status = EXCLUDED.status, reason = EXCLUDED.reason,
                     updated_at = clock_timestamp())
             INSERT INTO inventory_reservation_line (order_id, product_id, quantity)
             SELECT * FROM unnest($7::text[], $8::text[], $9::int[])",
        )
        .bind(&products)
        .bind(&available)
        .bind(&reserved)
        .bind(&orders)
        .bind(&statuses)
        .bind(&reasons)
        .bind(&line_orders)
        .bind(&line_products)
        .bind(&line_qty)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// A row of [`InventoryBatch::load`]: a reservation joined with one of its lines (none for a
/// rejected reservation): `(true, order, status, reason, product, quantity, None)`; or a stock
/// row: `(false, product, None, None, None, available, reserved)`.
type LoadRow = (
    bool,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i32>,
    Option<i32>,
);

fn status_name(s: &str) -> &'static str {
    match s {
        "reserved" => "reserved",
        "released" => "released",
        "fulfilled" => "fulfilled",
        _ => "rejected",
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
