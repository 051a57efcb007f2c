//! The order service's HTTP API.
//!
//! | Route                      | Answer                                        |
//! |----------------------------|-----------------------------------------------|
//! | `POST /orders`             | 201 placed, 200 replayed (same key and body)  |
//! | `GET /orders/{id}`         | 200 order, 404                                |
//! | `POST /orders/{id}/pay`    | 200 order, 404, 409 when the lifecycle forbids, 400 for a body (none or `{}`) |
//! | `POST /orders/{id}/cancel` | same                                          |
//! | `POST /orders/{id}/ship`   | same                                          |
//! | `POST /exports`            | 202 pending export job, `Location` header      |
//! | `GET /exports/{id}`        | 200 export job, 404                           |
//! | `GET /exports/{id}/download` | 200 CSV file, 404, 409 not finished, 410 expired |
//!
//! A body, where a route takes one, is a single JSON object (`body::ApiJson`); every refusal is
//! `{"error": "..."}` with a 4xx or 5xx (`error`).

mod body;
mod error;
mod exports;
mod handlers;
mod metrics;
mod state;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;

pub use body::{ApiJson, MAX_BODY_BYTES};
pub use error::ApiError;
pub use exports::CHECKSUM_HEADER;
pub use handlers::IDEMPOTENCY_KEY;
pub use metrics::ApiMetrics;
pub use state::AppState;

/// The API routes, with request metrics, the body limit and JSON answers for unknown routes and
/// methods.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(handlers::create_order))
        .route("/orders/{id}", get(handlers::get_order))
        .route("/orders/{id}/pay", post(handlers::pay_order))
        .route("/orders/{id}/cancel", post(handlers::cancel_order))
        .route("/orders/{id}/ship", post(handlers::ship_order))
        .route("/exports", post(exports::submit_export))
        .route("/exports/{id}", get(exports::get_export))
        .route("/exports/{id}/download", get(exports::download_export))
        .route_layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            metrics::track_requests,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .with_state(state)
}
