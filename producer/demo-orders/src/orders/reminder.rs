//! Payment reminders: a delayed `order.payment_reminder` event for each order placed, withdrawn
//! when the order is paid or cancelled before it is due.
//!
//! Both happen in the transaction of the change, in the statement that appends the change's
//! event ([`outbox::enqueue_all_and_delay`]): a reminder exists if and only if its order was
//! placed, and a pay or cancel that commits before the reminder is due leaves none. The relay publishes a reminder that is still there when it falls due, after every
//! event the order committed before it.

use std::time::Duration;

use demo_events::order_events::{OrderStatus, ORDER_PAYMENT_REMINDER};
use outbox::{NewEvent, PublishAt};

use super::error::OrderError;
use super::events::order_event;
use super::model::Order;

/// When orders get a payment reminder (see
/// [`OrderService::with_payment_reminders`](super::OrderService::with_payment_reminders)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaymentReminders {
    /// Delay after placing; `None`: only orders whose request names a reminder time get one.
    pub after: Option<Duration>,
    /// Latest reminder time a request may ask for, from now.
    pub horizon: Duration,
}

impl Default for PaymentReminders {
    /// No default reminder; requests may ask for one up to 30 days ahead.
    fn default() -> Self {
        PaymentReminders {
            after: None,
            horizon: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

/// What a transaction's changes do to payment reminders.
#[derive(Debug, Default)]
pub(super) struct ReminderChanges {
    /// Reminders of the orders placed.
    pub(super) delay: Vec<(NewEvent, PublishAt)>,
    /// Business keys (order ids) whose reminder is withdrawn: the orders paid or cancelled.
    pub(super) withdraw: Vec<String>,
}

impl ReminderChanges {
    /// The (business key, event type) pairs of the reminders to withdraw.
    pub(super) fn withdrawn_facts(&self) -> Vec<(&str, &str)> {
        self.withdraw
            .iter()
            .map(|k| (k.as_str(), ORDER_PAYMENT_REMINDER))
            .collect()
    }
}

/// The reminders (as `reminders` says, recorded for `topic`) of the orders `changed` placed,
/// and the orders it paid or cancelled, whose reminders are withdrawn; written with the
/// changes' events in one statement.
pub(super) fn reminder_changes(
    reminders: &PaymentReminders,
    topic: &str,
    changed: &[(&Order, Option<&str>)],
) -> Result<ReminderChanges, OrderError> {
    let mut changes = ReminderChanges::default();
    for (order, traceparent) in changed {
        match order.status {
            OrderStatus::Placed => {
                let when = match (order.payment_reminder_at, reminders.after) {
                    (Some(at), _) => PublishAt::At(at),
                    (None, Some(after)) => PublishAt::After(after),
                    (None, None) => continue,
                };
                let mut event = order_event(topic, order, *traceparent)?;
                ORDER_PAYMENT_REMINDER.clone_into(&mut event.event_type);
                changes.delay.push((event, when));
            }
            OrderStatus::Paid | OrderStatus::Cancelled => {
                changes.withdraw.push(order.order_id.to_string());
            }
            OrderStatus::Shipped => {}
        }
    }
    Ok(changes)
}
