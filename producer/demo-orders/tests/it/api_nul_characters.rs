//! What PostgreSQL or Kafka would refuse later is refused at the door: a NUL character (U+0000)
//! anywhere in a request body, and header values the service stores or copies into event
//! headers that are not what they should be. Each refusal is a 4xx naming the problem and writes
//! nothing. Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use std::time::Duration;

use common::{every_table_count, outbox_rows, spawn_app, valid_order, TestApp, TRACEPARENT};
use reqwest::header::HeaderValue;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const JSON: Option<&str> = Some("application/json");

/// `valid_order()` with `value` at the JSON pointer `pointer` (created when absent).
fn order_with(pointer: &str, value: Value) -> Value {
    let mut order = valid_order();
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
    let target = order.pointer_mut(parent).expect("parent exists");
    match target {
        Value::Array(items) => items[key.parse::<usize>().expect("index")] = value,
        _ => target[key] = value,
    }
    order
}

/// POSTs each body with `headers`; each must be refused with `expected` and a message containing
/// its text, and no table may change.
async fn refused_without_writes(
    app: &TestApp,
    path: &str,
    headers: &[(&str, &str)],
    cases: Vec<(&str, Value, u16, &str)>,
) {
    common::refused_without_writes(&app.pool, path, cases, |body| async move {
        app.post(path, &body, headers).await
    })
    .await;
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn nul_in_an_order_is_refused_wherever_it_is(pool: PgPool) {
    let app = spawn_app(pool).await;
    let reminder_at = (chrono::Utc::now() + chrono::Duration::hours(1))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let nul = |field: &'static str| -> &'static str {
        // Leaked: a handful of short strings, for the life of the test.
        Box::leak(format!("{field} must not contain NUL characters (\\u0000)").into_boxed_str())
    };
    let cases = vec![
        (
            "customer id",
            order_with("/customer_id", json!("customer\u{0}-1")),
            422,
            nul("customer_id"),
        ),
        (
            "customer id that is only NUL",
            order_with("/customer_id", json!("\u{0}")),
            422,
            nul("customer_id"),
        ),
        (
            "email",
            order_with("/email", json!("customer-1@example.com\u{0}")),
            422,
            nul("email"),
        ),
        (
            "product id",
            order_with("/lines/1/product_id", json!("sku-00002\u{0}")),
            422,
            nul("lines[1].product_id"),
        ),
        (
            "payment reminder time",
            order_with("/payment_reminder_at", json!(format!("{reminder_at}\u{0}"))),
            422,
            "payment_reminder_at",
        ),
        (
            "field the service does not read",
            order_with("/note", json!("gift\u{0}wrap")),
            422,
            nul("note"),
        ),
        (
            "field of a line the service does not read",
            order_with("/lines/0/note", json!("\u{0}")),
            422,
            nul("lines[0].note"),
        ),
        (
            "deep in a field the service does not read",
            order_with("/meta", json!({"tags": ["ok", ["\u{0}"]]})),
            422,
            nul("meta.tags[1][0]"),
        ),
        (
            "field name",
            order_with("/no\u{0}te", json!(1)),
            422,
            nul("field names"),
        ),
        (
            "field name in a line",
            order_with("/lines/0/x\u{0}", json!(null)),
            422,
            nul("field names in lines[0]"),
        ),
    ];
    // Each would otherwise be placed, and with the key, stored with it.
    refused_without_writes(&app, "/orders", &[], cases.clone()).await;
    refused_without_writes(&app, "/orders", &[("idempotency-key", "nul-1")], cases).await;

    // A NUL byte as such is no JSON at all.
    let mut raw = serde_json::to_vec(&valid_order()).expect("serialise");
    let at = raw
        .windows(10)
        .position(|w| w == b"customer-1")
        .expect("customer id");
    raw[at + 8] = 0;
    let (status, answer) = app.post_raw("/orders", JSON, raw).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap_or_default()
        .contains("malformed JSON"));
    assert_eq!(app.row_counts().await, (0, 0, 0));

    // The text `\u0000` (an escaped backslash, then `u0000`) is no NUL: it is stored as sent.
    let (status, placed) = app
        .post(
            "/orders",
            &order_with("/customer_id", json!("customer\\u0000-1")),
            &[],
        )
        .await;
    assert_eq!(status, 201, "{placed}");
    assert_eq!(placed["customer_id"], "customer\\u0000-1");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn nul_in_an_export_request_is_refused(pool: PgPool) {
    let app = spawn_app(pool).await;
    let cases = vec![
        (
            "customer id",
            json!({"customer_id": "customer-1\u{0}"}),
            422,
            "customer_id must not contain NUL",
        ),
        (
            "status",
            json!({"status": "paid\u{0}"}),
            422,
            "status must not contain NUL",
        ),
        (
            "created_from",
            json!({"created_from": "2026-01-01T00:00:00Z\u{0}"}),
            422,
            "created_from must not contain NUL",
        ),
        (
            "created_to",
            json!({"created_to": "\u{0}2026-01-01T00:00:00Z"}),
            422,
            "created_to must not contain NUL",
        ),
        (
            "field name",
            json!({"status\u{0}": "paid"}),
            422,
            "unknown field",
        ),
    ];
    refused_without_writes(&app, "/exports", &[], cases).await;
    let (status, job) = app
        .post("/exports", &json!({"customer_id": "customer-1"}), &[])
        .await;
    assert_eq!(status, 202, "{job}");
}

/// Sends `request` as is on a connection of its own and returns the answer's status code.
async fn raw_status(app: &TestApp, request: &[u8]) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    stream.write_all(request).await.expect("send");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer));
    let _ = read.await.expect("an answer within 10 s");
    let line = String::from_utf8_lossy(&answer);
    line.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {line:?}"))
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn header_values_that_cannot_be_stored_are_refused(pool: PgPool) {
    let app = spawn_app(pool).await;
    let body = serde_json::to_string(&valid_order()).expect("serialise");
    let before = every_table_count(&app.pool).await;

    // The HTTP layer itself refuses NUL and other control characters in any header.
    for header in [
        "Idempotency-Key: key\0-1",
        "Idempotency-Key: \0",
        "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\0",
    ] {
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\
             Content-Type: application/json\r\n{header}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_eq!(
            raw_status(&app, request.as_bytes()).await,
            400,
            "{header:?}"
        );
        assert_eq!(every_table_count(&app.pool).await, before, "{header:?}");
    }

    // What HTTP lets through but is no key: 400 naming the header.
    for key in [&b"key\t1"[..], b"key 1", b"caf\xc3\xa9", b"\xff"] {
        let value = HeaderValue::from_bytes(key).expect("a valid HTTP header value");
        let answer = app
            .http
            .post(app.url("/orders"))
            .header("idempotency-key", value)
            .json(&valid_order())
            .send()
            .await
            .expect("send");
        let (status, answer) = common::answer(answer).await;
        assert_eq!(status, 400, "{key:?}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains("Idempotency-Key"), "{key:?}: {error}");
        assert_eq!(every_table_count(&app.pool).await, before, "{key:?}");
    }

    // A traceparent that is not one is left out of the event, as the trace context
    // recommendation says, rather than failing the order; a well-formed one is carried.
    for (n, traceparent) in [
        &b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0\t1"[..],
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-\xc3\xa9",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 x",
        TRACEPARENT.as_bytes(),
    ]
    .into_iter()
    .enumerate()
    {
        let value = HeaderValue::from_bytes(traceparent).expect("a valid HTTP header value");
        let answer = app
            .http
            .post(app.url("/orders"))
            .header("traceparent", value)
            .json(&valid_order())
            .send()
            .await
            .expect("send");
        let (status, order) = common::answer(answer).await;
        assert_eq!(status, 201, "{traceparent:?}: {order}");
        let id = order["order_id"].as_str().expect("order_id");
        let rows = outbox_rows(&app.pool, id).await;
        let expected = if n == 3 {
            json!({ "traceparent": TRACEPARENT })
        } else {
            json!({})
        };
        assert_eq!(rows[0].4, expected, "{traceparent:?}");
    }
}
