//! Delayed events through the real binaries: the order service delays a payment reminder for
//! every order it places, the relay publishes it when it is due (not before, and also when it
//! fell due while no relay ran), after the events its order committed before, and the
//! notification group turns it into a notification; orders paid or cancelled first get none.

use std::time::Duration;

use chrono::{DateTime, SubsecRound, Utc};
use pipeline_testkit::{wait_until, TestEnv};
use serde_json::json;
use uuid::Uuid;

const REMINDER_AFTER: &str = "10s";

async fn place(http: &reqwest::Client, url: &str, body: serde_json::Value) -> anyhow::Result<Uuid> {
    let response = http
        .post(format!("{url}/orders"))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(response.status() == 201, "place: {}", response.status());
    let order: serde_json::Value = response.json().await?;
    Ok(Uuid::parse_str(
        order["order_id"].as_str().unwrap_or_default(),
    )?)
}

fn order_body() -> serde_json::Value {
    json!({ "customer_id": "c-delayed", "lines": [{ "product_id": "sku-00001", "quantity": 1 }] })
}

async fn act(http: &reqwest::Client, url: &str, order: Uuid, verb: &str) -> anyhow::Result<()> {
    let response = http
        .post(format!("{url}/orders/{order}/{verb}"))
        .send()
        .await?;
    anyhow::ensure!(response.status() == 200, "{verb}: {}", response.status());
    Ok(())
}

