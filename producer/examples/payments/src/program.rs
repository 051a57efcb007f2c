//! The example's program: its own pool (with the sessions the consumer runtime needs), its own
//! tables, its own Prometheus registry served on its own `/metrics` route, and the `shipping`
//! group run by the consumer runtime on them.

use std::net::SocketAddr;

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use consumer::{ConsumerSettings, Groups, Runtime};
use pipeline_core::db::DbArgs;
use prometheus::{Encoder, Registry, TextEncoder};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::shipping::Shipping;

/// What the program needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The service's database; with `migrate`, the program sets up its tables at start-up.
    pub db: DbArgs,
    /// The consumer runtime's settings (the topics at least).
    pub consumer: ConsumerSettings,
    /// Where `/metrics` is served (port 0 picks one).
    pub metrics_listen: SocketAddr,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            db: DbArgs::default(),
            consumer: ConsumerSettings {
                groups: vec!["shipping".to_owned()],
                ..ConsumerSettings::default()
            },
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9200)),
        }
    }
}

/// The groups this program runs.
pub fn groups() -> Groups {
    Groups::new().register("shipping", Shipping::new)
}

/// The tables the program uses: the outbox's, the consumer library's and its own; nothing else.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    outbox::MIGRATOR
        .run(pool)
        .await
        .context("the outbox's tables")?;
    consumer::MIGRATOR
        .run(pool)
        .await
        .context("the consumer library's tables")?;
    crate::MIGRATOR
        .run(pool)
        .await
        .context("the example's tables")?;
    Ok(())
}

/// The running program.
pub struct Program {
    /// Where `/metrics` is served.
    pub metrics_addr: SocketAddr,
    runtime: Runtime,
}

impl Program {
    /// Waits until the group has stopped (after `shutdown`, or on a fatal error).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.runtime.wait().await
    }
}

/// Starts the program: the pool, the tables (when `config.db.migrate`), the registry, the group
/// on the consumer runtime, then `/metrics`; everything stops on `shutdown`.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Program> {
    let pool = consumer::connect(&config.db, &config.consumer).await?;
    if config.db.migrate {
        migrate(&pool).await?;
    }
    let registry = Registry::new();
    let runtime = Runtime::start(
        config.consumer,
        pool,
        &registry,
        &groups(),
        shutdown.clone(),
    )
    .await?;
    let metrics_addr = serve_metrics(config.metrics_listen, registry, shutdown).await?;
    tracing::info!(%metrics_addr, "payments example metrics listening on {metrics_addr}");
    Ok(Program {
        metrics_addr,
        runtime,
    })
}

/// [`start`], then [`Program::wait`].
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    start(config, shutdown).await?.wait().await
}

/// Serves `registry` on `GET /metrics` at `addr` until `shutdown`; returns the bound address.
async fn serve_metrics(
    addr: SocketAddr,
    registry: Registry,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry);
    tokio::spawn(async move {
        let limits = pipeline_core::http_server::ServerLimits::default();
        pipeline_core::http_server::serve(listener, app, &limits, shutdown).await;
    });
    Ok(bound)
}

async fn metrics(State(registry): State<Registry>) -> impl IntoResponse {
    let mut body = Vec::new();
    match TextEncoder::new().encode(&registry.gather(), &mut body) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
