//! The operations endpoint every binary serves: `/metrics`, `/healthz` and `/readyz`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio_util::sync::CancellationToken;

use crate::http_server::ServerLimits;

/// Answers whether the service can do its work now (database and broker reachable).
pub type ReadinessCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

#[derive(Clone)]
struct OpsState {
    registry: Registry,
    ready: ReadinessCheck,
}

/// Routes for the operations endpoint, to serve alone or merge into a service's router.
pub fn router(registry: Registry, ready: ReadinessCheck) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(OpsState { registry, ready })
}

/// Binds `addr` (port 0 picks a free port) and serves `router` until `shutdown`, within
/// `limits`. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    limits: &ServerLimits,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let bound = listener.local_addr()?;
    let limits = limits.clone();
    tokio::spawn(async move {
        crate::http_server::serve(listener, router, &limits, shutdown).await;
    });
    Ok(bound)
}

/// Serves a worker's ops endpoint on `addr` within `limits` until `shutdown`: `/metrics` from
/// `registry`, `/healthz`, and `/readyz` answering 200 while both `pool`'s database and `kafka`'s
/// brokers answer. Logs "`program` metrics listening on `address`" and returns the bound address.
pub async fn serve_worker(
    program: &str,
    addr: SocketAddr,
    limits: &ServerLimits,
    registry: Registry,
    pool: &sqlx::PgPool,
    kafka: &crate::kafka::KafkaArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let ready = all_ready(vec![database_ready(pool.clone()), kafka_ready(kafka)?]);
    let bound = serve(addr, router(registry, ready), limits, shutdown).await?;
    tracing::info!(addr = %bound, "{program} metrics listening on {bound}");
    Ok(bound)
}

async fn metrics(State(state): State<OpsState>) -> impl IntoResponse {
    let mut body = Vec::new();
    match TextEncoder::new().encode(&state.registry.gather(), &mut body) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn readyz(State(state): State<OpsState>) -> impl IntoResponse {
    match (state.ready)().await {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

/// A readiness check that pings the database.
pub fn database_ready(pool: sqlx::PgPool) -> ReadinessCheck {
    Arc::new(move || {
        let pool = pool.clone();
        Box::pin(async move {
            sqlx::query("SELECT 1")
                .execute(&pool)
                .await
                .map(|_| ())
                .map_err(|e| format!("database: {e}"))
        })
    })
}

/// A readiness check that asks the Kafka cluster for its broker list.
pub fn kafka_ready(kafka: &crate::kafka::KafkaArgs) -> anyhow::Result<ReadinessCheck> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: Arc<BaseConsumer> = Arc::new(
        kafka
            .client_config()
            .create()
            .context("creating Kafka client for readiness")?,
    );
    Ok(Arc::new(move || {
        let client = client.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                client
                    .fetch_metadata(None, std::time::Duration::from_secs(2))
                    .map_err(|e| format!("kafka: {e}"))
                    .and_then(|m| {
                        if m.brokers().is_empty() {
                            Err("kafka: no brokers".to_owned())
                        } else {
                            Ok(())
                        }
                    })
            })
            .await
            .map_err(|e| format!("kafka: {e}"))?
        })
    }))
}

/// Ready when every check is.
pub fn all_ready(checks: Vec<ReadinessCheck>) -> ReadinessCheck {
    let checks = Arc::new(checks);
    Arc::new(move || {
        let checks = checks.clone();
        Box::pin(async move {
            for check in checks.iter() {
                check().await?;
            }
            Ok(())
        })
    })
}
