//! What each order of a load run looks like: the request placing it and the actions after it.
//! The seeded mix derives each order from the run's seed and the order's index only, so it is the
//! same whatever the concurrency or timing.

use demo_events::order_events::{demo_product_id, OrderLine};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::api::Action;
use crate::api::OrderRequest;

/// Share of orders cancelled right after being placed, without paying.
const CANCEL_UNPAID: f64 = 0.10;
/// Share of paid orders that are shipped; the rest are cancelled.
const SHIP_AFTER_PAY: f64 = 0.80;
/// Distinct customers the load spreads orders over.
const CUSTOMERS: u32 = 1_000;

/// Events an order of the seeded mix makes on average: placing, then one action (cancelled
/// unpaid) or two (paid, then shipped or cancelled).
pub const MEAN_EVENTS_PER_ORDER: f64 = 1.0 + CANCEL_UNPAID + (1.0 - CANCEL_UNPAID) * 2.0;

/// How an order's life goes after it is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fate {
    CancelUnpaid,
    PayShip,
    PayCancel,
}

impl Fate {
    /// The actions taken after the order is placed, in order.
    pub fn actions(self) -> &'static [Action] {
        match self {
            Fate::CancelUnpaid => &[Action::Cancel],
            Fate::PayShip => &[Action::Pay, Action::Ship],
            Fate::PayCancel => &[Action::Pay, Action::Cancel],
        }
    }

    /// Events the order produces when every step succeeds (placing included).
    pub fn events(self) -> u64 {
        1 + self.actions().len() as u64
    }
}

/// One order of a load run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderPlan {
    /// Its number in the run.
    pub index: u64,
    pub request: OrderRequest,
    pub fate: Fate,
}

impl OrderPlan {
    /// The `index`th order of the run seeded with `seed`, over products 1 to `products`:
    /// 1 to 3 distinct products, quantities 1 to 3.
    pub fn generate(seed: u64, index: u64, products: u32) -> Self {
        // Golden-ratio stride: neighbouring indexes get unrelated generator states.
        let mut rng = StdRng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let products = products.max(1);
        let count = rng.random_range(1..=3u32).min(products);
        let lines = rand::seq::index::sample(&mut rng, products as usize, count as usize)
            .into_iter()
            .map(|i| OrderLine {
                // `i < products`, a u32, so the conversion is lossless.
                product_id: demo_product_id(u32::try_from(i).unwrap_or(0) + 1),
                quantity: rng.random_range(1..=3),
            })
            .collect();
        let customer = rng.random_range(1..=CUSTOMERS);
        let email = rng
            .random_bool(0.5)
            .then(|| format!("customer-{customer}@example.com"));
        let fate = if rng.random_bool(CANCEL_UNPAID) {
            Fate::CancelUnpaid
        } else if rng.random_bool(SHIP_AFTER_PAY) {
            Fate::PayShip
        } else {
            Fate::PayCancel
        };
        OrderPlan {
            index,
            request: OrderRequest {
                customer_id: format!("customer-{customer}"),
                email,
                lines,
            },
            fate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn same_seed_same_mix() {
        for i in 0..100 {
            assert_eq!(
                OrderPlan::generate(7, i, 100),
                OrderPlan::generate(7, i, 100)
            );
        }
        let a: Vec<_> = (0..20).map(|i| OrderPlan::generate(1, i, 100)).collect();
        let b: Vec<_> = (0..20).map(|i| OrderPlan::generate(2, i, 100)).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn orders_are_valid_and_the_mix_is_as_documented() {
        let plans: Vec<_> = (0..10_000).map(|i| OrderPlan::generate(42, i, 5)).collect();
        for p in &plans {
            let ids: HashSet<_> = p.request.lines.iter().map(|l| &l.product_id).collect();
            assert_eq!(ids.len(), p.request.lines.len(), "distinct products");
            assert!((1..=3).contains(&p.request.lines.len()));
            assert!(p
                .request
                .lines
                .iter()
                .all(|l| (1..=3).contains(&l.quantity)));
            assert!(p
                .request
                .lines
                .iter()
                .all(|l| l.product_id.as_str() >= "sku-00001"
                    && l.product_id.as_str() <= "sku-00005"));
        }
        let unpaid = plans
            .iter()
            .filter(|p| p.fate == Fate::CancelUnpaid)
            .count();
        let shipped = plans.iter().filter(|p| p.fate == Fate::PayShip).count();
        assert!((800..1_200).contains(&unpaid), "{unpaid}");
        assert!((6_800..7_600).contains(&shipped), "{shipped}");
    }

    #[test]
    fn the_mix_makes_the_mean_number_of_events() {
        let events: u64 = (0..10_000)
            .map(|i| OrderPlan::generate(9, i, 50).fate.events())
            .sum();
        let mean = events as f64 / 10_000.0;
        assert!((mean - MEAN_EVENTS_PER_ORDER).abs() < 0.05, "{mean}");
        assert!((MEAN_EVENTS_PER_ORDER - 2.9).abs() < 1e-9);
    }

    #[test]
    fn a_single_product_catalogue_still_works() {
        let p = OrderPlan::generate(3, 9, 1);
        assert_eq!(p.request.lines.len(), 1);
        assert_eq!(p.request.lines[0].product_id, "sku-00001");
    }
}
