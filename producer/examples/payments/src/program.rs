//! The example's program: its own pool (with the sessions the consumer runtime needs), its own
//! tables, its own Prometheus registry, its own HTTP router with the libraries' `/metrics`,
//! `/healthz` and `/readyz` merged in, the `shipping` group run by the consumer runtime and,
//! when configured, the relay and the operator's web console (nested in the router under a
//! prefix of the program's choosing), all in one process.

use std::net::SocketAddr;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use consumer::{ConsumerSettings, Groups, Runtime};
use operator::args::TargetArgs;
use operator::console::users::{Secret, Users};
use operator::console::{Console, ConsoleSettings};
use operator::targets::Targets;
use pipeline_core::db::DbArgs;
use pipeline_core::http_server::{self, ServerLimits};
use pipeline_core::ops_http;
use prometheus::Registry;
use relay::{Relay, RelaySettings};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::shipping::Shipping;

/// What the program needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The service's database; with `migrate`, the program sets up its tables at start-up.
    pub db: DbArgs,
    /// The consumer runtime's settings (the topics at least).
    pub consumer: ConsumerSettings,
    /// When set, the program also runs a relay on its database: one relay of all the processes
    /// running it is active, the others stand by. `None`: the `relay` binary runs beside it.
    pub relay: Option<RelaySettings>,
    /// Where the program's HTTP router is served (port 0 picks one).
    pub listen: SocketAddr,
    /// When set, the operator's web console is part of the program's router, under
    /// `settings.prefix`.
    pub console: Option<ConsoleConfig>,
}

/// The operator's web console in the program: who may log in and its settings.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// The users, one `name:role:hash` a line, as `pipeline console --users` takes them.
    pub users: Secret,
    /// Its settings; `prefix` is the path the program mounts it at (`/ops/console`).
    pub settings: ConsoleSettings,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            db: DbArgs::default(),
            consumer: ConsumerSettings {
                groups: vec!["shipping".to_owned()],
                ..ConsumerSettings::default()
            },
            relay: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 9200)),
            console: None,
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
    /// Where the program's router (`/payments/{id}`, `/metrics`, `/healthz`, `/readyz`) is
    /// served.
    pub addr: SocketAddr,
    runtime: Runtime,
    relay: Option<JoinHandle<Result<(), relay::RelayError>>>,
}

impl Program {
    /// Waits until the group and the relay have stopped (after `shutdown`, or on a fatal error
    /// of either); the first error is returned.
    pub async fn wait(self) -> anyhow::Result<()> {
        let runtime = self.runtime.wait().await.map_err(anyhow::Error::from);
        let relay = match self.relay {
            Some(relay) => relay.await.context("the relay's task")?,
            None => Ok(()),
        };
        runtime.and(relay.map_err(anyhow::Error::from))
    }
}

/// Starts the program: the pool, the tables (when `config.db.migrate`), the registry, the group
/// on the consumer runtime, the relay (when `config.relay` is set), then the HTTP router;
/// everything stops on `shutdown`.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Program> {
    let pool = consumer::connect(&config.db, &config.consumer).await?;
    if config.db.migrate {
        migrate(&pool).await?;
    }
    let registry = Registry::new();
    let ready = ops_http::all_ready(vec![
        ops_http::database_ready(pool.clone()),
        ops_http::kafka_ready(&config.consumer.kafka)?,
    ]);
    let console = match &config.console {
        Some(console) => Some(console_of(console, &config)?),
        None => None,
    };
    let relay = match config.relay {
        Some(settings) => {
            // The relay's own pool: its sessions carry the relay's statement timeouts.
            let relay_pool = relay::connect(&config.db, &settings).await?;
            let relay = Relay::new(settings, relay_pool, &registry)?;
            Some(tokio::spawn(relay.run(shutdown.clone())))
        }
        None => None,
    };
    let runtime = Runtime::start(
        config.consumer,
        pool.clone(),
        &registry,
        &groups(),
        shutdown.clone(),
    )
    .await?;
    // The program's own routes, with the libraries' operations endpoint merged in, and the
    // console's nested under its prefix (its pages link under it).
    let mut app = Router::new()
        .route("/payments/{id}", get(payment))
        .with_state(pool)
        .merge(ops_http::router(registry, ready));
    if let Some((console, prefix)) = console {
        app = app.nest(&prefix, console.router());
        // The overview's status readings, until shutdown.
        let shutdown = shutdown.clone();
        tokio::spawn(async move { console.sample_until(shutdown).await });
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        http_server::serve(listener, app, &ServerLimits::default(), shutdown).await;
    });
    tracing::info!(%addr, "payments example listening on {addr}");
    Ok(Program {
        addr,
        runtime,
        relay,
    })
}

/// The console over the program's database, groups and cluster, and the prefix to nest it at.
fn console_of(console: &ConsoleConfig, config: &Config) -> anyhow::Result<(Console, String)> {
    let prefix = console.settings.prefix.clone();
    anyhow::ensure!(
        !prefix.is_empty(),
        "the console needs a prefix in the program's router (`/ops/console`)"
    );
    let users = Users::parse(console.users.expose()).context("the console's users")?;
    let targets = Targets::new(
        TargetArgs {
            database_url: config.db.database_url.clone(),
            group_databases: Vec::new(),
            groups: Vec::new(),
            group_prefix: config.consumer.group_prefix.clone(),
            topics: config.consumer.topics.clone(),
            kafka: config.consumer.kafka.clone(),
        },
        &groups(),
    );
    let console = Console::new(targets, groups(), users, console.settings.clone())?;
    Ok((console, prefix))
}

/// [`start`], then [`Program::wait`].
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    start(config, shutdown).await?.wait().await
}

/// `GET /payments/{id}`: the payment's amount and status, 404 for an unknown one.
async fn payment(State(pool): State<PgPool>, Path(id): Path<String>) -> impl IntoResponse {
    let found: Result<Option<(i64, String)>, sqlx::Error> =
        sqlx::query_as("SELECT amount_cents, status FROM payment WHERE payment_id = $1")
            .bind(&id)
            .fetch_optional(&pool)
            .await;
    match found {
        Ok(Some((amount_cents, status))) => Json(serde_json::json!({
            "payment_id": id, "amount_cents": amount_cents, "status": status,
        }))
        .into_response(),
        Ok(None) => (StatusCode::NOT_FOUND, "no such payment").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "reading a payment failed");
            (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
        }
    }
}
