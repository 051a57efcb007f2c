//! Request pacing: every slot is one request, so one event. Slot `3q` places order `q`; slot
//! `3q + k` sends action `k` of the order placed `k × D` cycles before (D cycles are about the
//! step gap), so each order's steps go one after the other, a step gap apart, while the slots
//! keep an even rate. A slot with no such action (the first `2D` cycles, or an order whose fate
//! has fewer actions) places an extra order instead.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::api::Action;
use crate::plan::OrderPlan;
use crate::steps::{Handover, Job};

/// Slots of one cycle: placing, and the longest fate's two actions.
const STEPS: u64 = 3;
/// Extra orders get indexes from here on, far above the regular ones, so they do not repeat
/// their requests or keys.
const EXTRA_ORDERS_FROM: u64 = u32::MAX as u64;

/// An order whose next action is still to come.
#[derive(Debug)]
struct Waiting {
    actions: &'static [Action],
    /// Tells whether the step before went through, and the order's id.
    after: oneshot::Receiver<Handover>,
}

/// Which job each slot sends, and the hand-over of an order from one step to the next.
#[derive(Debug)]
pub(crate) struct Interleave {
    /// D: cycles between an order's steps.
    gap: u64,
    /// By order index: the orders whose next action is still to come.
    waiting: HashMap<u64, Waiting>,
    /// Extra orders placed so far.
    extra: u64,
}

impl Interleave {
    /// For `rate` requests per second, an order's steps about `step_gap` apart.
    pub(crate) fn new(rate: f64, step_gap: Duration) -> Interleave {
        Interleave {
            gap: ((rate * step_gap.as_secs_f64() / STEPS as f64).ceil() as u64).max(1),
            waiting: HashMap::new(),
            extra: 0,
        }
    }

    /// The job of slot `slot` (slots are asked for in order), with orders from `mix`.
    pub(crate) fn job(&mut self, slot: u64, mix: &mut impl FnMut(u64) -> OrderPlan) -> Job {
        let (cycle, k) = (slot / STEPS, slot % STEPS);
        if k == 0 {
            let plan = mix(cycle);
            let (next, after) = oneshot::channel();
            let _ = self.waiting.insert(
                cycle,
                Waiting {
                    actions: plan.fate.actions(),
                    after,
                },
            );
            return Job::Place {
                plan,
                next: Some(next),
            };
        }
        if let Some(job) = self.action(cycle, k) {
            return job;
        }
        self.extra += 1;
        Job::Place {
            plan: mix(EXTRA_ORDERS_FROM + self.extra),
            next: None,
        }
    }

    /// Action `k` of the order placed `k × D` cycles before `cycle`, if it has one.
    fn action(&mut self, cycle: u64, k: u64) -> Option<Job> {
        let order = cycle.checked_sub(k * self.gap)?;
        let waiting = self.waiting.remove(&order)?;
        let index = usize::try_from(k - 1).ok()?;
        let &action = waiting.actions.get(index)?;
        let next = (index + 1 < waiting.actions.len()).then(|| {
            let (next, after) = oneshot::channel();
            let _ = self.waiting.insert(
                order,
                Waiting {
                    actions: waiting.actions,
                    after,
                },
            );
            next
        });
        Some(Job::Act {
            order,
            sequence: i64::try_from(k).unwrap_or(i64::MAX) + 1,
            action,
            after: waiting.after,
            next,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::OrderRequest;
    use crate::plan::Fate;

    fn plan(index: u64) -> OrderPlan {
        OrderPlan {
            index,
            request: OrderRequest {
                customer_id: "c".into(),
                email: None,
                lines: Vec::new(),
            },
            fate: if index % 10 == 9 {
                Fate::PayCancel
            } else {
                Fate::PayShip
            },
        }
    }

    #[test]
    fn every_slot_is_one_event_and_orders_go_through_their_steps_in_order() {
        let mut interleave = Interleave::new(150.0, Duration::from_millis(200));
        let gap = interleave.gap;
        assert!((10..=11).contains(&gap), "about 200 ms of slots: {gap}");
        let (mut placed, mut extra) = (Vec::new(), 0);
        let mut actions: HashMap<u64, Vec<(i64, Action)>> = HashMap::new();
        for slot in 0..300 {
            match interleave.job(slot, &mut plan) {
                Job::Place {
                    next: Some(_),
                    plan,
                } => placed.push(plan.index),
                Job::Place { next: None, plan } => {
                    assert!(plan.index > EXTRA_ORDERS_FROM);
                    extra += 1;
                }
                Job::Act {
                    order,
                    sequence,
                    action,
                    ..
                } => actions.entry(order).or_default().push((sequence, action)),
                Job::Order(_) => panic!("request pacing sends no whole orders"),
            }
        }
        assert_eq!(placed, (0..100).collect::<Vec<_>>());
        let paid = actions.values().filter(|a| !a.is_empty()).count() as u64;
        let finished = actions.values().filter(|a| a.len() == 2).count() as u64;
        assert_eq!((paid, finished, extra), (100 - gap, 100 - 2 * gap, 3 * gap));
        for (order, steps) in &actions {
            let last = if order % 10 == 9 {
                Action::Cancel
            } else {
                Action::Ship
            };
            assert_eq!(steps[0], (2, Action::Pay));
            if steps.len() == 2 {
                assert_eq!(steps[1], (3, last));
            }
        }
    }

    #[test]
    fn no_fate_has_more_steps_than_a_cycle() {
        for fate in [Fate::CancelUnpaid, Fate::PayShip, Fate::PayCancel] {
            assert!(fate.events() <= STEPS);
        }
    }
}
