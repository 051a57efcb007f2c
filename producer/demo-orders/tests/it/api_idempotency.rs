//! `Idempotency-Key` on `POST /orders`: one key, one order, one event, however many retries.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use std::collections::HashSet;

use common::{spawn_app, valid_order};
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn same_key_same_request_returns_the_same_order(pool: PgPool) {
    let app = spawn_app(pool).await;
    let key = [("Idempotency-Key", "key-1")];
    let (first_status, first) = app.post("/orders", &valid_order(), &key).await;
    assert_eq!(first_status, 201, "{first}");
    // Same content, spelled differently: still the same request.
    let respelled = json!({
        "lines": [
            {"quantity": 2, "product_id": "sku-00001"},
            {"quantity": 1, "product_id": "sku-00002"}
        ],
        "email": "customer-1@example.com",
        "customer_id": "customer-1"
    });
    let (second_status, second) = app.post("/orders", &respelled, &key).await;
    assert_eq!(second_status, 200, "{second}");
    assert_eq!(first, second);
    assert_eq!(app.row_counts().await, (1, 2, 1));

    // The replay answers with the order as it is now.
    let id = first["order_id"].as_str().expect("order_id");
    let (status, _) = app
        .post(&format!("/orders/{id}/pay"), &json!({}), &[])
        .await;
    assert_eq!(status, 200);
    let (status, third) = app.post("/orders", &valid_order(), &key).await;
    assert_eq!((status, third["status"].as_str()), (200, Some("paid")));
    assert_eq!(third["order_id"], first["order_id"]);
    assert_eq!(app.row_counts().await, (1, 2, 2));

    // No key: every request places a new order.
    let _ = app.place_order().await;
    let _ = app.place_order().await;
    assert_eq!(app.row_counts().await.0, 3);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn same_key_different_request_is_refused(pool: PgPool) {
    let app = spawn_app(pool).await;
    let key = [("Idempotency-Key", "key-2")];
    let (status, _) = app.post("/orders", &valid_order(), &key).await;
    assert_eq!(status, 201);
    let mut other = valid_order();
    other["lines"][0]["quantity"] = json!(3);
    let (status, body) = app.post("/orders", &other, &key).await;
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]
        .as_str()
        .is_some_and(|e| e.contains("Idempotency-Key")));
    assert_eq!(app.row_counts().await, (1, 2, 1));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn concurrent_creates_with_one_key_place_one_order(pool: PgPool) {
    let app = spawn_app(pool).await;
    let body = valid_order();
    let requests =
        (0..12).map(|_| app.post("/orders", &body, &[("Idempotency-Key", "key-concurrent")]));
    let answers = futures::future::join_all(requests).await;
    let created = answers.iter().filter(|(status, _)| *status == 201).count();
    let replayed = answers.iter().filter(|(status, _)| *status == 200).count();
    assert_eq!((created, replayed), (1, 11), "{answers:?}");
    let ids: HashSet<&str> = answers
        .iter()
        .filter_map(|(_, order)| order["order_id"].as_str())
        .collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(app.row_counts().await, (1, 2, 1));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_refused_request_does_not_use_up_its_key(pool: PgPool) {
    let app = spawn_app(pool).await;
    let key = [("Idempotency-Key", "key-3")];
    let mut unknown = valid_order();
    unknown["lines"][0]["product_id"] = json!("sku-99999");
    let (status, _) = app.post("/orders", &unknown, &key).await;
    assert_eq!(status, 422);
    let (status, _) = app.post("/orders", &valid_order(), &key).await;
    assert_eq!(status, 201);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn malformed_keys_are_refused(pool: PgPool) {
    let app = spawn_app(pool).await;
    let long = "k".repeat(201);
    for key in ["", long.as_str(), "has space"] {
        let (status, body) = app
            .post("/orders", &valid_order(), &[("Idempotency-Key", key)])
            .await;
        assert_eq!(status, 400, "{key:?}: {body}");
        assert!(body["error"].is_string());
    }
    assert_eq!(app.row_counts().await, (0, 0, 0));
}
