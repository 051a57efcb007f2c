//! An order as the API returns it, the changes a client can ask for after placing it, and the
//! lifecycle rules that allow or refuse them.

use std::fmt;

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
