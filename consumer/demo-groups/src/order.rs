//! What the inventory and notification groups read from every order event: the order snapshot
//! it carries.

use consumer::{Event, HandlerError};
use demo_events::order_events::OrderSnapshot;

/// Parses the order snapshot every order event carries; one whose order is not the event's
/// aggregate is rejected.
pub fn order_snapshot(event: &Event) -> Result<OrderSnapshot, HandlerError> {
    let snapshot: OrderSnapshot = serde_json::from_value(event.payload.clone())
        .map_err(|e| HandlerError::Rejected(format!("payload is not an order snapshot: {e}")))?;
    if snapshot.order_id.to_string() != event.envelope.aggregate_id {
        return Err(HandlerError::Rejected(format!(
            "payload order_id {} does not match key {}",
            snapshot.order_id, event.envelope.aggregate_id
        )));
    }
    Ok(snapshot)
}
