//! `pipeline reprocess` against a real Kafka-protocol broker and PostgreSQL: a stopped group's
//! offsets move back to an offset or a time; its dedupe rows stay (effects once-only) unless
//! `--clear-dedupe`, which also rewinds each order's progress; a group with a running member is
//! refused.

use crate::common;

use std::time::Duration;

use common::{order_message, pipeline, stock};
use consumer::transaction::{process_batch, InboundMessage, Outcome};
use demo_events::order_events::OrderStatus;
use demo_groups::inventory::Inventory;
use pipeline_core::kafka::KafkaArgs;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use uuid::Uuid;

fn kafka() -> KafkaArgs {
    KafkaArgs {
        kafka_brokers: std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into()),
        kafka_options: vec![],
    }
}

/// A topic of one partition holding `n` records; returns its name.
async fn topic_with(n: i64) -> String {
    let topic = format!("operator-reprocess-{}", Uuid::new_v4().simple());
    kafka()
        .ensure_topics(std::slice::from_ref(&topic), 1)
        .await
        .expect("topic");
    let producer: FutureProducer = kafka().client_config().create().expect("producer");
    for i in 0..n {
        let _ = producer
            .send(
                FutureRecord::to(&topic)
                    .key("k")
                    .payload(&i.to_string())
                    .partition(0),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }
    topic
}

/// The group's committed offset on partition 0 of `topic`.
fn committed(group: &str, topic: &str) -> Option<i64> {
    let c: BaseConsumer = kafka()
        .client_config()
        .set("group.id", group)
        .create()
        .expect("client");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    match c
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed")
        .find_partition(topic, 0)
        .map(|p| p.offset())
    {
        Some(Offset::Offset(o)) => Some(o),
        _ => None,
    }
}

fn commit(group: &str, topic: &str, offset: i64) {
    let c: BaseConsumer = kafka()
        .client_config()
        .set("group.id", group)
        .create()
        .expect("client");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(offset))
        .expect("tpl");
    c.commit(&tpl, CommitMode::Sync).expect("commit");
}

fn message(topic: &str, order: Uuid, sequence: i64, offset: i64) -> InboundMessage {
    let status = if sequence == 1 {
        OrderStatus::Placed
    } else {
        OrderStatus::Paid
    };
    order_message(topic, order, sequence, status, 1, offset)
}

/// The group processed all four records of `topic` (two orders, two events each) and committed.
async fn processed(pool: &PgPool, group: &str, topic: &str) -> (Uuid, Uuid) {
    stock(pool).await;
    sqlx::query(
        "INSERT INTO partition_owner (group_name, topic, partition, owner) VALUES ($1, $2, 0, $3)",
    )
    .bind(group)
    .bind(topic)
    .bind(Uuid::new_v4())
    .execute(pool)
    .await
    .expect("owner");
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let batch = [
        message(topic, a, 1, 0),
        message(topic, b, 1, 1),
        message(topic, a, 2, 2),
        message(topic, b, 2, 3),
    ];
    let report = process_batch(pool, &Inventory::new(group), &batch)
        .await
        .expect("batch");
    assert!(
        report.outcomes.iter().all(|o| *o == Outcome::Applied),
        "{:?}",
        report.outcomes
    );
    commit(group, topic, 4);
    (a, b)
}

async fn progress(pool: &PgPool, group: &str, order: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT last_sequence FROM aggregate_progress WHERE group_name = $1 AND aggregate_id = $2",
    )
    .bind(group)
    .bind(order.to_string())
    .fetch_one(pool)
    .await
    .expect("progress")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn reprocess_keeps_dedupe_rows_unless_told_to_clear_them(pool: PgPool) {
    let topic = topic_with(4).await;
    let group = format!("inventory-{}", Uuid::new_v4().simple());
    let (a, b) = processed(&pool, &group, &topic).await;

    // Back to offset 2, dedupe rows kept: effects stay once-only.
    let run = pipeline(
        &pool,
        &[
            "reprocess",
            "--group",
            &group,
            "--topic",
            &topic,
            "--from",
            "2",
            "--note",
            "check",
            "--json",
        ],
    );
    assert_eq!(run.status, 0, "{}", run.stderr);
    assert_eq!(committed(&group, &topic), Some(2));
    assert_eq!(run.json()["dedupe_rows_cleared"], 0);
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_message WHERE group_name = $1")
            .bind(&group)
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(kept, 4);

    // From a time before the first record, clearing: the events from offset 0 are forgotten
    // and both orders go back to before their first event.
    let run = pipeline(
        &pool,
        &[
            "reprocess",
            "--group",
            &group,
            "--topic",
            &topic,
            "--from",
            "2020-01-01T00:00:00Z",
            "--clear-dedupe",
            "--note",
            "rebuild",
            "--json",
        ],
    );
    assert_eq!(run.status, 0, "{}", run.stderr);
    assert_eq!(committed(&group, &topic), Some(0));
    let done = run.json();
    assert_eq!(
        (
            done["dedupe_rows_cleared"].as_i64(),
            done["orders_rewound"].as_i64()
        ),
        (Some(4), Some(2)),
        "{done}"
    );
    assert_eq!(
        (
            progress(&pool, &group, a).await,
            progress(&pool, &group, b).await
        ),
        (0, 0)
    );
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT reason FROM operator_action WHERE action = 'group.reprocess' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("actions");
    assert_eq!(recorded, ["check", "rebuild"]);
    // Both show in the trace of an order the group had processed, with who and why.
    let trace = pipeline(
        &pool,
        &["trace", &a.to_string(), "--group", &group, "--json"],
    )
    .json();
    let notes: Vec<&str> = trace["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter(|s| s["transition"] == "group.reprocess")
        .filter_map(|s| s["detail"].as_str())
        .collect();
    assert_eq!(
        notes,
        ["by test-operator: check", "by test-operator: rebuild"],
        "{trace}"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn reprocess_refuses_a_running_group_and_bad_positions(pool: PgPool) {
    let topic = topic_with(4).await;
    let group = format!("inventory-{}", Uuid::new_v4().simple());
    let _ = processed(&pool, &group, &topic).await;
    for args in [
        &[
            "reprocess",
            "--group",
            &group,
            "--topic",
            &topic,
            "--from",
            "-3",
            "--note",
            "n",
        ][..],
        &[
            "reprocess",
            "--group",
            &group,
            "--topic",
            &topic,
            "--from",
            "last tuesday",
            "--note",
            "n",
        ][..],
        &[
            "reprocess",
            "--group",
            "never-ran",
            "--topic",
            &topic,
            "--from",
            "0",
            "--note",
            "n",
        ][..],
    ] {
        let run = pipeline(&pool, args);
        assert_eq!(run.status, 2, "{args:?}: {}", run.stderr);
    }
    // A running member: the command refuses rather than race its commits.
    let member: BaseConsumer = kafka()
        .client_config()
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("member");
    member.subscribe(&[&topic]).expect("subscribe");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while member.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "member never assigned"
        );
        let _ = member.poll(Duration::from_millis(100));
    }
    let run = pipeline(
        &pool,
        &[
            "reprocess",
            "--group",
            &group,
            "--topic",
            &topic,
            "--from",
            "0",
            "--note",
            "n",
        ],
    );
    assert_eq!(run.status, 2, "{}", run.stderr);
    assert!(run.stderr.contains("running member"), "{}", run.stderr);
    assert_eq!(committed(&group, &topic), Some(4), "offsets untouched");
}
