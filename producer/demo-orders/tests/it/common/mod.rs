//! Shared set-up of the order service's integration tests.
//!
//! The tests run against the PostgreSQL server named by `DATABASE_URL`, e.g.
//! `DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo test --release -p demo-orders`.
//! `#[sqlx::test]` reads it at run time, creates a fresh database per test and applies the
//! workspace migrations to it, so tests run in parallel without seeing each other's rows.
//! Set `TEST_LOG=debug` (or any filter) to see the service's logs.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use demo_orders::orders::{OrderService, SharedTransactionMetrics, SharedTransactionSettings};
use pipeline_core::telemetry::{self, LogArgs};
use prometheus::Registry;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Topic the test services record on events.
pub const TOPIC: &str = "order-events-test";
/// Products seeded into every test database: sku-00001 … sku-00010.
pub const PRODUCTS: u32 = 10;
/// A well-formed W3C traceparent.
pub const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// An order service running in this process on a port of its own.
pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub http: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Logs to stderr when `TEST_LOG` is set, quiet otherwise.
pub fn init_test_log() {
    if let Ok(filter) = std::env::var("TEST_LOG") {
        telemetry::init(&LogArgs {
            log_json: false,
            log: filter,
        });
    }
}

/// The binary's default shared transactions: four at once, up to 64 changes each, a further one
/// started after waiting up to 1 ms for those running.
pub const SHARED_TRANSACTIONS: SharedTransactionSettings = SharedTransactionSettings {
    runners: 4,
    max_ops: 64,
    patience: Duration::from_millis(1),
};

/// An order service writing through `pool` with `shared` transactions (None: a transaction per
/// change), their metrics registered on `registry`.
pub fn order_service(
    pool: &PgPool,
    shared: Option<SharedTransactionSettings>,
    registry: &Registry,
) -> OrderService {
    let orders = OrderService::new(pool.clone(), TOPIC, false);
    match shared {
        Some(settings) => {
            let metrics = SharedTransactionMetrics::register(registry).expect("register metrics");
            orders.with_shared_transactions(settings, metrics)
        }
        None => orders,
    }
}

/// Seeds the catalogue and serves the order API on 127.0.0.1, port 0, with the binary's default
/// shared transactions.
pub async fn spawn_app(pool: PgPool) -> TestApp {
    init_test_log();
    demo_orders::catalog::seed_catalog(&pool, PRODUCTS)
        .await
        .expect("seed catalogue");
    let registry = Registry::new();
    let orders = order_service(&pool, Some(SHARED_TRANSACTIONS), &registry);
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
        http: reqwest::Client::new(),
        shutdown,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POSTs `body` as JSON with the extra `headers`; returns the status and the JSON answer.
    pub async fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = self.http.post(self.url(path)).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        answer(req.send().await.expect("send")).await
    }

    /// POSTs a raw body with the given content type.
    pub async fn post_raw(
        &self,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let mut req = self.http.post(self.url(path)).body(body);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        answer(req.send().await.expect("send")).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        answer(self.http.get(self.url(path)).send().await.expect("send")).await
    }

    /// Places a valid order and returns its id.
    pub async fn place_order(&self) -> String {
        let (status, order) = self.post("/orders", &valid_order(), &[]).await;
        assert_eq!(status, 201, "{order}");
        order["order_id"].as_str().expect("order_id").to_owned()
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

/// Status and JSON body of a response (Null when the body is not JSON).
pub async fn answer(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body = response.bytes().await.expect("read body");
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// A create request the service accepts.
pub fn valid_order() -> Value {
    json!({
        "customer_id": "customer-1",
        "email": "customer-1@example.com",
        "lines": [
            {"product_id": "sku-00001", "quantity": 2},
            {"product_id": "sku-00002", "quantity": 1}
        ]
    })
}

/// The outbox rows of one aggregate: (event_type, sequence, business_key, payload, headers).
pub async fn outbox_rows(
    pool: &PgPool,
    aggregate_id: &str,
) -> Vec<(String, i64, String, Value, Value)> {
    sqlx::query_as(
        "SELECT event_type, sequence, business_key, payload, headers
         FROM outbox WHERE aggregate_id = $1 ORDER BY sequence",
    )
    .bind(aggregate_id)
    .fetch_all(pool)
    .await
    .expect("read outbox")
}

/// Rows in every table of the test database, by table name: equal before and after a request
/// that wrote nothing anywhere.
pub async fn every_table_count(pool: &PgPool) -> std::collections::BTreeMap<String, i64> {
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_schema::text, table_name::text FROM information_schema.tables
         WHERE table_type = 'BASE TABLE'
           AND table_schema NOT IN ('pg_catalog', 'information_schema')",
    )
    .fetch_all(pool)
    .await
    .expect("list tables");
    let mut counts = std::collections::BTreeMap::new();
    for (schema, table) in tables {
        let (count,): (i64,) =
            sqlx::query_as(&format!("SELECT count(*) FROM \"{schema}\".\"{table}\""))
                .fetch_one(pool)
                .await
                .expect("count rows");
        let _ = counts.insert(format!("{schema}.{table}"), count);
    }
    counts
}

/// Sends each case's body with `send`; each must be refused with its status and a JSON error
/// containing its text, and no table may change. A case is (name, body, status, text).
pub async fn refused_without_writes<B, F, Fut>(
    pool: &PgPool,
    path: &str,
    cases: Vec<(&str, B, u16, &str)>,
    send: F,
) where
    F: Fn(B) -> Fut,
    Fut: std::future::Future<Output = (u16, serde_json::Value)>,
{
    let before = every_table_count(pool).await;
    for (name, body, expected, message) in cases {
        let (status, answer) = send(body).await;
        assert_eq!(status, expected, "{path} {name}: {answer}");
        let error = answer["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{path} {name}: no JSON error: {answer}"));
        assert!(
            error.contains(message),
            "{path} {name}: {error:?} does not mention {message:?}"
        );
        assert_eq!(
            every_table_count(pool).await,
            before,
            "{path} {name} wrote rows"
        );
    }
}
