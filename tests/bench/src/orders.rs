//! The orders the benchmark moves through the pipeline, shaped like the order service's own.
//!
//! Order `g` has 1 to 3 lines of distinct products and goes placed → paid → shipped (every tenth
//! order: cancelled instead of shipped): three events, sequences 1..3. The same shape is built in
//! Rust (the plain producer's messages, the load generator's orders) and in SQL (the preloaded
//! outbox), so every phase moves the same events.

use std::io;

use chrono::Utc;
use demo_events::order_events::{demo_product_id, OrderLine, OrderSnapshot, OrderStatus};
use pipeline_core::envelope::Envelope;
use pipeline_load::api::OrderRequest;
use pipeline_load::{Fate, OrderPlan};
use rdkafka::message::{Headers, OwnedHeaders};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

/// Events per order.
pub const EVENTS_PER_ORDER: i64 = 3;
/// Orders whose events are interleaved: the placed events of `WINDOW` orders, then their paid
/// events, then the last ones, as when orders are paid and shipped a while after being placed.
const WINDOW: u64 = 1_000;
/// Distinct customers.
const CUSTOMERS: u64 = 1_000;

/// The lines of order `g` over products 1..=`products` (at least 3, so they are distinct).
pub fn lines(g: u64, products: u32) -> Vec<OrderLine> {
    let products = u64::from(products.max(3));
    (0..=g % 3)
        .map(|l| OrderLine {
            // Below `products`, itself a u32.
            product_id: demo_product_id(u32::try_from((g * 31 + l) % products + 1).unwrap_or(1)),
            quantity: i32::try_from(1 + (g + l) % 3).unwrap_or(1),
        })
        .collect()
}

fn customer(g: u64) -> (String, Option<String>) {
    let id = format!("customer-{}", g % CUSTOMERS + 1);
    let email = g.is_multiple_of(2).then(|| format!("{id}@example.com"));
    (id, email)
}

/// The status order `g` has after its event number `sequence` (1-based).
pub fn status_after(g: u64, sequence: i64) -> OrderStatus {
    match sequence {
        1 => OrderStatus::Placed,
        2 => OrderStatus::Paid,
        _ if g % 10 == 9 => OrderStatus::Cancelled,
        _ => OrderStatus::Shipped,
    }
}

/// The payload of order `g`'s event number `sequence`.
pub fn snapshot(order_id: Uuid, g: u64, sequence: i64, products: u32) -> OrderSnapshot {
    let (customer_id, email) = customer(g);
    OrderSnapshot {
        order_id,
        customer_id,
        email,
        status: status_after(g, sequence),
        lines: lines(g, products),
    }
}

/// Order `g` for the load generator: its `POST /orders` body, then paid and shipped (every
/// tenth: cancelled).
pub fn order_plan(g: u64, products: u32) -> OrderPlan {
    let (customer_id, email) = customer(g);
    OrderPlan {
        index: g,
        request: OrderRequest {
            customer_id,
            email,
            lines: lines(g, products),
        },
        fate: if g % 10 == 9 {
            Fate::PayCancel
        } else {
            Fate::PayShip
        },
    }
}

/// (order, sequence) of every event of `orders` orders, in the order the outbox holds them.
pub fn backlog_order(orders: u64) -> impl Iterator<Item = (u64, i64)> {
    (0..orders.div_ceil(WINDOW)).flat_map(move |block| {
        let (lo, hi) = (block * WINDOW, ((block + 1) * WINDOW).min(orders));
        (1..=EVENTS_PER_ORDER).flat_map(move |seq| (lo..hi).map(move |g| (g, seq)))
    })
}

/// One event as the relay would produce it.
#[derive(Clone)]
pub struct EventMessage {
    pub key: String,
    pub payload: String,
    pub headers: OwnedHeaders,
}

