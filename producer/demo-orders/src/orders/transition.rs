//! Paying, cancelling and shipping an order, or several at once.

use std::collections::HashMap;

use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use demo_events::order_events::OrderStatus;

use super::error::OrderError;
use super::model::{Action, IllegalTransition, Order};
use super::store::{order_from_row, parse_status, OrderRow};

/// Applies `action` to the order inside `tx`. The caller records the event and commits.
pub(super) async fn transition_in(
    tx: &mut Transaction<'_, Postgres>,
    order_id: Uuid,
    action: Action,
) -> Result<Order, OrderError> {
    use OrderStatus::{Cancelled, Paid, Placed, Shipped};
    // The statuses this action may leave, as the lifecycle says.
    let from: Vec<&str> = [Placed, Paid, Cancelled, Shipped]
        .into_iter()
        .filter(|s| action.apply(*s).is_ok())
        .map(OrderStatus::as_str)
        .collect();
    // One round trip for the change and the order with its lines.
    let changed: Option<OrderRow> = sqlx::query_as(
        "UPDATE orders o SET status = $2, updated_at = clock_timestamp()
         WHERE o.order_id = $1 AND o.status = ANY($3)
         RETURNING o.order_id, o.customer_id, o.email, o.status, o.created_at, o.updated_at,
                   (SELECT COALESCE(array_agg(product_id ORDER BY line_no), '{}')
                    FROM order_line WHERE order_id = $1),
                   (SELECT COALESCE(array_agg(quantity ORDER BY line_no), '{}')
                    FROM order_line WHERE order_id = $1)",
    )
    .bind(order_id)
    .bind(action.target().as_str())
    .bind(&from)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = changed else {
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1")
                .bind(order_id)
                .fetch_optional(&mut **tx)
                .await?;
        let status = status.ok_or(OrderError::NotFound(order_id))?;
        // The lifecycle only moves forward: the status the UPDATE did not accept, or a
        // later one, is the reason.
        return Err(OrderError::IllegalTransition(IllegalTransition {
            action,
            status: parse_status(&status)?,
        }));
    };
    order_from_row(row)
}

/// Applies each `(order, action)` of `changes` (distinct orders) inside `tx`, in two
/// statements whatever their number: the orders' rows are locked in key order (so shared
/// transactions cannot deadlock) and read, then every change the lifecycle allows is made in
/// one UPDATE. One answer per change, in the order given; a refusal wrote nothing. The caller
/// records the events and commits.
pub(super) async fn transition_all_in(
    tx: &mut Transaction<'_, Postgres>,
    changes: &[(Uuid, Action)],
) -> Result<Vec<Result<Order, OrderError>>, OrderError> {
    let ids: Vec<Uuid> = changes.iter().map(|(id, _)| *id).collect();
    let locked: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT order_id, status FROM orders WHERE order_id = ANY($1)
         ORDER BY order_id FOR UPDATE",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    let mut status: HashMap<Uuid, OrderStatus> = HashMap::with_capacity(locked.len());
    for (id, s) in locked {
        let _ = status.insert(id, parse_status(&s)?);
    }
    // What the lifecycle says of each change, on the locked rows.
    let decided: Vec<Result<OrderStatus, OrderError>> = changes
        .iter()
        .map(|(id, action)| match status.get(id) {
            None => Err(OrderError::NotFound(*id)),
            Some(from) => action.apply(*from).map_err(OrderError::IllegalTransition),
        })
        .collect();
    let (mut change_ids, mut from, mut to) = (Vec::new(), Vec::new(), Vec::new());
    for ((id, _), target) in changes.iter().zip(&decided) {
        if let Ok(target) = target {
            change_ids.push(*id);
            from.push(status.get(id).map_or("", |s| s.as_str()));
            to.push(target.as_str());
        }
    }
    let mut changed: HashMap<Uuid, Order> = HashMap::with_capacity(change_ids.len());
    if !change_ids.is_empty() {
        let rows: Vec<OrderRow> = sqlx::query_as(
            "UPDATE orders o SET status = c.target, updated_at = clock_timestamp()
             FROM unnest($1::uuid[], $2::text[], $3::text[]) AS c(order_id, from_status, target)
             WHERE o.order_id = c.order_id AND o.status = c.from_status
             RETURNING o.order_id, o.customer_id, o.email, o.status, o.created_at, o.updated_at,
                       (SELECT COALESCE(array_agg(product_id ORDER BY line_no), '{}')
                        FROM order_line WHERE order_id = o.order_id),
                       (SELECT COALESCE(array_agg(quantity ORDER BY line_no), '{}')
                        FROM order_line WHERE order_id = o.order_id)",
        )
        .bind(&change_ids)
        .bind(&from)
        .bind(&to)
        .fetch_all(&mut **tx)
        .await?;
        for row in rows {
            let order = order_from_row(row)?;
            let _ = changed.insert(order.order_id, order);
        }
        // The rows are locked by this transaction: each allowed change must have been made.
        if changed.len() != change_ids.len() {
            return Err(OrderError::Database(sqlx::Error::Protocol(format!(
                "{} of {} locked orders changed",
                changed.len(),
                change_ids.len()
            ))));
        }
    }
    Ok(changes
        .iter()
        .zip(decided)
        .map(|((id, _), decided)| {
            decided.and_then(|_| changed.remove(id).ok_or(OrderError::NotFound(*id)))
        })
        .collect())
}
