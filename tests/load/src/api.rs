//! The order service's HTTP API as the generator uses it: the body placing an order, the actions
//! after it, and what the generator reads of an answer.

use demo_events::order_events::{OrderLine, OrderStatus};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The body of `POST /orders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrderRequest {
    pub customer_id: String,
    pub email: Option<String>,
    pub lines: Vec<OrderLine>,
}

/// A change asked for after an order is placed: `POST /orders/{id}/<verb>`.
pub use demo_events::order_events::Action;

/// What the generator reads of an order in an answer: its id and status (the other fields are
/// ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct OrderAnswer {
    pub order_id: Uuid,
    pub status: OrderStatus,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_the_json_object_the_service_reads() {
        let request = OrderRequest {
            customer_id: "customer-1".into(),
            email: None,
            lines: vec![OrderLine {
                product_id: "sku-00001".into(),
                quantity: 2,
            }],
        };
        assert_eq!(
            serde_json::to_value(&request).expect("JSON"),
            serde_json::json!({
                "customer_id": "customer-1",
                "email": null,
                "lines": [{"product_id": "sku-00001", "quantity": 2}]
            })
        );
    }

    #[test]
    fn an_answer_is_read_from_the_order_the_service_returns() {
        let answer: OrderAnswer = serde_json::from_value(serde_json::json!({
            "order_id": "0191f0a4-3b4e-7c3e-9a55-6f1d2a3b4c5d",
            "customer_id": "customer-1",
            "email": null,
            "status": "paid",
            "lines": [],
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z"
        }))
        .expect("answer");
        assert_eq!(answer.status, OrderStatus::Paid);
    }
}
