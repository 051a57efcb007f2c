//! The order events the order service publishes and the consumer groups apply.
//!
//! Every event carries a snapshot of the order after the change, so a consumer needs nothing but
//! the event to act on it.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Default topic for order events.
pub const ORDER_EVENTS_TOPIC: &str = "order-events";

pub const ORDER_PLACED: &str = "order.placed";
pub const ORDER_PAID: &str = "order.paid";
pub const ORDER_CANCELLED: &str = "order.cancelled";
pub const ORDER_SHIPPED: &str = "order.shipped";
/// A delayed event: published a while after an order is placed (`producer serve
/// --payment-reminder-after`, or the time the order's request asked for), unless the order
/// was paid or cancelled first. Its payload is the order as it was placed.
pub const ORDER_PAYMENT_REMINDER: &str = "order.payment_reminder";
/// A recurring event: each occurrence of the order service's digest schedule (`producer serve
/// --digest-schedule`), the aggregate [`DIGEST_AGGREGATE`]. The notification group turns it into
/// a digest for the operations team; the inventory passes over it. Its payload names the
/// schedule and the occurrence, not an order.
pub const DAILY_DIGEST: &str = "digest.daily";
/// The name of the order service's digest schedule.
pub const DIGEST_SCHEDULE: &str = "daily-digest";
/// The aggregate (Kafka key) of the digest events.
pub const DIGEST_AGGREGATE: &str = "digest:daily";

/// Order lifecycle states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    Placed,
    Paid,
    Cancelled,
    Shipped,
}

impl OrderStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Placed => "placed",
            OrderStatus::Paid => "paid",
            OrderStatus::Cancelled => "cancelled",
            OrderStatus::Shipped => "shipped",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "placed" => Some(OrderStatus::Placed),
            "paid" => Some(OrderStatus::Paid),
            "cancelled" => Some(OrderStatus::Cancelled),
            "shipped" => Some(OrderStatus::Shipped),
            _ => None,
        }
    }

    /// The event type recorded when an order enters this state.
    pub fn event_type(self) -> &'static str {
        match self {
            OrderStatus::Placed => ORDER_PLACED,
            OrderStatus::Paid => ORDER_PAID,
            OrderStatus::Cancelled => ORDER_CANCELLED,
            OrderStatus::Shipped => ORDER_SHIPPED,
        }
    }
}

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderLine {
    pub product_id: String,
    pub quantity: i32,
}

/// The payload of every order event: the order as it is after the change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderSnapshot {
    pub order_id: Uuid,
    pub customer_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub email: Option<String>,
    pub status: OrderStatus,
    pub lines: Vec<OrderLine>,
}

/// Id of the `n`th product of the demonstration catalogue (1-based), shared by the order
/// service's catalogue seed and the inventory's stock seed.
pub fn demo_product_id(n: u32) -> String {
    format!("sku-{n:05}")
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
