//! The `shipping` consumer group: a handler, which is all a group needs to run on the consumer
//! runtime.

use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use sqlx::PgConnection;

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
