//! Logs: with JSON logging, every log line of an event's handling in the consumer carries the
//! event id and order id, and the W3C `traceparent` of the order request that caused the event,
//! carried through the outbox and the Kafka headers.

use std::time::Duration;

use pipeline_testkit::{wait_until, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_traceparent_reaches_the_consumers_event_span() -> anyhow::Result<()> {
    let env = TestEnv::new("trace", 3).await?;
    env.seed_catalog(1)?;
    env.seed_stock(1, None)?;
    let (_svc, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let consumer = env.spawn_with_env(
        "consumer",
        "consumer",
        &env.consumer_run_args(&["inventory"]),
        &[
            ("LOG_JSON", "true"),
            ("RUST_LOG", "info,consumer::transaction::sequence=debug"),
        ],
    )?;

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let response = reqwest::Client::new()
        .post(format!("{url}/orders"))
        .header("traceparent", traceparent)
        .json(&serde_json::json!({"customer_id": "c-1", "lines": [{"product_id": "sku-00001", "quantity": 1}]}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 201);
    let order: serde_json::Value = response.json().await?;
    let order_id = order["order_id"].as_str().expect("order id").to_owned();
    let event_id: uuid::Uuid =
        wait_until("event in the outbox", Duration::from_secs(10), || async {
            Ok(
                sqlx::query_scalar("SELECT event_id FROM outbox WHERE aggregate_id = $1")
                    .bind(&order_id)
                    .fetch_optional(&env.pool)
                    .await?,
            )
        })
        .await?;

    let line: serde_json::Value = wait_until(
        "the consumer's log line for the event",
        Duration::from_secs(60),
        || async {
            Ok(consumer
                .log()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|l| {
                    l["fields"]["message"] == "event applied" || l["message"] == "event applied"
                }))
        },
    )
    .await?;
    let span = &line["span"];
    assert_eq!(span["event_id"], event_id.to_string(), "{line}");
    assert_eq!(span["aggregate_id"], order_id, "{line}");
    assert_eq!(span["traceparent"], traceparent, "{line}");
    Ok(())
}