/// (event type, sequence) of the order's events in the outbox, in sequence order.
async fn outbox_events(env: &TestEnv, order: Uuid) -> anyhow::Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT event_type, sequence FROM outbox WHERE aggregate_id = $1 ORDER BY sequence",
    )
    .bind(order.to_string())
    .fetch_all(&env.pool)
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_reminder_is_published_when_due_in_order_and_only_for_unpaid_orders(
) -> anyhow::Result<()> {
    let env = TestEnv::new("delayed", 3).await?;
    env.seed_catalog(1)?;
    env.seed_stock(1, None)?;
    let producer = env.spawn_with_env(
        "producer",
        "order-service",
        &["serve", "--listen", "127.0.0.1:0", "--topic", &env.topic],
        &[("PAYMENT_REMINDER_AFTER", REMINDER_AFTER)],
    )?;
    let url = format!(
        "http://{}",
        producer
            .wait_for_log_value("order service listening on ", Duration::from_secs(30))
            .await?
    );
    let (relay, _) = env.relay("relay-1").await?;
    let (_consumer, _) = env.consumer("consumer").await?;
    let http = reqwest::Client::new();

    let unpaid = place(&http, &url, order_body()).await?;
    let paid = place(&http, &url, order_body()).await?;
    let cancelled = place(&http, &url, order_body()).await?;
    act(&http, &url, paid, "pay").await?;
    act(&http, &url, cancelled, "cancel").await?;
    // The unpaid order's reminder does not hold the order: a later change is published at once.
    let reminder_at: DateTime<Utc> = sqlx::query_scalar(
        "SELECT publish_at FROM outbox_delayed
         WHERE aggregate_id = $1 AND event_type = 'order.payment_reminder'",
    )
    .bind(unpaid.to_string())
    .fetch_one(&env.pool)
    .await?;
    let withdrawn: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_delayed WHERE aggregate_id = ANY($1)")
            .bind(vec![paid.to_string(), cancelled.to_string()])
            .fetch_one(&env.pool)
            .await?;
    assert_eq!(withdrawn, 0, "paying or cancelling withdraws the reminder");

    // Every immediate event published while the reminder waits.
    wait_until(
        "immediate events published",
        Duration::from_secs(30),
        || async {
            let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
                .fetch_one(&env.pool)
                .await?;
            Ok((unpublished == 0).then_some(()))
        },
    )
    .await?;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&env.pool)
        .await?;
    if now < reminder_at {
        assert_eq!(
            outbox_events(&env, unpaid).await?,
            vec![("order.placed".to_owned(), 1)],
            "not published before it is due"
        );
    }

    // The relay goes away before the reminder is due, and comes back after.
    relay.stop_cleanly(Duration::from_secs(15)).await?;
    wait_until(
        "the reminder falls due",
        Duration::from_secs(30),
        || async {
            let due: bool = sqlx::query_scalar("SELECT now() > $1")
                .bind(reminder_at + chrono::Duration::seconds(1))
                .fetch_one(&env.pool)
                .await?;
            Ok(due.then_some(()))
        },
    )
    .await?;
    assert_eq!(
        outbox_events(&env, unpaid).await?.len(),
        1,
        "no relay: the due reminder waits"
    );
    let (_relay2, _) = env.relay("relay-2").await?;

    env.wait_drained(&["inventory", "notification"], Duration::from_secs(60))
        .await?;
    // Published once a relay is back, after the order's earlier event, and applied.
    let template = wait_until(
        "the reminder notification",
        Duration::from_secs(60),
        || async {
            let t: Option<String> = sqlx::query_scalar(
                "SELECT template FROM notification
                 WHERE order_id = $1 AND template = 'payment-reminder'",
            )
            .bind(unpaid.to_string())
            .fetch_optional(&env.pool)
            .await?;
            Ok(t)
        },
    )
    .await?;
    assert_eq!(template, "payment-reminder");
    assert_eq!(
        outbox_events(&env, unpaid).await?,
        vec![
            ("order.placed".to_owned(), 1),
            ("order.payment_reminder".to_owned(), 2)
        ]
    );
    let (written, published): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "SELECT o.created_at, d.published_at FROM outbox o JOIN outbox_delivery d USING (id)
         WHERE o.aggregate_id = $1 AND o.event_type = 'order.payment_reminder'",
    )
    .bind(unpaid.to_string())
    .fetch_one(&env.pool)
    .await?;
    assert!(
        written >= reminder_at && published >= reminder_at,
        "entered the outbox at {written}, published at {published}: not before {reminder_at}"
    );
    // Applied by both groups in the order's sequence.
    let applied: Vec<(String, i64)> = sqlx::query_as(
        "SELECT group_name, sequence FROM applied_effect WHERE aggregate_id = $1
         ORDER BY group_name, id",
    )
    .bind(unpaid.to_string())
    .fetch_all(&env.pool)
    .await?;
    assert_eq!(
        applied,
        vec![
            (env.group("inventory"), 1),
            (env.group("inventory"), 2),
            (env.group("notification"), 1),
            (env.group("notification"), 2),
        ]
    );

    // The paid and the cancelled order got no reminder, in the outbox or as a notification.
    for order in [paid, cancelled] {
        let events = outbox_events(&env, order).await?;
        assert!(
            events.iter().all(|(t, _)| t != "order.payment_reminder"),
            "{events:?}"
        );
        let reminders: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM notification WHERE order_id = $1 AND template = 'payment-reminder'",
        )
        .bind(order.to_string())
        .fetch_one(&env.pool)
        .await?;
        assert_eq!(reminders, 0);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requested_reminder_time_out_of_range_is_refused_and_writes_nothing() -> anyhow::Result<()>
{
    let env = TestEnv::new("delayedbad", 1).await?;
    env.seed_catalog(1)?;
    let (_producer, url) = env.order_service().await?;
    let http = reqwest::Client::new();
    let now = Utc::now();
    let cases = [
        (
            json!((now - chrono::Duration::days(2)).to_rfc3339()),
            "in the past",
        ),
        (
            json!((now + chrono::Duration::days(400)).to_rfc3339()),
            "beyond the delay horizon",
        ),
        (json!("next tuesday"), "payment_reminder_at"),
        (json!(12), "payment_reminder_at"),
    ];
    for (at, reason) in cases {
        let mut body = order_body();
        body["payment_reminder_at"] = at.clone();
        let response = http
            .post(format!("{url}/orders"))
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        let text = response.text().await?;
        assert!(status.is_client_error(), "{at}: {status} {text}");
        assert!(text.contains(reason), "{at}: reason `{reason}` in {text}");
    }
    let written: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox),
                (SELECT count(*) FROM outbox_delayed)",
    )
    .fetch_one(&env.pool)
    .await?;
    assert_eq!(written, (0, 0, 0), "nothing written");

    // In range: delayed until exactly that time.
    let at = (now + chrono::Duration::hours(2)).trunc_subsecs(0);
    let mut body = order_body();
    body["payment_reminder_at"] = json!(at.to_rfc3339());
    let order = place(&http, &url, body).await?;
    let due: DateTime<Utc> =
        sqlx::query_scalar("SELECT publish_at FROM outbox_delayed WHERE aggregate_id = $1")
            .bind(order.to_string())
            .fetch_one(&env.pool)
            .await?;
    assert_eq!(due, at);
    Ok(())
}
