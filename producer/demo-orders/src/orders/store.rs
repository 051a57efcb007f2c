//! Reading orders back and appending their events: the SQL shared by placing and transitions.

use chrono::{DateTime, Utc};
use demo_events::order_events::{OrderLine, OrderStatus};
use outbox::{EnqueueError, NewEvent};
use pipeline_core::envelope::TRACEPARENT;
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::{Order, OrderError, OrderService};

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

impl OrderService {
    /// Appends, inside `tx` and in one statement, the event recording that each order entered
    /// its current status (with the request's traceparent, if any).
    ///
    /// The business key is the order id: with the event type, it names the fact once, so an
    /// event already recorded means the lifecycle was bypassed. Then the statement fails, the
    /// transaction can only be rolled back, and the change is refused.
    pub(super) async fn record_events(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        changed: &[(&Order, Option<&str>)],
    ) -> Result<(), OrderError> {
        let events = changed
            .iter()
            .map(|(order, traceparent)| self.event_for(order, *traceparent))
            .collect::<Result<Vec<_>, _>>()?;
        let reminders = self.reminder_changes(changed)?;
        let withdraw = reminders.withdrawn_facts();
        match outbox::enqueue_all_and_schedule(tx, &events, &reminders.schedule, &withdraw).await {
            Ok(_) => {}
            Err(EnqueueError::AlreadyRecorded) => {
                return Err(match changed {
                    [(order, _)] => OrderError::EventAlreadyRecorded {
                        order_id: order.order_id,
                        event_type: order.status.event_type(),
                    },
                    _ => OrderError::Enqueue(EnqueueError::AlreadyRecorded),
                })
            }
            Err(e) => return Err(e.into()),
        }
        if self.notify_relay && !events.is_empty() {
            outbox::notify_relay(tx).await?;
        }
        Ok(())
    }

    /// The event recording that `order` entered its current status.
    pub(super) fn event_for(
        &self,
        order: &Order,
        traceparent: Option<&str>,
    ) -> Result<NewEvent, OrderError> {
        let order_id = order.order_id.to_string();
        let payload = serde_json::to_value(order.snapshot())
            .map_err(|e| OrderError::Database(sqlx::Error::Encode(Box::new(e))))?;
        Ok(NewEvent {
            business_key: order_id.clone(),
            event_type: order.status.event_type().to_owned(),
            aggregate_id: order_id,
            topic: self.topic.to_string(),
            payload,
            headers: traceparent
                .map(|tp| vec![(TRACEPARENT.to_owned(), tp.to_owned())])
                .unwrap_or_default(),
        })
    }
}
