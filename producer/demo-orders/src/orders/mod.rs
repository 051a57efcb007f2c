//! The order domain: the lifecycle rules and the transactions that change an order together with
//! the event recording the change.
//!
//! Every write here happens in one PostgreSQL transaction with its [`outbox::enqueue_all`]
//! call, so an order change and its event are committed together or not at all.

mod place;
mod reminder;
mod shared_transactions;
mod store;
mod transition;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use outbox::EnqueueError;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::validation::ValidOrder;
use shared_transactions::{Answer, Job, Place, SharedTransactions, Transition};
use tokio::sync::oneshot;

pub use place::Placed;
pub use shared_transactions::{SharedTransactionMetrics, SharedTransactionSettings};
pub use store::fetch_order;

/// An order as the API returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    pub order_id: Uuid,
    pub customer_id: String,
    pub email: Option<String>,
    pub status: OrderStatus,
    pub lines: Vec<OrderLine>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// For a newly placed order, the payment reminder time its request asked for; not stored
    /// and not part of the API's answer.
    #[serde(skip)]
    pub payment_reminder_at: Option<DateTime<Utc>>,
}

impl Order {
    /// The event payload describing this order.
    pub fn snapshot(&self) -> OrderSnapshot {
        OrderSnapshot {
            order_id: self.order_id,
            customer_id: self.customer_id.clone(),
            email: self.email.clone(),
            status: self.status,
            lines: self.lines.clone(),
        }
    }
}

/// A change a client can ask for after an order is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Pay,
    Cancel,
    Ship,
}

impl Action {
    /// The verb, as in the route `/orders/{id}/<verb>`.
    pub fn verb(self) -> &'static str {
        match self {
            Action::Pay => "pay",
            Action::Cancel => "cancel",
            Action::Ship => "ship",
        }
    }

    /// The status an order has after this action.
    pub fn target(self) -> OrderStatus {
        match self {
            Action::Pay => OrderStatus::Paid,
            Action::Cancel => OrderStatus::Cancelled,
            Action::Ship => OrderStatus::Shipped,
        }
    }

    /// The status this action moves an order in `from` to, if the lifecycle allows it:
    /// placed → paid | cancelled, paid → shipped | cancelled, nothing out of shipped or cancelled.
    pub fn apply(self, from: OrderStatus) -> Result<OrderStatus, IllegalTransition> {
        use OrderStatus::{Cancelled, Paid, Placed, Shipped};
        match (from, self) {
            (Placed, Action::Pay | Action::Cancel) | (Paid, Action::Ship | Action::Cancel) => {
                Ok(self.target())
            }
            (Placed | Paid | Shipped | Cancelled, _) => Err(IllegalTransition {
                action: self,
                status: from,
            }),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.verb())
    }
}

/// An action the lifecycle does not allow from the order's current status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot {action} an order that is {}", status.as_str())]
pub struct IllegalTransition {
    pub action: Action,
    pub status: OrderStatus,
}

