//! What the driver does with each order: derived from the seed and the order's index only.

use pipeline_core::order_events::{
    demo_product_id, ORDER_CANCELLED, ORDER_PAID, ORDER_PLACED, ORDER_SHIPPED,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// One state change the driver asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Place,
    Pay,
    Ship,
    Cancel,
}

impl Step {
    /// The event the order service records for this change.
    pub fn event_type(self) -> &'static str {
        match self {
            Step::Place => ORDER_PLACED,
            Step::Pay => ORDER_PAID,
            Step::Ship => ORDER_SHIPPED,
            Step::Cancel => ORDER_CANCELLED,
        }
    }

    /// The route verb of an action (`/orders/{id}/<verb>`).
    pub fn verb(self) -> &'static str {
        match self {
            Step::Place => "place",
            Step::Pay => "pay",
            Step::Ship => "ship",
            Step::Cancel => "cancel",
        }
    }

    /// The order's status once the change is done.
    pub fn target_status(self) -> &'static str {
        match self {
            Step::Place => "placed",
            Step::Pay => "paid",
            Step::Ship => "shipped",
            Step::Cancel => "cancelled",
        }
    }
}

/// Events an order makes on average (10% place+cancel, 90% place+pay+ship/cancel).
pub const EVENTS_PER_ORDER: f64 = 2.9;

/// One order of the run: its create request and the actions after it.
#[derive(Debug, Clone, PartialEq)]
pub struct OrderPlan {
    pub request: Value,
    pub actions: &'static [Step],
}

impl OrderPlan {
    /// The `index`th order of the run seeded with `seed`: 1 to 3 distinct products of
    /// `products`, quantities 1 to 3; cancelled unpaid (10%), or paid then shipped (80%) or
    /// cancelled (20%).
    pub fn generate(seed: u64, index: u64, products: u32) -> OrderPlan {
        let mut rng = StdRng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let products = products.max(1);
        let count = rng.random_range(1..=3u32).min(products);
        let lines: Vec<Value> =
            rand::seq::index::sample(&mut rng, products as usize, count as usize)
                .into_iter()
                .map(|i| {
                    json!({
                        // `i < products`, a u32, so the conversion cannot fail.
                        "product_id": demo_product_id(u32::try_from(i).unwrap_or(0) + 1),
                        "quantity": rng.random_range(1..=3),
                    })
                })
                .collect();
        let customer = rng.random_range(1..=1_000u32);
        let actions: &'static [Step] = if rng.random_bool(0.1) {
            &[Step::Cancel]
        } else if rng.random_bool(0.8) {
            &[Step::Pay, Step::Ship]
        } else {
            &[Step::Pay, Step::Cancel]
        };
        OrderPlan {
            request: json!({
                "customer_id": format!("customer-{customer}"),
                "email": format!("customer-{customer}@example.com"),
                "lines": lines,
            }),
            actions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_orders() {
        for i in 0..50 {
            assert_eq!(OrderPlan::generate(5, i, 50), OrderPlan::generate(5, i, 50));
        }
        let a: Vec<_> = (0..20).map(|i| OrderPlan::generate(1, i, 50)).collect();
        let b: Vec<_> = (0..20).map(|i| OrderPlan::generate(2, i, 50)).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn the_mix_makes_about_the_expected_events() {
        let events: usize = (0..10_000)
            .map(|i| 1 + OrderPlan::generate(9, i, 50).actions.len())
            .sum();
        let mean = events as f64 / 10_000.0;
        assert!((mean - EVENTS_PER_ORDER).abs() < 0.05, "{mean}");
    }
}
