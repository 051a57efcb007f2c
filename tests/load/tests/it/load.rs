//! The load generator against an in-process order service: the `load` command directly and
//! through a proxy that loses the first answer to every request, and the request pacing the
//! benchmark drives it with.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use common::{spawn_app, TestApp, PRODUCTS};
use pipeline_core::telemetry::LogArgs;
use pipeline_load::{
    self as load, drive, ClientSettings, DriveSettings, LoadArgs, OnStop, OrderClient, OrderPlan,
    Pacing, Recorder, RetryPolicy, StepRecord, Summary,
};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

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
        request_timeout: std::time::Duration::from_secs(10),
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn load_run_matches_the_outbox(pool: PgPool) {
    let app = spawn_app(pool).await;
    let dir = std::env::temp_dir().join(format!("pipeline-load-{}", uuid::Uuid::new_v4()));
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

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
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

/// Keeps every step the generator reports.
#[derive(Default)]
struct Steps(Vec<StepRecord>);

impl Recorder for Steps {
    fn record(&mut self, step: StepRecord) {
        self.0.push(step);
    }
}

/// Stops wanting orders once `enough` steps went through.
struct UpTo {
    enough: usize,
    steps: Steps,
}

impl Recorder for UpTo {
    fn record(&mut self, step: StepRecord) {
        self.steps.record(step);
    }

    fn wants_more(&self) -> bool {
        self.steps.0.iter().filter(|s| s.outcome.is_ok()).count() < self.enough
    }
}

fn client(url: &str, retry: RetryPolicy) -> OrderClient {
    let settings = ClientSettings {
        request_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        retry,
    };
    OrderClient::new(url.parse().expect("url"), settings).expect("client")
}

fn generator(pacing: Pacing, concurrency: usize, on_stop: OnStop) -> DriveSettings {
    DriveSettings {
        pacing,
        concurrency,
        key_prefix: "test".to_owned(),
        on_stop,
    }
}

/// Open-ended order pacing, as the verification run drives it.
fn open_ended(rate: f64) -> Pacing {
    Pacing::Orders {
        rate,
        orders: None,
        max_catch_up: Some(Duration::from_millis(200)),
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn request_pacing_sends_one_event_a_slot_and_each_orders_in_sequence(pool: PgPool) {
    const REQUESTS: u64 = 240;
    let app = spawn_app(pool).await;
    let pacing = Pacing::Requests {
        rate: 300.0,
        requests: REQUESTS,
        step_gap: Duration::from_millis(50),
    };
    let mut steps = Steps::default();
    let run = drive(
        &client(&app.url(""), RetryPolicy::attempts(0)),
        &generator(pacing, 64, OnStop::Finish),
        |index| OrderPlan::generate(5, index, PRODUCTS),
        &mut steps,
        &CancellationToken::new(),
    )
    .await
    .expect("run");
    assert_eq!((run.started, run.stopped), (REQUESTS, false));
    let steps = steps.0;
    assert_eq!(steps.len() as u64, REQUESTS, "one step a slot");
    let failed: Vec<_> = steps.iter().filter(|s| s.outcome.is_err()).collect();
    assert!(failed.is_empty(), "{failed:?}");
    // Every slot due at its own time of the timetable: start + slot / rate.
    let due: BTreeSet<_> = steps.iter().map(|s| s.due).collect();
    assert_eq!(due.len() as u64, REQUESTS);
    assert_eq!(due.first(), Some(&run.timetable.start()));
    assert_eq!(due.last().copied(), run.timetable.last_due());
    // The outbox holds exactly the events the steps made, each order's in sequence.
    let sent: BTreeSet<(String, i64, String)> = steps
        .iter()
        .map(|s| {
            let id = s.order_id.expect("placed orders have ids");
            (id.to_string(), s.sequence, s.event_type().to_owned())
        })
        .collect();
    let recorded: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT aggregate_id, sequence, event_type FROM outbox")
            .fetch_all(&app.pool)
            .await
            .expect("outbox");
    assert_eq!(recorded.len() as u64, REQUESTS);
    assert_eq!(recorded.into_iter().collect::<BTreeSet<_>>(), sent);
    let orders: HashSet<Uuid> = steps.iter().filter_map(|s| s.order_id).collect();
    let (in_database, _, _) = app.row_counts().await;
    assert_eq!(orders.len() as i64, in_database);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn an_open_ended_run_ends_when_the_recorder_has_enough_and_finishes_its_orders(pool: PgPool) {
    let app = spawn_app(pool).await;
    let mut recorder = UpTo {
        enough: 30,
        steps: Steps::default(),
    };
    let run = drive(
        &client(&app.url(""), RetryPolicy::attempts(0)),
        &generator(open_ended(200.0), 4, OnStop::Finish),
        |index| OrderPlan::generate(3, index, PRODUCTS),
        &mut recorder,
        &CancellationToken::new(),
    )
    .await
    .expect("run");
    assert!(!run.stopped);
    let steps = recorder.steps.0;
    assert!(steps.iter().filter(|s| s.outcome.is_ok()).count() >= 30);
    // Every order started was taken through all its steps, none cut off.
    let placed = steps.iter().filter(|s| s.sequence == 1).count() as u64;
    assert_eq!(placed, run.started);
    let events: u64 = steps
        .iter()
        .filter(|s| s.sequence == 1)
        .map(|s| OrderPlan::generate(3, s.order, PRODUCTS).fate.events())
        .sum();
    assert_eq!(steps.len() as u64, events);
    let (_, _, outbox) = app.row_counts().await;
    assert_eq!(outbox as usize, steps.len());
}

#[tokio::test]
async fn a_stopped_run_abandons_the_orders_still_retrying() {
    // A service that accepts connections and never answers: every attempt times out.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let _silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let stop = CancellationToken::new();
    let stopper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stop.cancel();
        })
    };
    let mut steps = Steps::default();
    let run = tokio::time::timeout(
        Duration::from_secs(5),
        drive(
            &client(
                &format!("http://{addr}"),
                RetryPolicy::for_at_most(Duration::from_secs(120)),
            ),
            &generator(open_ended(100.0), 4, OnStop::Abandon),
            |index| OrderPlan::generate(1, index, PRODUCTS),
            &mut steps,
            &stop,
        ),
    )
    .await
    .expect("returns once stopped, without waiting for the retries")
    .expect("run");
    stopper.await.expect("stopper");
    assert!(run.stopped);
    assert_eq!(run.started, 4, "as many orders as may be in flight");
    assert!(steps.0.is_empty(), "abandoned orders are not recorded");
}
