//! What one slot of a run sends: a whole order, or, with request pacing, one step of an order,
//! whose id comes from the step before through a channel.

use tokio::sync::oneshot;
use tokio::time::Instant;
use uuid::Uuid;

use crate::api::Action;
use crate::client::{OrderClient, RequestStats};
use crate::plan::OrderPlan;
use crate::record::{StepFailure, StepRecord};

/// The id of a placed order (`None`: the step did not go through), for the order's next step.
pub(crate) type Handover = Option<Uuid>;

/// The work of one slot.
#[derive(Debug)]
pub(crate) enum Job {
    /// Placing the order, then each action as soon as the one before is answered, stopping at
    /// the first that does not go through.
    Order(OrderPlan),
    /// Placing the order; `next` gets its id.
    Place {
        plan: OrderPlan,
        next: Option<oneshot::Sender<Handover>>,
    },
    /// One action of an order placed in an earlier slot, once `after` says the step before went
    /// through; `next` gets the outcome.
    Act {
        order: u64,
        sequence: i64,
        action: Action,
        after: oneshot::Receiver<Handover>,
        next: Option<oneshot::Sender<Handover>>,
    },
}

impl Job {
    /// The order the job places, if it does.
    pub(crate) fn order(&self) -> Option<u64> {
        match self {
            Job::Order(plan) | Job::Place { plan, .. } => Some(plan.index),
            Job::Act { .. } => None,
        }
    }

    /// Sends the job's requests (placing under `key`), started at `started` for a slot due at
    /// `due`; returns a record for each step.
    pub(crate) async fn run(
        self,
        client: &OrderClient,
        key: Option<&str>,
        due: Instant,
        started: Instant,
    ) -> Vec<StepRecord> {
        let key = key.unwrap_or_default();
        match self {
            Job::Order(plan) => run_order(client, &plan, key, due, started).await,
            Job::Place { plan, next } => {
                let step = place(client, &plan, key, due, started).await;
                if let Some(next) = next {
                    let _ = next.send(step.order_id.filter(|_| step.outcome.is_ok()));
                }
                vec![step]
            }
            Job::Act {
                order,
                sequence,
                action,
                after,
                next,
            } => {
                let placed = after.await.ok().flatten();
                let step = match placed {
                    Some(order_id) => {
                        act(client, order, order_id, sequence, action, due, started).await
                    }
                    None => StepRecord {
                        order,
                        order_id: None,
                        sequence,
                        action: Some(action),
                        due,
                        started,
                        finished: Instant::now(),
                        stats: RequestStats::default(),
                        outcome: Err(StepFailure::Skipped),
                    },
                };
                if let Some(next) = next {
                    let _ = next.send(step.order_id.filter(|_| step.outcome.is_ok()));
                }
                vec![step]
            }
        }
    }
}

/// Places the order and takes it through its actions, stopping at the first failure: its later
/// actions would depend on it.
async fn run_order(
    client: &OrderClient,
    plan: &OrderPlan,
    key: &str,
    due: Instant,
    started: Instant,
) -> Vec<StepRecord> {
    let placed = place(client, plan, key, due, started).await;
    let order_id = placed.order_id.filter(|_| placed.outcome.is_ok());
    let mut steps = vec![placed];
    let Some(order_id) = order_id else {
        return steps;
    };
    for (sequence, &action) in (2..).zip(plan.fate.actions()) {
        let now = Instant::now();
        let step = act(client, plan.index, order_id, sequence, action, now, now).await;
        let failed = step.outcome.is_err();
        steps.push(step);
        if failed {
            break;
        }
    }
    steps
}

async fn place(
    client: &OrderClient,
    plan: &OrderPlan,
    key: &str,
    due: Instant,
    started: Instant,
) -> StepRecord {
    let mut stats = RequestStats::default();
    let result = client.place(&plan.request, key, &mut stats).await;
    StepRecord {
        order: plan.index,
        order_id: result.as_ref().ok().map(|o| o.order_id),
        sequence: 1,
        action: None,
        due,
        started,
        finished: Instant::now(),
        stats,
        outcome: result.map(drop).map_err(StepFailure::Request),
    }
}

async fn act(
    client: &OrderClient,
    order: u64,
    order_id: Uuid,
    sequence: i64,
    action: Action,
    due: Instant,
    started: Instant,
) -> StepRecord {
    let mut stats = RequestStats::default();
    let result = client.act(order_id, action, &mut stats).await;
    StepRecord {
        order,
        order_id: Some(order_id),
        sequence,
        action: Some(action),
        due,
        started,
        finished: Instant::now(),
        stats,
        outcome: result.map(drop).map_err(StepFailure::Request),
    }
}
