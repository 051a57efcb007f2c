//! `producer serve`: the order API and the operations endpoints on one listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use demo_events::order_events::ORDER_EVENTS_TOPIC;
use pipeline_core::db::{DbArgs, Planner};
use pipeline_core::http_server::ServerLimits;
use pipeline_core::ops_http;
use pipeline_core::telemetry::LogArgs;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiMetrics, AppState};
use crate::exports::{ExportService, ExportSettings};
use crate::orders::{
    OrderService, PaymentReminders, SharedTransactionMetrics, SharedTransactionSettings,
};

/// `producer serve`: run the order service.
///
/// The API's clients are other services, often behind one load balancer's address, and a shared
/// transaction takes many requests at once, so its HTTP bounds default to those of a busy service:
/// 8,192 connections, from one address too, and 8,192 requests in flight.
#[derive(clap::Args, Debug)]
#[command(
    mut_arg("max_connections", |a| a.default_value(API_MAX_CONNECTIONS)),
    mut_arg("max_connections_per_client", |a| a.default_value(API_MAX_CONNECTIONS)),
    mut_arg("max_requests_in_flight", |a| a.default_value(API_MAX_CONNECTIONS)),
)]
pub struct ServeArgs {
    /// Address to listen on for the API and /metrics, /healthz, /readyz (port 0 picks one).
    #[arg(long, env = "ORDER_SERVICE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Kafka topic recorded on every order event.
    #[arg(long, env = "ORDER_EVENTS_TOPIC", default_value = ORDER_EVENTS_TOPIC,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub topic: String,
    /// Also NOTIFY the relay in every transaction that enqueues an event (true/false).
    #[arg(long, env = "OUTBOX_NOTIFY", default_value_t = false,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub notify_relay: bool,
    /// Order-service transactions shared by changes requested at the same time that run at
    /// once; 0 writes every change in a transaction of its own.
    #[arg(long, env = "ORDER_SHARED_TRANSACTIONS", default_value_t = 4)]
    pub shared_transactions: usize,
    /// Most changes written in one shared transaction.
    #[arg(long, env = "ORDER_SHARED_TRANSACTION_MAX", default_value_t = 64,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub shared_transaction_max: u16,
    /// How long changes wait for the shared transaction being written to finish before another
    /// starts beside it; what arrives meanwhile shares the next one. 0: a free runner starts a
    /// transaction at once.
    #[arg(
        long,
        env = "ORDER_SHARED_TRANSACTION_PATIENCE",
        default_value = "1ms",
        value_parser = humantime::parse_duration
    )]
    pub shared_transaction_patience: Duration,
    /// How long after placing an unpaid order's `order.payment_reminder` is published (a
    /// delayed event, withdrawn when the order is paid or cancelled first); 0: only orders whose
    /// request names `payment_reminder_at` get one.
    #[arg(long, env = "PAYMENT_REMINDER_AFTER", default_value = "30m",
          value_parser = humantime::parse_duration)]
    pub payment_reminder_after: Duration,
    /// Latest `payment_reminder_at` a request may ask for, from now; later is refused with 422.
    /// Must be positive.
    #[arg(long, env = "DELAY_HORIZON", default_value = "30days",
          value_parser = humantime::parse_duration)]
    pub delay_horizon: Duration,
    /// A cron expression (five fields, or six with seconds first) for the digest schedule: at
    /// start the service adds the recurring schedule `daily-digest` (unless it exists), whose
    /// every occurrence publishes a `digest.daily` event that the notification group turns
    /// into a digest for the operations team. Empty: no schedule added.
    #[arg(long, env = "ORDER_DIGEST_SCHEDULE", default_value = "")]
    pub digest_schedule: String,
    /// The time zone the digest schedule is read in.
    #[arg(long, env = "ORDER_DIGEST_TIME_ZONE", default_value = "UTC")]
    pub digest_time_zone: String,
    /// How long in-flight requests may take to finish after SIGTERM/SIGINT.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "10s",
          value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,
    /// The bounds the API holds its clients to (`--http-…`).
    #[command(flatten)]
    pub http: ServerLimits,
    /// Export jobs: the export files' directory and the export topic.
    #[command(flatten)]
    pub exports: ExportSettings,
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The whole HTTP surface: the order API merged with `/metrics`, `/healthz` and `/readyz`, with
/// the default export settings.
pub fn app(orders: OrderService, registry: Registry) -> anyhow::Result<Router> {
    let exports = ExportService::new(orders.pool().clone(), ExportSettings::default());
    app_with_exports(orders, exports, registry)
}

/// [`app`], exports served by `exports`.
pub fn app_with_exports(
    orders: OrderService,
    exports: ExportService,
    registry: Registry,
) -> anyhow::Result<Router> {
    let metrics = ApiMetrics::register(&registry).context("registering metrics")?;
    let ready = ops_http::database_ready(orders.pool().clone());
    let state = AppState {
        orders,
        exports,
        metrics: Arc::new(metrics),
    };
    Ok(api::router(state).merge(ops_http::router(registry, ready)))
}

/// The API's default cap on connections (per client address too) and on requests in flight, as
/// `producer serve`'s flags take it.
const API_MAX_CONNECTIONS: &str = "8192";

