//! What the operator command's tests share: running the `pipeline` binary against a test
//! database, and appending events through the outbox library.

use std::process::Output;

use chrono::Utc;
use consumer::transaction::InboundMessage;
use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use pipeline_core::envelope::Envelope;
use sqlx::PgPool;
use uuid::Uuid;

/// The URL of `pool`'s database (trust authentication, as the test server has).
pub(crate) fn url_of(pool: &PgPool) -> String {
    let o = pool.connect_options();
    format!(
        "postgres://{}@{}:{}/{}?sslmode=disable",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap_or("postgres")
    )
}

/// What one run of `pipeline` printed and how it exited.
pub(crate) struct Run {
    pub(crate) status: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// Stdout as JSON; panics with both streams when it is not.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.stdout, self.stderr))
    }
}

/// Runs `pipeline args…` against `pool`'s database (the outbox's and every group's).
pub(crate) fn pipeline(pool: &PgPool, args: &[&str]) -> Run {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let out: Output = std::process::Command::new(env!("CARGO_BIN_EXE_pipeline"))
        .args(args)
        .env("DATABASE_URL", url_of(pool))
        .env("KAFKA_BROKERS", brokers)
        .env("PIPELINE_ACTOR", "test-operator")
        .env_remove("CONSUMER_GROUPS")
        .env_remove("PIPELINE_GROUP_DATABASES")
        .output()
        .expect("run pipeline");
    Run {
        status: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Appends one event of `order` through the outbox library; returns (outbox id, event id).
pub(crate) async fn enqueue(pool: &PgPool, order: &str, fact: &str) -> (i64, Uuid) {
    let event = outbox::NewEvent {
        business_key: format!("{order}/{fact}"),
        event_type: fact.to_owned(),
        aggregate_id: order.to_owned(),
        topic: "orders".to_owned(),
        payload: serde_json::json!({ "order": order, "fact": fact }),
        headers: vec![],
    };
    let mut tx = pool.begin().await.expect("begin");
    let enqueued = outbox::enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let id = sqlx::query_scalar("SELECT id FROM outbox WHERE event_id = $1")
        .bind(enqueued.event_id())
        .fetch_one(pool)
        .await
        .expect("id");
    (id, enqueued.event_id())
}

/// An order event of `order` at `offset` of partition 0 of `topic`, one line of `quantity` of
/// sku-00001.
pub(crate) fn order_message(
    topic: &str,
    order: Uuid,
    sequence: i64,
    status: OrderStatus,
    quantity: i32,
    offset: i64,
) -> InboundMessage {
    let snapshot = OrderSnapshot {
        order_id: order,
        customer_id: "c".into(),
        email: None,
        status,
        lines: vec![OrderLine {
            product_id: "sku-00001".into(),
            quantity,
        }],
    };
    InboundMessage {
        topic: topic.into(),
        partition: 0,
        offset,
        key: Some(order.to_string().into_bytes()),
        payload: Some(serde_json::to_vec(&snapshot).expect("json")),
        headers: serde_json::json!({"occurred-at": Utc::now().to_rfc3339()}).into(),
        envelope: Ok(Envelope {
            event_id: Uuid::new_v4(),
            event_type: status.event_type().into(),
            aggregate_id: order.to_string(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

/// 100 of sku-00001 in stock.
pub(crate) async fn stock(pool: &PgPool) {
    sqlx::query("INSERT INTO inventory_stock (product_id, available) VALUES ('sku-00001', 100)")
        .execute(pool)
        .await
        .expect("stock");
}
