//! Every body the API takes is one JSON object: an array (even one holding the fields in order),
//! a string, a number, a boolean, `null`, an empty body or trailing characters get a 4xx naming
//! the problem and write nothing. Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use common::{spawn_app, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;

const JSON: Option<&str> = Some("application/json");

/// (name, body, expected status, text the error must contain)
type Case = (&'static str, Vec<u8>, u16, &'static str);

const ARRAY: &str = "request body must be a JSON object, not an array";

fn bytes(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).expect("serialise")
}

fn joined(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Cases every endpoint taking a body refuses, whatever its fields: `object` is a body it takes.
fn not_objects(object: &[u8]) -> Vec<Case> {
    vec![
        ("empty array", b"[]".to_vec(), 422, ARRAY),
        ("array of arrays", b" [[]] ".to_vec(), 422, ARRAY),
        (
            "array holding the object",
            joined(&[b"[", object, b"]"]),
            422,
            ARRAY,
        ),
        (
            "string",
            bytes(&Value::String(String::from_utf8_lossy(object).into())),
            422,
            "not a string",
        ),
        ("number", b"42".to_vec(), 422, "not a number"),
        ("negative number", b"-0.5e3".to_vec(), 422, "not a number"),
        ("null", b"null".to_vec(), 422, "not null"),
        ("true", b"true".to_vec(), 422, "not a boolean"),
        ("false", b"\n\tfalse\r\n".to_vec(), 422, "not a boolean"),
        ("empty body", Vec::new(), 400, "request body is empty"),
        (
            "whitespace only",
            b" \r\n\t ".to_vec(),
            400,
            "request body is empty",
        ),
        ("truncated array", b"[".to_vec(), 400, "malformed JSON"),
        (
            "array, then the object",
            joined(&[b"[] ", object]),
            400,
            "malformed JSON",
        ),
        (
            "byte order mark",
            joined(&[b"\xef\xbb\xbf", object]),
            400,
            "malformed JSON",
        ),
        (
            "trailing garbage",
            joined(&[object, b" garbage"]),
            400,
            "trailing characters",
        ),
        (
            "two objects",
            joined(&[object, object]),
            400,
            "trailing characters",
        ),
        (
            "object, then an array",
            joined(&[object, b"[]"]),
            400,
            "trailing characters",
        ),
        (
            "object, then NUL",
            joined(&[object, b"\0"]),
            400,
            "trailing characters",
        ),
    ]
}

/// Sends each case to `path` and checks its refusal and that no table changed.
async fn refused_without_writes(app: &TestApp, path: &str, cases: Vec<Case>) {
    common::refused_without_writes(&app.pool, path, cases, |body| {
        app.post_raw(path, JSON, body)
    })
    .await;
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn create_order_takes_only_an_object(pool: PgPool) {
    let app = spawn_app(pool).await;
    let reminder_at = (chrono::Utc::now() + chrono::Duration::hours(1))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let order = json!({
        "customer_id": "customer-1",
        "email": "customer-1@example.com",
        "lines": [{"product_id": "sku-00001", "quantity": 1}],
        "payment_reminder_at": reminder_at,
    });
    // The same order with its fields in declaration order, as serde's derive reads an array.
    let positional = json!([
        "customer-1",
        "customer-1@example.com",
        [{"product_id": "sku-00001", "quantity": 1}],
        reminder_at
    ]);
    let mut cases = not_objects(&bytes(&order));
    cases.extend([
        ("positional order", bytes(&positional), 422, ARRAY),
        (
            "positional order without email",
            bytes(&json!(["key", null, [{"product_id": "sku-00001", "quantity": 1}]])),
            422,
            ARRAY,
        ),
        (
            "positional line",
            bytes(&json!({"customer_id": "customer-1", "lines": [["sku-00001", 1]]})),
            422,
            "lines[0]: invalid type: sequence, expected a JSON object",
        ),
        (
            "line as a string",
            bytes(&json!({"customer_id": "customer-1", "lines": ["sku-00001"]})),
            422,
            "lines[0]: invalid type: string \"sku-00001\", expected a JSON object",
        ),
        (
            "lines as an object",
            bytes(&json!({"customer_id": "customer-1",
                          "lines": {"0": {"product_id": "sku-00001", "quantity": 1}}})),
            422,
            "lines: invalid type: map",
        ),
        (
            "duplicate field",
            br#"{"customer_id": "a", "customer_id": "customer-1",
                 "lines": [{"product_id": "sku-00001", "quantity": 1}]}"#
                .to_vec(),
            422,
            "duplicate field `customer_id`",
        ),
    ]);
    refused_without_writes(&app, "/orders", cases).await;

    // The object these stood for is an order, with its reminder.
    let (status, placed) = app.post_raw("/orders", JSON, bytes(&order)).await;
    assert_eq!(status, 201, "{placed}");
    let written: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox),
                (SELECT count(*) FROM outbox_delayed)",
    )
    .fetch_one(&app.pool)
    .await
    .expect("count rows");
    assert_eq!(written, (1, 1, 1), "the order, its event and its reminder");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn submit_export_takes_only_an_object(pool: PgPool) {
    let app = spawn_app(pool).await;
    let filters = json!({"status": "cancelled", "customer_id": "customer-1"});
    let mut cases = not_objects(&bytes(&filters));
    cases.extend([
        (
            "status filter by position",
            bytes(&json!(["cancelled"])),
            422,
            ARRAY,
        ),
        (
            "every filter by position",
            bytes(&json!([
                "paid",
                "2026-01-01T00:00:00Z",
                "2026-02-01T00:00:00Z",
                "customer-1"
            ])),
            422,
            ARRAY,
        ),
        (
            "filters nested in an array",
            bytes(&json!([{}])),
            422,
            ARRAY,
        ),
        (
            "empty object, then more",
            b"{}{}".to_vec(),
            400,
            "trailing characters",
        ),
    ]);
    refused_without_writes(&app, "/exports", cases).await;

    // The objects are taken: no filter, and the filters above.
    for body in [json!({}), filters] {
        let (status, job) = app.post_raw("/exports", JSON, bytes(&body)).await;
        assert_eq!(status, 202, "{body}: {job}");
    }
}
