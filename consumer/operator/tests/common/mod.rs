//! What the operator command's tests share: running the `pipeline` binary against a test
//! database, and appending events through the outbox library.
#![allow(dead_code)] // each test binary uses part of it

use std::process::Output;

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
