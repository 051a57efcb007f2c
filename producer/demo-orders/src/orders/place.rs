//! Placing an order, idempotently when the client sends an `Idempotency-Key`.

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::error::OrderError;
use super::model::Order;
use super::store::fetch_order;
use crate::validation::ValidOrder;

type PlaceRow = (Option<DateTime<Utc>>, Option<DateTime<Utc>>, Vec<String>);

/// The result of [`OrderService::place`](super::OrderService::place).
#[derive(Debug, Clone)]
pub struct Placed {
    pub order: Order,
    /// False when the idempotency key named an order placed earlier by the same request: that
    /// order is returned and nothing was written.
    pub created: bool,
}

/// Places `order` inside `tx`: the order row and its lines. The caller records the event
/// (when `created`) and commits.
pub(super) async fn place_in(
    tx: &mut Transaction<'_, Postgres>,
    order: &ValidOrder,
    idempotency_key: Option<&str>,
) -> Result<Placed, OrderError> {
    let fingerprint = idempotency_key.map(|_| order.fingerprint());
    let order_id = Uuid::now_v7();

    let product_ids: Vec<&str> = order.lines.iter().map(|l| l.product_id.as_str()).collect();
    let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
    // One round trip: the order and its lines are written only when every product exists;
    // otherwise the unknown ones come back and nothing is written.
    let (created_at, updated_at, unknown): PlaceRow = sqlx::query_as(
        "WITH unknown AS (
             SELECT u.product_id, u.n FROM unnest($6::text[]) WITH ORDINALITY AS u(product_id, n)
             WHERE NOT EXISTS (SELECT 1 FROM product p WHERE p.product_id = u.product_id)),
         placed AS (
             INSERT INTO orders (order_id, customer_id, email, status, idempotency_key,
                                 request_hash)
             SELECT $1, $2, $3, 'placed', $4, $5 WHERE NOT EXISTS (SELECT 1 FROM unknown)
             ON CONFLICT (idempotency_key) DO NOTHING
             RETURNING created_at, updated_at),
         lines AS (
             INSERT INTO order_line (order_id, line_no, product_id, quantity)
             SELECT $1, u.n, u.product_id, u.quantity
             FROM unnest($6::text[], $7::int4[]) WITH ORDINALITY AS u(product_id, quantity, n)
             WHERE EXISTS (SELECT 1 FROM placed))
         SELECT (SELECT created_at FROM placed), (SELECT updated_at FROM placed),
                ARRAY(SELECT product_id FROM unknown ORDER BY n)",
    )
    .bind(order_id)
    .bind(&order.customer_id)
    .bind(&order.email)
    .bind(idempotency_key)
    .bind(&fingerprint)
    .bind(&product_ids)
    .bind(&quantities)
    .fetch_one(&mut **tx)
    .await?;

    let (Some(created_at), Some(updated_at)) = (created_at, updated_at) else {
        return not_placed(tx, idempotency_key, fingerprint.as_deref(), unknown).await;
    };

    Ok(Placed {
        order: placed_order(order_id, order, created_at, updated_at),
        created: true,
    })
}

/// Why a place was not written, or the order its idempotency key already names: the key is
/// taken (only a non-null key can conflict), or a product is unknown. Read committed: this
/// sees the row a conflicting transaction committed.
async fn not_placed(
    tx: &mut Transaction<'_, Postgres>,
    idempotency_key: Option<&str>,
    fingerprint: Option<&str>,
    unknown: Vec<String>,
) -> Result<Placed, OrderError> {
    let existing: Option<(Uuid, Option<String>)> = match idempotency_key {
        Some(key) => {
            sqlx::query_as("SELECT order_id, request_hash FROM orders WHERE idempotency_key = $1")
                .bind(key)
                .fetch_optional(&mut **tx)
                .await?
        }
        None => None,
    };
    let Some((existing_id, existing_hash)) = existing else {
        // Nothing was written.
        return Err(OrderError::UnknownProducts(unknown));
    };
    if existing_hash.as_deref() != fingerprint {
        return Err(OrderError::IdempotencyKeyReused);
    }
    let order = fetch_order(tx, existing_id)
        .await?
        .ok_or(OrderError::NotFound(existing_id))?;
    Ok(Placed {
        order,
        created: false,
    })
}

