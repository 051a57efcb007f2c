//! The order service the load tests drive: the real one (`demo-orders`), in this process, on a
//! port of its own.
//!
//! The tests run against the PostgreSQL server named by `DATABASE_URL`, e.g.
//! `DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo test --release -p pipeline-load`.
//! `#[sqlx::test]` creates a fresh database per test and applies the demonstration's migrations
//! to it. Set `TEST_LOG=debug` (or any filter) to see the service's logs.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use demo_orders::orders::{OrderService, SharedTransactionMetrics, SharedTransactionSettings};
use pipeline_core::telemetry::{self, LogArgs};
use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Topic the test services record on events.
pub const TOPIC: &str = "order-events-test";
/// Products seeded into every test database: sku-00001 … sku-00010.
pub const PRODUCTS: u32 = 10;

/// An order service running in this process.
pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    shutdown: CancellationToken,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Seeds the catalogue and serves the order API on 127.0.0.1, port 0, with the binary's default
/// shared transactions: four at once, up to 64 changes each.
pub async fn spawn_app(pool: PgPool) -> TestApp {
    if let Ok(filter) = std::env::var("TEST_LOG") {
        telemetry::init(&LogArgs {
            log_json: false,
            log: filter,
        });
    }
    demo_orders::catalog::seed_catalog(&pool, PRODUCTS)
        .await
        .expect("seed catalogue");
    let registry = Registry::new();
    let settings = SharedTransactionSettings {
        runners: 4,
        max_ops: 64,
        patience: Duration::from_millis(1),
    };
    let metrics = SharedTransactionMetrics::register(&registry).expect("register metrics");
    let orders =
        OrderService::new(pool.clone(), TOPIC, false).with_shared_transactions(settings, metrics);
    let app = demo_orders::server::app(orders, registry).expect("build app");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind port 0");
    let addr = listener.local_addr().expect("bound address");
    let shutdown = CancellationToken::new();
    let _server = tokio::spawn(demo_orders::server::serve(
        listener,
        app,
        &demo_orders::server::API_LIMITS,
        shutdown.clone(),
        Duration::from_secs(5),
    ));
    TestApp {
        addr,
        pool,
        shutdown,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Rows in `orders`, `order_line` and `outbox`.
    pub async fn row_counts(&self) -> (i64, i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM order_line),
                    (SELECT count(*) FROM outbox)",
        )
        .fetch_one(&self.pool)
        .await
        .expect("count rows")
    }
}
