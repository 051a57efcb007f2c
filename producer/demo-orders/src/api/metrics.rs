//! The order service's Prometheus metrics, registered on a registry the caller owns.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{
    register_histogram_vec_with_registry, register_int_counter_vec_with_registry, HistogramOpts,
    HistogramVec, IntCounterVec, Opts, Registry,
};

/// Request and event counters of the order API.
#[derive(Debug, Clone)]
pub struct ApiMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    events: IntCounterVec,
}

impl ApiMetrics {
    /// Creates the metrics and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let requests = register_int_counter_vec_with_registry!(
            Opts::new(
                "order_requests_total",
                "Order API requests answered, by route template and status code.",
            ),
            &["route", "status"],
            registry
        )?;
        let duration = register_histogram_vec_with_registry!(
            HistogramOpts::new(
                "order_request_duration_seconds",
                "Order API request latency, by route template.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["route"],
            registry
        )?;
        let events = register_int_counter_vec_with_registry!(
            Opts::new(
                "order_events_enqueued_total",
                "Order events committed to the outbox, by event type.",
            ),
            &["event_type"],
            registry
        )?;
        Ok(Self {
            requests,
            duration,
            events,
        })
    }

    /// Counts one event committed to the outbox.
    pub fn event_enqueued(&self, event_type: &str) {
        self.events.with_label_values(&[event_type]).inc();
    }

    fn request_done(&self, route: &str, status: u16, seconds: f64) {
        self.requests
            .with_label_values(&[route, &status.to_string()])
            .inc();
        self.duration.with_label_values(&[route]).observe(seconds);
    }
}

/// Middleware timing and counting each request under its route template, so that label values
/// stay bounded whatever ids clients send.
pub(super) async fn track_requests(
    State(metrics): State<Arc<ApiMetrics>>,
    req: Request,
    next: Next,
) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let started = Instant::now();
    let response = next.run(req).await;
    metrics.request_done(
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}
