//! Bad input gets a 4xx with a JSON `{"error": …}` naming the problem, and writes nothing.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use common::{spawn_app, valid_order};
use serde_json::{json, Value};
use sqlx::PgPool;

const JSON: Option<&str> = Some("application/json");

/// (name, content type, body, expected status, text the error must contain)
type Case = (
    &'static str,
    Option<&'static str>,
    Vec<u8>,
    u16,
    &'static str,
);

fn with(path: &[&str], value: Value) -> Vec<u8> {
    let mut order = valid_order();
    let mut target = &mut order;
    for (i, key) in path.iter().enumerate() {
        if i + 1 == path.len() {
            target[*key] = value;
            break;
        }
        target = match key.parse::<usize>() {
            Ok(n) => &mut target[n],
            Err(_) => &mut target[*key],
        };
    }
    serde_json::to_vec(&order).expect("serialise")
}

fn lines(n: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| json!({"product_id": format!("p-{i}"), "quantity": 1}))
            .collect(),
    )
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn bad_create_requests_are_refused_without_writes(pool: PgPool) {
    let app = spawn_app(pool).await;
    let nul_line = json!([{"product_id": "sku-\u{0}1", "quantity": 1}]);
    let cases: Vec<Case> = vec![
        (
            "truncated JSON",
            JSON,
            br#"{"customer_id": "c""#.to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "not JSON",
            JSON,
            b"customer_id=c".to_vec(),
            400,
            "malformed JSON",
        ),
        ("empty body", JSON, Vec::new(), 400, "malformed JSON"),
        (
            "text/plain",
            Some("text/plain"),
            with(&[], json!(null)),
            415,
            "Content-Type",
        ),
        (
            "no content type",
            None,
            with(&[], json!(null)),
            415,
            "Content-Type",
        ),
        (
            "array body",
            JSON,
            b"[1, 2]".to_vec(),
            422,
            "request body must be a JSON object, not an array",
        ),
        (
            "missing lines",
            JSON,
            br#"{"customer_id": "c"}"#.to_vec(),
            422,
            "lines",
        ),
        (
            "quantity not a number",
            JSON,
            with(&["lines", "0", "quantity"], json!("two")),
            422,
            "invalid request body",
        ),
        (
            "fractional quantity",
            JSON,
            with(&["lines", "0", "quantity"], json!(1.5)),
            422,
            "invalid request body",
        ),
        (
            "unknown product",
            JSON,
            with(&["lines", "1", "product_id"], json!("sku-99999")),
            422,
            "sku-99999",
        ),
        (
            "zero quantity",
            JSON,
            with(&["lines", "0", "quantity"], json!(0)),
            422,
            "quantity",
        ),
        (
            "negative quantity",
            JSON,
            with(&["lines", "0", "quantity"], json!(-3)),
            422,
            "quantity",
        ),
        (
            "quantity above 10000",
            JSON,
            with(&["lines", "0", "quantity"], json!(10_001)),
            422,
            "quantity",
        ),
        (
            "huge quantity",
            JSON,
            with(&["lines", "0", "quantity"], json!(1_u64 << 40)),
            422,
            "quantity",
        ),
        (
            "no lines",
            JSON,
            with(&["lines"], json!([])),
            422,
            "at least one line",
        ),
        (
            "101 lines",
            JSON,
            with(&["lines"], lines(101)),
            422,
            "at most 100 lines",
        ),
        (
            "duplicate product",
            JSON,
            with(&["lines", "1", "product_id"], json!("sku-00001")),
            422,
            "sku-00001",
        ),
        (
            "empty customer",
            JSON,
            with(&["customer_id"], json!("")),
            422,
            "customer_id",
        ),
        (
            "blank customer",
            JSON,
            with(&["customer_id"], json!("   ")),
            422,
            "customer_id",
        ),
        (
            "201-char customer",
            JSON,
            with(&["customer_id"], json!("c".repeat(201))),
            422,
            "customer_id",
        ),
        (
            "NUL in customer",
            JSON,
            with(&["customer_id"], json!("cust\u{0}omer")),
            422,
            "NUL",
        ),
        (
            "NUL in email",
            JSON,
            with(&["email"], json!("a\u{0}@b.example")),
            422,
            "NUL",
        ),
        (
            "NUL in product",
            JSON,
            with(&["lines"], nul_line),
            422,
            "NUL",
        ),
        (
            "bad email",
            JSON,
            with(&["email"], json!("not-an-address")),
            422,
            "email",
        ),
        (
            "body over 64 KiB",
            JSON,
            with(&["customer_id"], json!("c".repeat(70_000))),
            413,
            "larger than",
        ),
    ];
    for (name, content_type, body, expected, message) in cases {
        let (status, answer) = app.post_raw("/orders", content_type, body).await;
        assert_eq!(status, expected, "{name}: {answer}");
        let error = answer["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no JSON error: {answer}"));
        assert!(
            error.contains(message),
            "{name}: {error:?} does not mention {message:?}"
        );
        assert_eq!(app.row_counts().await, (0, 0, 0), "{name} wrote rows");
    }
    // The same service still takes a good order.
    let (status, _) = app.post_raw("/orders", JSON, with(&[], json!(null))).await;
    assert_eq!(status, 201);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn limits_are_inclusive(pool: PgPool) {
    let app = spawn_app(pool).await;
    let (status, body) = app
        .post_raw(
            "/orders",
            JSON,
            with(&["customer_id"], json!("c".repeat(200))),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = app
        .post_raw(
            "/orders",
            JSON,
            with(&["lines", "0", "quantity"], json!(10_000)),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    // Multi-byte characters count as one each.
    let (status, body) = app
        .post_raw(
            "/orders",
            JSON,
            with(&["customer_id"], json!("é".repeat(200))),
        )
        .await;
    assert_eq!(status, 201, "{body}");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn transitions_refuse_a_body_they_do_not_read(pool: PgPool) {
    let app = spawn_app(pool).await;
    let id = app.place_order().await;
    for (content_type, body) in [
        (Some("application/json"), &b"[1,2]"[..]),
        (Some("application/json"), br#"{"reason":"fraud"}"#),
        (Some("text/plain"), b"whatever"),
        (None, b"\x00\x01"),
    ] {
        let (status, reply) = app
            .post_raw(&format!("/orders/{id}/cancel"), content_type, body.to_vec())
            .await;
        assert_eq!(status, 400, "{reply}");
        assert!(
            reply["error"]
                .as_str()
                .unwrap_or("")
                .contains("reads no body"),
            "{reply}"
        );
    }
    let (status, order) = app.get(&format!("/orders/{id}")).await;
    assert_eq!((status, order["status"].as_str()), (200, Some("placed")));
    // No body, or the empty object, is the action.
    let (status, order) = app
        .post_raw(
            &format!("/orders/{id}/pay"),
            Some("application/json"),
            b" { } ".to_vec(),
        )
        .await;
    assert_eq!((status, order["status"].as_str()), (200, Some("paid")));
    let (status, order) = app
        .post_raw(&format!("/orders/{id}/ship"), None, Vec::new())
        .await;
    assert_eq!((status, order["status"].as_str()), (200, Some("shipped")));
}