impl EventMessage {
    /// Order `g`'s event number `sequence`: the payload as PostgreSQL prints the jsonb column
    /// (what the relay sends), the envelope headers as the relay writes them.
    pub fn new(order_id: Uuid, g: u64, sequence: i64, products: u32) -> EventMessage {
        let snapshot = snapshot(order_id, g, sequence, products);
        let envelope = Envelope {
            event_id: Uuid::now_v7(),
            event_type: snapshot.status.event_type().to_owned(),
            aggregate_id: order_id.to_string(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        };
        EventMessage {
            key: envelope.aggregate_id.clone(),
            payload: jsonb_text(&snapshot),
            headers: envelope.to_headers(&[]),
        }
    }

    /// Bytes of key, payload and header names and values.
    pub fn size(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
            .sum();
        self.key.len() + self.payload.len() + headers
    }
}

/// JSON spaced the way PostgreSQL prints jsonb (`{"a": 1, "b": [1, 2]}`): the same size as the
/// relay's `payload::text` (jsonb orders keys differently, which does not change the size).
pub fn jsonb_text<T: Serialize>(value: &T) -> String {
    let mut out = Vec::with_capacity(256);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, JsonbSpacing);
    // Serialising plain data into a Vec cannot fail.
    if value.serialize(&mut ser).is_err() {
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

struct JsonbSpacing;

impl serde_json::ser::Formatter for JsonbSpacing {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_array_value(w, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// Orders of the preloaded backlog, their events in [`backlog_order`]; the SQL twin of
/// [`snapshot`]. `$1` orders, `$2` products, `$3` topic, `$4` window.
const PRELOAD_SQL: &str = "
WITH o AS (
    SELECT g, gen_random_uuid() AS order_id,
           'customer-' || (g % 1000 + 1) AS customer_id,
           CASE WHEN g % 2 = 0 THEN 'customer-' || (g % 1000 + 1) || '@example.com' END AS email,
           (SELECT jsonb_agg(jsonb_build_object(
                       'product_id', 'sku-' || lpad(((g * 31 + l) % $2 + 1)::text, 5, '0'),
                       'quantity', 1 + (g + l) % 3) ORDER BY l)
            FROM generate_series(0, g % 3) AS l) AS lines
    FROM generate_series(0::bigint, $1 - 1) AS g
), e AS (
    SELECT o.*, s.seq,
           CASE WHEN s.seq = 1 THEN 'placed' WHEN s.seq = 2 THEN 'paid'
                WHEN o.g % 10 = 9 THEN 'cancelled' ELSE 'shipped' END AS status
    FROM o CROSS JOIN generate_series(1, 3) AS s(seq)
)
INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
SELECT gen_random_uuid(), e.order_id::text, 'order.' || e.status, e.order_id::text, e.seq, $3,
       jsonb_strip_nulls(jsonb_build_object('order_id', e.order_id, 'customer_id', e.customer_id,
                                            'email', e.email, 'status', e.status, 'lines', e.lines))
FROM e
ORDER BY e.g / $4, e.seq, e.g";

/// Writes `orders` orders' events into the outbox as pending, with their sequence rows, and
/// refreshes the planner's statistics (as autovacuum would soon after such a burst). Returns the
/// number of events. Given an open transaction, the backlog appears at once when it commits.
pub async fn preload_outbox(
    conn: &mut PgConnection,
    topic: &str,
    orders: u64,
    products: u32,
) -> anyhow::Result<u64> {
    let orders = i64::try_from(orders)?;
    let inserted = sqlx::query(PRELOAD_SQL)
        .bind(orders)
        .bind(i64::from(products))
        .bind(topic)
        .bind(i64::try_from(WINDOW)?)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    sqlx::query(
        "INSERT INTO outbox_sequence (aggregate_id, last_sequence)
         SELECT aggregate_id, max(sequence) FROM outbox GROUP BY aggregate_id",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query("ANALYZE outbox, outbox_unpublished")
        .execute(&mut *conn)
        .await?;
    sqlx::query("ANALYZE outbox_sequence")
        .execute(&mut *conn)
        .await?;
    Ok(inserted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_of_an_order_come_in_sequence_order() {
        let events: Vec<_> = backlog_order(2_500).collect();
        assert_eq!(events.len(), 7_500);
        let mut last = std::collections::HashMap::new();
        for (g, seq) in events {
            let prev = last.insert(g, seq).unwrap_or(0);
            assert_eq!(seq, prev + 1, "order {g}");
        }
    }

    #[test]
    fn messages_are_order_snapshots_of_typical_size() {
        let id = Uuid::new_v4();
        for g in 0..30 {
            let m = EventMessage::new(id, g, 3, 100);
            let back: OrderSnapshot = serde_json::from_str(&m.payload).expect("an order snapshot");
            assert_eq!(back.order_id, id);
            let products: std::collections::HashSet<_> =
                back.lines.iter().map(|l| &l.product_id).collect();
            assert_eq!(products.len(), back.lines.len(), "distinct products");
            assert!((250..500).contains(&m.size()), "{} bytes", m.size());
        }
    }

    #[test]
    fn the_generators_orders_go_through_the_statuses_of_the_backlog() {
        for g in 0..30 {
            let plan = order_plan(g, 100);
            assert_eq!(plan.request.lines, lines(g, 100));
            let statuses: Vec<_> = plan.fate.actions().iter().map(|a| a.target()).collect();
            assert_eq!(statuses, vec![status_after(g, 2), status_after(g, 3)]);
        }
    }

    #[test]
    fn jsonb_spacing_matches_postgres() {
        let v = serde_json::json!({"a": 1, "b": [1, 2]});
        assert_eq!(jsonb_text(&v), r#"{"a": 1, "b": [1, 2]}"#);
    }
}
