//! What writes an order change's events: the pool, the events' topic, whether the relay is
//! woken, and the payment reminders placing delayed events.

use std::sync::Arc;

use outbox::EnqueueError;
use sqlx::{PgPool, Postgres, Transaction};

use super::error::OrderError;
use super::events::order_event;
use super::model::Order;
use super::reminder::{reminder_changes, PaymentReminders};

/// Where and how the changes' events are written; shared by the service's own transactions and
/// its shared ones.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    pub(super) pool: PgPool,
    pub(super) topic: Arc<str>,
    pub(super) notify_relay: bool,
    pub(super) reminders: PaymentReminders,
}

impl Writer {
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
            .map(|(order, traceparent)| order_event(&self.topic, order, *traceparent))
            .collect::<Result<Vec<_>, _>>()?;
        let reminders = reminder_changes(&self.reminders, &self.topic, changed)?;
        let withdraw = reminders.withdrawn_facts();
        match outbox::enqueue_all_and_delay(tx, &events, &reminders.delay, &withdraw).await {
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
}
