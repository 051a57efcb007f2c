//! The load driver against an in-process order service, directly and through a proxy that
//! loses the first answer to every request.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use common::{spawn_app, TestApp, PRODUCTS};
use pipeline_core::telemetry::LogArgs;
use producer::load::{self, LoadArgs, Summary};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

fn args(url: &str, orders: u64, summary_json: Option<std::path::PathBuf>) -> LoadArgs {
    LoadArgs {
        url: url.parse().expect("url"),
        orders,
        rate: 0.0,
        concurrency: 8,
        products: PRODUCTS,
        seed: Some(11),
        summary_json,
        max_retries: 3,
        request_timeout_ms: 10_000,
        log: LogArgs {
            log_json: false,
            log: "info".into(),
        },
    }
}

async fn assert_matches_database(app: &TestApp, summary: &Summary) {
    let (orders, _, outbox) = app.row_counts().await;
    assert_eq!(summary.orders, u64::try_from(orders).expect("count"));
    assert_eq!(summary.events, u64::try_from(outbox).expect("count"));
    let bad: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders o
         WHERE (SELECT count(*) FROM outbox WHERE aggregate_id = o.order_id::text)
               NOT IN (2, 3)",
    )
    .fetch_one(&app.pool)
    .await
    .expect("count");
    assert_eq!(bad, 0, "every order yields 2 or 3 events");
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn load_run_matches_the_outbox(pool: PgPool) {
    let app = spawn_app(pool).await;
    let dir = std::env::temp_dir().join(format!("producer-load-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("summary.json");
    let summary = load::run(
        args(&app.url(""), 60, Some(json_path.clone())),
        CancellationToken::new(),
    )
    .await
    .expect("load run");
    assert!(summary.succeeded(), "{summary}");
    assert_eq!((summary.orders, summary.errors), (60, 0));
    assert!(summary.events >= 120 && summary.events <= 180, "{summary}");
    assert_matches_database(&app, &summary).await;

    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).expect("summary file")).expect("JSON");
    assert_eq!(written["orders"], 60);
    assert_eq!(written["events"], summary.events);
    assert_eq!(written["errors"], 0);
    assert!(written["elapsed_seconds"].is_f64());
    std::fs::remove_dir_all(dir).expect("clean up");
}

/// Forwards every request to the order service, but answers 503 the first time it sees each
/// (path, idempotency key): the service did the work, the client never heard.
#[derive(Clone)]
struct LossyProxy {
    upstream: String,
    http: reqwest::Client,
    seen: Arc<Mutex<HashSet<String>>>,
}

async fn forward(
    State(proxy): State<LossyProxy>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let upstream = proxy
        .http
        .request(method, format!("{}{uri}", proxy.upstream))
        .headers(headers.clone())
        .body(body)
        .send()
        .await
        .expect("upstream");
    let status = upstream.status();
    let body = upstream.bytes().await.expect("upstream body");
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let first_time = proxy
        .seen
        .lock()
        .expect("lock")
        .insert(format!("{} {key}", uri.path()));
    if first_time {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    (status, [("content-type", "application/json")], body).into_response()
}

#[sqlx::test(migrator = "pipeline_core::db::MIGRATOR")]
async fn lost_answers_are_retried_without_double_effects(pool: PgPool) {
    let app = spawn_app(pool).await;
    let proxy = LossyProxy {
        upstream: app.url(""),
        http: reqwest::Client::new(),
        seen: Arc::default(),
    };
    let router = axum::Router::new().fallback(forward).with_state(proxy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let _proxy = tokio::spawn(async move { axum::serve(listener, router).await });

    let summary = load::run(
        args(&format!("http://{addr}"), 30, None),
        CancellationToken::new(),
    )
    .await
    .expect("load run");
    assert!(summary.succeeded(), "{summary}");
    assert_eq!(summary.orders, 30);
    // Every request was answered 503 once and retried once.
    assert!(summary.retries >= summary.events, "{summary}");
    assert_matches_database(&app, &summary).await;
}
