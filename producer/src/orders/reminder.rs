//! Payment reminders: a delayed `order.payment_reminder` event for each order placed, withdrawn
//! when the order is paid or cancelled before it is due.
//!
//! Both happen in the transaction of the change, with the outbox's delayed events
//! ([`crate::outbox::enqueue_all_at`], [`crate::outbox::cancel_scheduled`]): a reminder exists if
//! and only if its order was placed, and a pay or cancel that commits before the reminder is due
//! leaves none. The relay publishes a reminder that is still there when it falls due, after every
//! event the order committed before it.

use pipeline_core::order_events::{OrderStatus, ORDER_PAYMENT_REMINDER};
use sqlx::{Postgres, Transaction};

use super::{Order, OrderError, OrderService};
use crate::outbox::{self, PublishAt};

impl OrderService {
    /// Schedules the reminders of the orders `changed` placed, and withdraws those of the
    /// orders it paid or cancelled: at most one statement each.
    pub(super) async fn schedule_reminders(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        changed: &[(&Order, Option<&str>)],
    ) -> Result<(), OrderError> {
        let mut reminders = Vec::new();
        let mut settled = Vec::new();
        for (order, traceparent) in changed {
            match order.status {
                OrderStatus::Placed => {
                    let when = match (order.payment_reminder_at, self.reminders.after) {
                        (Some(at), _) => PublishAt::At(at),
                        (None, Some(after)) => PublishAt::After(after),
                        (None, None) => continue,
                    };
                    let mut event = self.event_for(order, *traceparent)?;
                    ORDER_PAYMENT_REMINDER.clone_into(&mut event.event_type);
                    reminders.push((event, when));
                }
                OrderStatus::Paid | OrderStatus::Cancelled => settled.push(order),
                OrderStatus::Shipped => {}
            }
        }
        outbox::enqueue_all_at(tx, &reminders).await?;
        if !settled.is_empty() {
            let keys: Vec<String> = settled.iter().map(|o| o.order_id.to_string()).collect();
            let facts: Vec<(&str, &str)> = keys
                .iter()
                .map(|k| (k.as_str(), ORDER_PAYMENT_REMINDER))
                .collect();
            let _ = outbox::cancel_scheduled(tx, &facts).await?;
        }
        Ok(())
    }
}