/// Why an order operation did not happen. Nothing was written in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("order {0} not found")]
    NotFound(Uuid),
    #[error(transparent)]
    IllegalTransition(#[from] IllegalTransition),
    #[error("unknown product {}", .0.join(", "))]
    UnknownProducts(Vec<String>),
    #[error("Idempotency-Key was already used for a different request")]
    IdempotencyKeyReused,
    /// The outbox already holds this order's event of this type: the lifecycle makes that
    /// impossible, so the data is inconsistent and the change is refused.
    #[error("order {order_id} already has a `{event_type}` event in the outbox")]
    EventAlreadyRecorded {
        order_id: Uuid,
        event_type: &'static str,
    },
    #[error("stored order has unknown status `{0}`")]
    CorruptStatus(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The commit of a transaction shared with other requests failed: whether it took effect
    /// is unknown, as for any commit whose connection fails.
    #[error("database commit failed: {0}")]
    CommitFailed(String),
    #[error("outbox: {0}")]
    Enqueue(#[from] EnqueueError),
}

impl OrderError {
    /// True for a refusal decided before anything was written: the transaction it happened in
    /// is still good for other changes.
    fn wrote_nothing(&self) -> bool {
        matches!(
            self,
            OrderError::NotFound(_)
                | OrderError::IllegalTransition(_)
                | OrderError::UnknownProducts(_)
                | OrderError::IdempotencyKeyReused
        )
    }
}

/// Places and changes orders, recording one outbox event per change.
#[derive(Debug, Clone)]
pub struct OrderService {
    pool: PgPool,
    topic: Arc<str>,
    notify_relay: bool,
    reminders: PaymentReminders,
    shared: Option<SharedTransactions>,
}

/// When orders get a payment reminder (see [`OrderService::with_payment_reminders`]).
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

impl OrderService {
    /// Events go to `topic`; with `notify_relay` every transaction also wakes a listening relay.
    /// Each change is written in a transaction of its own.
    pub fn new(pool: PgPool, topic: impl Into<Arc<str>>, notify_relay: bool) -> Self {
        Self {
            pool,
            topic: topic.into(),
            notify_relay,
            reminders: PaymentReminders::default(),
            shared: None,
        }
    }

    /// Every order placed gets an `order.payment_reminder` event published `reminders.after`
    /// it was placed (or at the time its request asked for), unless it is paid or cancelled
    /// first: the pay or cancel withdraws the reminder in its own transaction. Call before
    /// [`OrderService::with_shared_transactions`].
    pub fn with_payment_reminders(mut self, reminders: PaymentReminders) -> Self {
        self.reminders = reminders;
        self
    }

    /// When orders get a payment reminder.
    pub fn payment_reminders(&self) -> PaymentReminders {
        self.reminders
    }

    /// Changes requested at the same time share transactions (see [`shared_transactions`]). Starts the
    /// runners on the current Tokio runtime; they stop when the service's last clone is dropped.
    pub fn with_shared_transactions(
        mut self,
        settings: SharedTransactionSettings,
        metrics: SharedTransactionMetrics,
    ) -> Self {
        let writer = Self {
            shared: None,
            ..self.clone()
        };
        self.shared = Some(SharedTransactions::start(writer, settings, metrics));
        self
    }

    /// Places `order` with its `order.placed` event, committed together.
    ///
    /// With an idempotency key, the key's unique constraint decides: the insert either takes the
    /// key, or finds it taken (waiting for a concurrent holder to commit or roll back) and
    /// returns that order if it came from the same request. There is no check-then-insert
    /// window, so concurrent retries of one request place one order.
    pub async fn place(
        &self,
        order: &ValidOrder,
        idempotency_key: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Placed, OrderError> {
        let job = |reply| {
            Job::Place(Place {
                order: order.clone(),
                idempotency_key: idempotency_key.map(str::to_owned),
                traceparent: traceparent.map(str::to_owned),
                reply,
            })
        };
        if let Some(result) = self.in_shared_transaction(job).await {
            return result;
        }
        // Alone: a transaction of its own, committed if the change succeeds.
        let mut tx = self.pool.begin().await?;
        let placed = self.place_in(&mut tx, order, idempotency_key).await?;
        if placed.created {
            self.record_events(&mut tx, &[(&placed.order, traceparent)])
                .await?;
        }
        tx.commit().await?;
        Ok(placed)
    }

    /// Hands the change `make` builds to the shared transactions, if on, and waits for its
    /// answer. `None`: run it alone (shared transactions are off, or its shared transaction
    /// failed).
    async fn in_shared_transaction<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Answer<T>>) -> Job,
    ) -> Answer<T> {
        match &self.shared {
            Some(shared) => shared.submit(make).await,
            None => None,
        }
    }

    /// Applies `action` to the order and records its event, committed together.
    ///
    /// The status changes only from a status the action may leave. The UPDATE locks the row, and
    /// a concurrent action's commit makes it re-check the status, so concurrent actions on one
    /// order are applied one after the other and each sees the status the previous one left: of
    /// two concurrent `pay` calls, exactly one succeeds.
    pub async fn transition(
        &self,
        order_id: Uuid,
        action: Action,
        traceparent: Option<&str>,
    ) -> Result<Order, OrderError> {
        let job = |reply| {
            Job::Transition(Transition {
                order_id,
                action,
                traceparent: traceparent.map(str::to_owned),
                reply,
            })
        };
        if let Some(result) = self.in_shared_transaction(job).await {
            return result;
        }
        let mut tx = self.pool.begin().await?;
        let order = self.transition_in(&mut tx, order_id, action).await?;
        self.record_events(&mut tx, &[(&order, traceparent)])
            .await?;
        tx.commit().await?;
        Ok(order)
    }

    /// The connection pool the service writes through.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The order with this id, if there is one.
    pub async fn get(&self, order_id: Uuid) -> Result<Option<Order>, OrderError> {
        let mut conn = self.pool.acquire().await?;
        fetch_order(&mut conn, order_id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use OrderStatus::{Cancelled, Paid, Placed, Shipped};

    #[test]
    fn lifecycle() {
        assert_eq!(Action::Pay.apply(Placed), Ok(Paid));
        assert_eq!(Action::Cancel.apply(Placed), Ok(Cancelled));
        assert_eq!(Action::Ship.apply(Paid), Ok(Shipped));
        assert_eq!(Action::Cancel.apply(Paid), Ok(Cancelled));
        for (action, from) in [
            (Action::Ship, Placed),
            (Action::Pay, Paid),
            (Action::Pay, Shipped),
            (Action::Cancel, Shipped),
            (Action::Ship, Cancelled),
            (Action::Pay, Cancelled),
            (Action::Cancel, Cancelled),
        ] {
            assert!(action.apply(from).is_err(), "{action} from {from:?}");
        }
    }

    #[test]
    fn illegal_transition_message() {
        let e = Action::Ship.apply(Cancelled).expect_err("illegal");
        assert_eq!(e.to_string(), "cannot ship an order that is cancelled");
    }
}