/// Places each `(order, idempotency key)` of `places` (distinct keys) inside `tx`, in one
/// statement whatever their number: every order whose products all exist is written with its
/// lines, in the order given (callers sort by key, so shared transactions cannot deadlock on
/// each other's keys). One answer per place, in the order given, each what [`place_in`] would
/// have answered; a refusal wrote nothing. The caller records the events and commits.
pub(super) async fn place_all_in(
    tx: &mut Transaction<'_, Postgres>,
    places: &[(&ValidOrder, Option<&str>)],
) -> Result<Vec<Result<Placed, OrderError>>, OrderError> {
    let order_ids: Vec<Uuid> = places.iter().map(|_| Uuid::now_v7()).collect();
    let fingerprints: Vec<Option<String>> = places
        .iter()
        .map(|(order, key)| key.map(|_| order.fingerprint()))
        .collect();
    let customers: Vec<&str> = places.iter().map(|(o, _)| o.customer_id.as_str()).collect();
    let emails: Vec<Option<&str>> = places.iter().map(|(o, _)| o.email.as_deref()).collect();
    let keys: Vec<Option<&str>> = places.iter().map(|(_, k)| *k).collect();
    let (mut line_of, mut line_no, mut products, mut quantities) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (n, (order, _)) in places.iter().enumerate() {
        for (i, line) in order.lines.iter().enumerate() {
            line_of.push(i64::try_from(n + 1).unwrap_or(i64::MAX));
            line_no.push(i32::try_from(i + 1).unwrap_or(i32::MAX));
            products.push(line.product_id.as_str());
            quantities.push(line.quantity);
        }
    }
    // Row n of the answer is place n: when it was written, and its unknown products.
    let rows: Vec<PlaceRow> = sqlx::query_as(
        "WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[])
                      WITH ORDINALITY AS i(order_id, customer_id, email, idempotency_key,
                                           request_hash, n)),
         lines_in AS (
             SELECT * FROM unnest($6::int8[], $7::int4[], $8::text[], $9::int4[])
                      AS l(n, line_no, product_id, quantity)),
         unknown AS (
             SELECT l.n, l.line_no, l.product_id FROM lines_in l
             WHERE NOT EXISTS (SELECT 1 FROM product p WHERE p.product_id = l.product_id)),
         placed AS (
             INSERT INTO orders (order_id, customer_id, email, status, idempotency_key,
                                 request_hash)
             SELECT i.order_id, i.customer_id, i.email, 'placed', i.idempotency_key,
                    i.request_hash
             FROM input i
             WHERE NOT EXISTS (SELECT 1 FROM unknown u WHERE u.n = i.n)
             ORDER BY i.n
             ON CONFLICT (idempotency_key) DO NOTHING
             RETURNING order_id, created_at, updated_at),
         lines AS (
             INSERT INTO order_line (order_id, line_no, product_id, quantity)
             SELECT i.order_id, l.line_no, l.product_id, l.quantity
             FROM lines_in l JOIN input i ON i.n = l.n
             WHERE EXISTS (SELECT 1 FROM placed p WHERE p.order_id = i.order_id))
         SELECT p.created_at, p.updated_at,
                ARRAY(SELECT u.product_id FROM unknown u WHERE u.n = i.n ORDER BY u.line_no)
         FROM input i LEFT JOIN placed p ON p.order_id = i.order_id
         ORDER BY i.n",
    )
    .bind(&order_ids)
    .bind(&customers)
    .bind(&emails)
    .bind(&keys)
    .bind(&fingerprints)
    .bind(&line_of)
    .bind(&line_no)
    .bind(&products)
    .bind(&quantities)
    .fetch_all(&mut **tx)
    .await?;
    if rows.len() != places.len() {
        return Err(OrderError::Database(sqlx::Error::Protocol(format!(
            "{} answers for {} places",
            rows.len(),
            places.len()
        ))));
    }
    let mut answers = Vec::with_capacity(places.len());
    for ((((order, key), order_id), fingerprint), row) in
        places.iter().zip(order_ids).zip(&fingerprints).zip(rows)
    {
        answers.push(match row {
            (Some(created_at), Some(updated_at), _) => Ok(Placed {
                order: placed_order(order_id, order, created_at, updated_at),
                created: true,
            }),
            (_, _, unknown) => match not_placed(tx, *key, fingerprint.as_deref(), unknown).await {
                Err(e) if !e.wrote_nothing() => return Err(e),
                answer => answer,
            },
        });
    }
    Ok(answers)
}

/// The order a place wrote.
fn placed_order(
    order_id: Uuid,
    order: &ValidOrder,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
) -> Order {
    Order {
        order_id,
        customer_id: order.customer_id.clone(),
        email: order.email.clone(),
        status: demo_events::order_events::OrderStatus::Placed,
        lines: order.lines.clone(),
        created_at,
        updated_at,
        payment_reminder_at: order.payment_reminder_at,
    }
}
