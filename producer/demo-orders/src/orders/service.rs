//! The order service: places and changes orders, each change committed with its event, alone or
//! in a transaction shared with the changes requested at the same time.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::error::OrderError;
use super::model::{Action, Order};
use super::place::{place_in, Placed};
use super::reminder::PaymentReminders;
use super::shared_transactions::{
    Answer, Job, Place, SharedTransactionMetrics, SharedTransactionSettings, SharedTransactions,
    Transition,
};
use super::store::fetch_order;
use super::transition::transition_in;
use super::writer::Writer;
use crate::validation::ValidOrder;

/// Places and changes orders, recording one outbox event per change.
#[derive(Debug, Clone)]
pub struct OrderService {
    writer: Writer,
    shared: Option<SharedTransactions>,
}

impl OrderService {
    /// Events go to `topic`; with `notify_relay` every transaction also wakes a listening relay.
    /// Each change is written in a transaction of its own.
    pub fn new(pool: PgPool, topic: impl Into<Arc<str>>, notify_relay: bool) -> Self {
        Self {
            writer: Writer {
                pool,
                topic: topic.into(),
                notify_relay,
                reminders: PaymentReminders::default(),
            },
            shared: None,
        }
    }

    /// Every order placed gets an `order.payment_reminder` event published `reminders.after`
    /// it was placed (or at the time its request asked for), unless it is paid or cancelled
    /// first: the pay or cancel withdraws the reminder in its own transaction. Call before
    /// [`OrderService::with_shared_transactions`].
    pub fn with_payment_reminders(mut self, reminders: PaymentReminders) -> Self {
        self.writer.reminders = reminders;
        self
    }

    /// When orders get a payment reminder.
    pub fn payment_reminders(&self) -> PaymentReminders {
        self.writer.reminders
    }

    /// Changes requested at the same time share transactions (see [`SharedTransactions`]).
    /// Starts the runners on the current Tokio runtime; they stop when the service's last clone
    /// is dropped.
    pub fn with_shared_transactions(
        mut self,
        settings: SharedTransactionSettings,
        metrics: SharedTransactionMetrics,
    ) -> Self {
        self.shared = Some(SharedTransactions::start(
            self.writer.clone(),
            settings,
            metrics,
        ));
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
        let mut tx = self.writer.pool.begin().await?;
        let placed = place_in(&mut tx, order, idempotency_key).await?;
        if placed.created {
            self.writer
                .record_events(&mut tx, &[(&placed.order, traceparent)])
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
        let mut tx = self.writer.pool.begin().await?;
        let order = transition_in(&mut tx, order_id, action).await?;
        self.writer
            .record_events(&mut tx, &[(&order, traceparent)])
            .await?;
        tx.commit().await?;
        Ok(order)
    }

    /// The connection pool the service writes through.
    pub fn pool(&self) -> &PgPool {
        &self.writer.pool
    }

    /// The order with this id, if there is one.
    pub async fn get(&self, order_id: Uuid) -> Result<Option<Order>, OrderError> {
        let mut conn = self.writer.pool.acquire().await?;
        fetch_order(&mut conn, order_id).await
    }
}
