//! An example to copy: a payments service that appends its own aggregate's events through the
//! outbox library inside its own transactions ([`Payments`]), and a consumer group of
//! its own, `shipping` ([`Shipping`]), registered with the consumer runtime:
//!
//! ```no_run
//! # async fn run(settings: consumer::ConsumerSettings, pool: sqlx::PgPool, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
//! let groups = consumer::Groups::new().register("shipping", payments_example::Shipping::new);
//! let registry = prometheus::Registry::new();
//! consumer::run(settings, pool, &registry, &groups, shutdown).await
//! # }
//! ```
//!
//! `tests/end_to_end.rs` runs both with the relay on the real broker and PostgreSQL.

use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use outbox::{enqueue, EnqueueError, Enqueued, NewEvent};
use sqlx::migrate::Migrator;
use sqlx::{PgConnection, PgPool};

/// The example's own tables (payments, and the shipping group's log), beside the outbox's and
/// the consumer library's.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// The payments service: each change to a payment and the event describing it are written in
/// one transaction of the service's own.
#[derive(Clone)]
pub struct Payments {
    pool: PgPool,
    topic: String,
}

impl Payments {
    /// A service writing to `pool`, its events bound for `topic`.
    pub fn new(pool: PgPool, topic: impl Into<String>) -> Payments {
        Payments {
            pool,
            topic: topic.into(),
        }
    }

    /// Records a captured payment and its `payment.captured` event.
    pub async fn capture(
        &self,
        payment_id: &str,
        amount_cents: i64,
    ) -> Result<Enqueued, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO payment (payment_id, amount_cents, status) VALUES ($1, $2, 'captured')",
        )
        .bind(payment_id)
        .bind(amount_cents)
        .execute(&mut *tx)
        .await?;
        let event = self.event(payment_id, "payment.captured", amount_cents);
        let enqueued = enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    /// Refunds a payment and records its `payment.refunded` event.
    pub async fn refund(&self, payment_id: &str) -> Result<Enqueued, EnqueueError> {
        let mut tx = self.pool.begin().await?;
        let amount_cents: i64 = sqlx::query_scalar(
            "UPDATE payment SET status = 'refunded', updated_at = clock_timestamp()
             WHERE payment_id = $1 RETURNING amount_cents",
        )
        .bind(payment_id)
        .fetch_one(&mut *tx)
        .await?;
        let event = self.event(payment_id, "payment.refunded", amount_cents);
        let enqueued = enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    fn event(&self, payment_id: &str, event_type: &str, amount_cents: i64) -> NewEvent {
        NewEvent {
            business_key: payment_id.to_owned(),
            event_type: event_type.to_owned(),
            aggregate_id: payment_id.to_owned(),
            topic: self.topic.clone(),
            payload: serde_json::json!({ "payment_id": payment_id, "amount_cents": amount_cents }),
            headers: vec![],
        }
    }
}

/// The shipping group: ships what was paid for, cancels the shipment of a refund. Each event's
/// line in `shipment_log` is written in the transaction that records the event processed, so it
/// is written once, and in order per payment.
pub struct Shipping {
    group: String,
}

impl Shipping {
    /// `group` is the group's id (Kafka group id and dedupe scope), given by the runtime.
    pub fn new(group: String) -> Shipping {
        Shipping { group }
    }
}

impl Handler for Shipping {
    fn group(&self) -> &str {
        &self.group
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(ShippingTransaction::default())
    }
}

/// One transaction's log lines, written together by `flush`.
#[derive(Default)]
struct ShippingTransaction {
    payments: Vec<String>,
    sequences: Vec<i64>,
    actions: Vec<&'static str>,
}

impl HandlerTransaction for ShippingTransaction {
    fn apply<'a>(
        &'a mut self,
        _: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        let action = match event.envelope.event_type.as_str() {
            "payment.captured" => Ok("ship"),
            "payment.refunded" => Ok("cancel"),
            other => Err(HandlerError::Rejected(format!(
                "unknown event type {other}"
            ))),
        };
        if let Ok(action) = action {
            self.payments.push(event.envelope.aggregate_id.clone());
            self.sequences.push(event.envelope.sequence);
            self.actions.push(action);
        }
        Box::pin(async move { action.map(|_| ()) })
    }

    fn flush<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO shipment_log (payment_id, sequence, action)
                 SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])",
            )
            .bind(&self.payments)
            .bind(&self.sequences)
            .bind(&self.actions)
            .execute(conn)
            .await?;
            Ok(())
        })
    }
}