/// The API's default bounds: `producer serve`'s without `--http-…` flags.
pub const API_LIMITS: ServerLimits = ServerLimits {
    header_read_timeout: Duration::from_secs(10),
    request_timeout: Duration::from_secs(30),
    max_connections: 8_192,
    max_connections_per_client: 8_192,
    max_requests_in_flight: 8_192,
};

/// Serves `app` on `listener` within `limits` until `shutdown`, then gives in-flight requests up
/// to `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &ServerLimits,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let server = pipeline_core::http_server::serve(listener, app, limits, shutdown.clone());
    let grace_over = async {
        shutdown.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        () = server => {}
        () = grace_over => {
            tracing::warn!(?grace, "shutdown grace period over, dropping open connections");
        }
    }
}

/// Adds the digest schedule (`--digest-schedule`) unless one of its name exists; a bad
/// expression or time zone stops the service with the reason.
async fn add_digest_schedule(pool: &sqlx::PgPool, args: &ServeArgs) -> anyhow::Result<()> {
    use demo_events::order_events::{DAILY_DIGEST, DIGEST_AGGREGATE, DIGEST_SCHEDULE};
    use outbox::schedule::{add_schedule, Missed, NewSchedule, ScheduleError};
    let schedule = NewSchedule {
        name: DIGEST_SCHEDULE.to_owned(),
        cron: args.digest_schedule.clone(),
        time_zone: args.digest_time_zone.clone(),
        event_type: DAILY_DIGEST.to_owned(),
        aggregate_id: DIGEST_AGGREGATE.to_owned(),
        topic: args.topic.clone(),
        payload: serde_json::json!({
            "digest": "{{schedule}}", "fire_at": "{{fire_at}}", "local_time": "{{local_time}}"
        }),
        missed: Missed::Latest,
    };
    let mut tx = pool.begin().await?;
    match add_schedule(&mut tx, &outbox::Outbox::default(), &schedule).await {
        Ok(row) => {
            tx.commit().await?;
            tracing::info!(schedule = DIGEST_SCHEDULE, cron = %row.cron, time_zone = %row.time_zone,
                           next = ?row.next_fire_at, "digest schedule added");
        }
        Err(ScheduleError::Duplicate(_)) => {
            tracing::info!(
                schedule = DIGEST_SCHEDULE,
                "digest schedule already there; kept as it is"
            );
        }
        Err(e) => return Err(e).context("--digest-schedule"),
    }
    Ok(())
}

/// Runs `producer serve` until `shutdown`.
pub async fn run(args: ServeArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    tracing::info!(?args, "starting order service");
    anyhow::ensure!(
        !args.delay_horizon.is_zero(),
        "--delay-horizon must be positive"
    );
    let pool = tokio::select! {
        pool = args.db.connect_session(None, Planner::KeyLookups, &crate::SCHEMA) => pool?,
        () = shutdown.cancelled() => {
            tracing::info!("stopped while connecting to the database");
            return Ok(());
        }
    };
    if !args.digest_schedule.trim().is_empty() {
        add_digest_schedule(&pool, &args).await?;
    }
    let registry = Registry::new();
    let reminders = PaymentReminders {
        after: (!args.payment_reminder_after.is_zero()).then_some(args.payment_reminder_after),
        horizon: args.delay_horizon,
    };
    let mut orders = OrderService::new(pool.clone(), args.topic.as_str(), args.notify_relay)
        .with_payment_reminders(reminders);
    if args.shared_transactions > 0 {
        let settings = SharedTransactionSettings {
            runners: args.shared_transactions,
            max_ops: usize::from(args.shared_transaction_max),
            patience: args.shared_transaction_patience,
        };
        let metrics =
            SharedTransactionMetrics::register(&registry).context("registering metrics")?;
        orders = orders.with_shared_transactions(settings, metrics);
    }
    let exports = ExportService::new(pool.clone(), args.exports.clone());
    let app = app_with_exports(orders, exports, registry)?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    // Tests and scripts read the port from this exact phrase.
    tracing::info!("order service listening on {addr}");
    let grace = args.shutdown_grace;
    serve(listener, app, &args.http, shutdown, grace).await;
    // The shared-transaction runners return their sessions to the pool when the last handle of
    // the service goes, which a connection still open past the grace period may hold: the
    // pool's close waits for them only so long.
    if tokio::time::timeout(POOL_CLOSE_WAIT, pool.close())
        .await
        .is_err()
    {
        tracing::warn!("sessions still in use {POOL_CLOSE_WAIT:?} after the server stopped");
    }
    tracing::info!("order service stopped");
    Ok(())
}

/// How long the order service waits, once its server stopped, for its sessions to come back.
const POOL_CLOSE_WAIT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn the_api_limits_are_the_flags_defaults() {
        let command = Command::try_parse_from(["producer"]).expect("defaults parse");
        assert_eq!(command.serve.http, API_LIMITS);
        let command =
            Command::try_parse_from(["producer", "--http-max-connections-per-client", "8"])
                .expect("a flag parses");
        assert_eq!(command.serve.http.max_connections_per_client, 8);
    }
}
