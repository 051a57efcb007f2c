//! Request handlers: read and check the request, call the order domain, shape the answer.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use demo_events::order_events::ORDER_PLACED;
use pipeline_core::envelope::TRACEPARENT;
use uuid::Uuid;

use super::body::{ApiJson, NoBody};
use super::error::ApiError;
use super::state::AppState;
use crate::orders::Action;
use crate::validation::{
    check_publish_time, is_valid_traceparent, validate_idempotency_key, validate_order,
    CreateOrderRequest,
};

/// Header naming a create request, so that retries of it place one order.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// `POST /orders`
pub(super) async fn create_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<CreateOrderRequest>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let order = validate_order(request)?;
    if let Some(at) = order.payment_reminder_at {
        let horizon = chrono::Duration::from_std(state.orders.payment_reminders().horizon)
            .unwrap_or(chrono::Duration::MAX);
        check_publish_time("payment_reminder_at", at, chrono::Utc::now(), horizon)?;
    }
    let placed = state
        .orders
        .place(&order, key, traceparent(&headers))
        .await?;
    if placed.created {
        state.metrics.event_enqueued(ORDER_PLACED);
        tracing::debug!(order_id = %placed.order.order_id, "order placed");
        Ok((StatusCode::CREATED, Json(placed.order)).into_response())
    } else {
        Ok((StatusCode::OK, Json(placed.order)).into_response())
    }
}

/// `GET /orders/{id}`
pub(super) async fn get_order(
    State(state): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let order_id = order_id(id)?;
    match state.orders.get(order_id).await? {
        Some(order) => Ok(Json(order).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("order {order_id} not found"),
        )),
    }
}

/// `POST /orders/{id}/pay`
pub(super) async fn pay_order(
    state: State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    _: NoBody,
) -> Result<Response, ApiError> {
    transition(state, headers, id, Action::Pay).await
}

/// `POST /orders/{id}/cancel`
pub(super) async fn cancel_order(
    state: State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    _: NoBody,
) -> Result<Response, ApiError> {
    transition(state, headers, id, Action::Cancel).await
}

/// `POST /orders/{id}/ship`
pub(super) async fn ship_order(
    state: State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    _: NoBody,
) -> Result<Response, ApiError> {
    transition(state, headers, id, Action::Ship).await
}

async fn transition(
    State(state): State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    action: Action,
) -> Result<Response, ApiError> {
    let order_id = order_id(id)?;
    let order = state
        .orders
        .transition(order_id, action, traceparent(&headers))
        .await?;
    state.metrics.event_enqueued(action.target().event_type());
    tracing::debug!(%order_id, %action, "order changed");
    Ok(Json(order).into_response())
}

fn order_id(id: Result<Path<String>, PathRejection>) -> Result<Uuid, ApiError> {
    let Path(id) = id?;
    Uuid::parse_str(&id).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("order id `{}` is not a UUID", truncate(&id, 64)),
        )
    })
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let key = value.to_str().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "Idempotency-Key must be visible ASCII characters",
        )
    })?;
    validate_idempotency_key(key).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
    Ok(Some(key))
}

/// The request's W3C `traceparent`, when it has a well-formed one. A malformed one is ignored,
/// as the trace context recommendation says, rather than failing the request.
pub(super) fn traceparent(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(TRACEPARENT)?.to_str().ok()?;
    if is_valid_traceparent(value) {
        Some(value)
    } else {
        tracing::debug!("ignoring malformed traceparent header");
        None
    }
}

pub(super) fn truncate(s: &str, max_chars: usize) -> &str {
    s.char_indices().nth(max_chars).map_or(s, |(i, _)| &s[..i])
}
