//! The inventory's reads and writes: the reservations and stock rows a transaction's events
//! touch, read in one statement; the stock rows locked again at its end; and every change written
//! in one statement.

use std::collections::BTreeMap;

use consumer::HandlerError;
use sqlx::PgConnection;

use super::{InventoryTransaction, Reservation, Stock};

impl InventoryTransaction {
    /// Reads the stock rows of `products` not read yet.
    pub(super) async fn load_stock(
        &mut self,
        conn: &mut PgConnection,
        products: Vec<String>,
    ) -> Result<(), HandlerError> {
        self.load(conn, Vec::new(), products).await
    }

    /// Locks and reads the reservations (with lines) of `orders` not read yet, and reads the
    /// stock rows of their lines.
    pub(super) async fn load_reservations(
        &mut self,
        conn: &mut PgConnection,
        orders: Vec<String>,
    ) -> Result<(), HandlerError> {
        self.load(conn, orders, Vec::new()).await
    }

    /// Reads, in one statement, the reservations (with lines) of `orders`, locked in key order,
    /// and the stock rows of `products` and of those reservations' lines, not locked, skipping
    /// what the transaction read already.
    pub(super) async fn load(
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
            // it over the join, and would read the whole line table in every transaction.
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

    /// Locks, in key order, the stock rows the transaction's decisions read, and reads them again.
    /// A row another transaction changed since this one read it means the decisions were made on
    /// old values: they are made again, in the same order, from the reservations as read and the
    /// locked stock. Held until commit, the locks make the written values final.
    pub(super) async fn lock_stock(&mut self, conn: &mut PgConnection) -> Result<(), HandlerError> {
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
    pub(super) async fn write(&self, conn: &mut PgConnection) -> Result<(), HandlerError> {
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

/// A row of [`InventoryTransaction::load`]: a reservation joined with one of its lines (none for a
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
