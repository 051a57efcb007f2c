//! The event recording an order change: the order as it is after the change, keyed by its id.

use outbox::NewEvent;
use pipeline_core::envelope::TRACEPARENT;

use super::error::OrderError;
use super::model::Order;

/// The event recording that `order` entered its current status, for `topic`.
pub(super) fn order_event(
    topic: &str,
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
        topic: topic.to_owned(),
        payload,
        headers: traceparent
            .map(|tp| vec![(TRACEPARENT.to_owned(), tp.to_owned())])
            .unwrap_or_default(),
    })
}
