//! An order as the API returns it. The changes a client can ask for after placing it and the
//! lifecycle rules that allow or refuse them ([`Action`]) are the order events' own
//! (`demo_events::order_events`), shared with the load generator.

use chrono::{DateTime, Utc};
use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

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

pub use demo_events::order_events::{Action, IllegalTransition};

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
