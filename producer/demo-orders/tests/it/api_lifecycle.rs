//! The order lifecycle over HTTP: each change commits exactly one outbox event, in sequence.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use common::{outbox_rows, spawn_app, valid_order, TOPIC, TRACEPARENT};
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn place_pay_ship_writes_three_events_in_sequence(pool: PgPool) {
    let app = spawn_app(pool).await;
    let (status, placed) = app.post("/orders", &valid_order(), &[]).await;
    assert_eq!(status, 201, "{placed}");
    assert_eq!(placed["status"], "placed");
    assert_eq!(placed["customer_id"], "customer-1");
    assert_eq!(placed["lines"].as_array().map(Vec::len), Some(2));
    let id = placed["order_id"].as_str().expect("order_id").to_owned();

    let (status, paid) = app
        .post(&format!("/orders/{id}/pay"), &json!({}), &[])
        .await;
    assert_eq!((status, paid["status"].as_str()), (200, Some("paid")));
    let (status, shipped) = app
        .post(&format!("/orders/{id}/ship"), &json!({}), &[])
        .await;
    assert_eq!((status, shipped["status"].as_str()), (200, Some("shipped")));

    let rows = outbox_rows(&app.pool, &id).await;
    let summary: Vec<(&str, i64)> = rows.iter().map(|r| (r.0.as_str(), r.1)).collect();
    assert_eq!(
        summary,
        [("order.placed", 1), ("order.paid", 2), ("order.shipped", 3)]
    );
    for (event_type, _, business_key, payload, _) in &rows {
        assert_eq!(business_key, &id);
        assert_eq!(payload["order_id"], id.as_str());
        assert_eq!(
            payload["status"].as_str(),
            event_type.strip_prefix("order."),
            "payload is the snapshot after the change"
        );
        assert_eq!(payload["lines"], placed["lines"]);
    }
    let topics: Vec<String> = sqlx::query_scalar("SELECT DISTINCT topic FROM outbox")
        .fetch_all(&app.pool)
        .await
        .expect("topics");
    assert_eq!(topics, [TOPIC]);

    let (status, fetched) = app.get(&format!("/orders/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(fetched["status"], "shipped");
    assert_eq!(fetched["email"], "customer-1@example.com");
    assert_eq!(fetched["created_at"], placed["created_at"]);
    assert_ne!(fetched["updated_at"], placed["updated_at"]);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn illegal_transitions_are_refused_and_write_nothing(pool: PgPool) {
    let app = spawn_app(pool).await;

    // Ship a cancelled order.
    let id = app.place_order().await;
    let (status, _) = app
        .post(&format!("/orders/{id}/cancel"), &json!({}), &[])
        .await;
    assert_eq!(status, 200);
    let before = app.row_counts().await;
    let (status, body) = app
        .post(&format!("/orders/{id}/ship"), &json!({}), &[])
        .await;
    assert_eq!(status, 409);
    assert_eq!(body["error"], "cannot ship an order that is cancelled");
    assert_eq!(app.row_counts().await, before);

    // Pay twice.
    let id = app.place_order().await;
    let (status, _) = app
        .post(&format!("/orders/{id}/pay"), &json!({}), &[])
        .await;
    assert_eq!(status, 200);
    let before = app.row_counts().await;
    let (status, body) = app
        .post(&format!("/orders/{id}/pay"), &json!({}), &[])
        .await;
    assert_eq!(status, 409);
    assert_eq!(body["error"], "cannot pay an order that is paid");
    assert_eq!(app.row_counts().await, before);

    // Ship before paying.
    let unpaid = app.place_order().await;
    let before = app.row_counts().await;
    let (status, body) = app
        .post(&format!("/orders/{unpaid}/ship"), &json!({}), &[])
        .await;
    assert_eq!(status, 409);
    assert_eq!(body["error"], "cannot ship an order that is placed");
    assert_eq!(app.row_counts().await, before);

    let (_, order) = app.get(&format!("/orders/{id}")).await;
    assert_eq!(order["status"], "paid");
    assert_eq!(outbox_rows(&app.pool, &id).await.len(), 2);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn unknown_and_malformed_order_ids(pool: PgPool) {
    let app = spawn_app(pool).await;
    let missing = uuid::Uuid::new_v4();
    for path in [
        format!("/orders/{missing}"),
        format!("/orders/{missing}/pay"),
    ] {
        let (status, body) = if path.ends_with("pay") {
            app.post(&path, &json!({}), &[]).await
        } else {
            app.get(&path).await
        };
        assert_eq!(status, 404, "{path}");
        assert!(body["error"]
            .as_str()
            .is_some_and(|e| e.contains("not found")));
    }
    let (status, body) = app.get("/orders/not-a-uuid").await;
    assert_eq!(status, 400);
    assert!(body["error"]
        .as_str()
        .is_some_and(|e| e.contains("not a UUID")));
    let (status, _) = app.post("/orders/12345/cancel", &json!({}), &[]).await;
    assert_eq!(status, 400);
    let (status, body) = app.get("/nowhere").await;
    assert_eq!(status, 404);
    assert!(body["error"].is_string());
    let (status, body) = app.get("/orders").await;
    assert_eq!(status, 405);
    assert!(body["error"].is_string());
    assert_eq!(app.row_counts().await, (0, 0, 0));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn traceparent_is_carried_into_outbox_headers(pool: PgPool) {
    let app = spawn_app(pool).await;
    let (status, order) = app
        .post("/orders", &valid_order(), &[("traceparent", TRACEPARENT)])
        .await;
    assert_eq!(status, 201);
    let id = order["order_id"].as_str().expect("order_id").to_owned();
    // A malformed traceparent is ignored, not refused.
    let (status, _) = app
        .post(
            &format!("/orders/{id}/pay"),
            &json!({}),
            &[("traceparent", "00-xyz-01")],
        )
        .await;
    assert_eq!(status, 200);
    let rows = outbox_rows(&app.pool, &id).await;
    assert_eq!(rows[0].4, json!({ "traceparent": TRACEPARENT }));
    assert_eq!(rows[1].4, json!({}));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn ops_endpoints_share_the_listener(pool: PgPool) {
    let app = spawn_app(pool).await;
    let id = app.place_order().await;
    let _ = app
        .post(&format!("/orders/{id}/ship"), &json!({}), &[])
        .await;
    let _ = app.get("/orders/nope").await;
    for path in ["/healthz", "/readyz"] {
        let status = app
            .http
            .get(app.url(path))
            .send()
            .await
            .expect("send")
            .status();
        assert_eq!(status, 200, "{path}");
    }
    let metrics = app
        .http
        .get(app.url("/metrics"))
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("body");
    for expected in [
        r#"order_requests_total{route="/orders",status="201"} 1"#,
        r#"order_requests_total{route="/orders/{id}/ship",status="409"} 1"#,
        r#"order_requests_total{route="/orders/{id}",status="400"} 1"#,
        r#"order_events_enqueued_total{event_type="order.placed"} 1"#,
        r#"order_request_duration_seconds_count{route="/orders"} 1"#,
    ] {
        assert!(
            metrics.contains(expected),
            "missing {expected} in\n{metrics}"
        );
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn catalogue_seed_is_idempotent(pool: PgPool) {
    assert_eq!(
        demo_orders::catalog::seed_catalog(&pool, 25)
            .await
            .expect("seed"),
        25
    );
    assert_eq!(
        demo_orders::catalog::seed_catalog(&pool, 25)
            .await
            .expect("seed"),
        0
    );
    assert_eq!(
        demo_orders::catalog::seed_catalog(&pool, 30)
            .await
            .expect("seed"),
        5
    );
    let (count, first): (i64, String) =
        sqlx::query_as("SELECT count(*), min(product_id) FROM product")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!((count, first.as_str()), (30, "sku-00001"));
}
