//! A group name is known when the program registers it, when its database holds rows of it, or,
//! for `status`, when Kafka knows its group id; any other name is bad input (exit status 2)
//! rather than an empty, healthy group. The commands run in-process with a program's own
//! registry, against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`) holding only the
//! libraries' tables and a real broker (`KAFKA_BROKERS`).

use std::time::Duration;

use clap::Parser;
use consumer::{Event, Groups, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use operator::cli::Cli;
use operator::error::exit_code;
use pipeline_testkit::db::database_url;
use pipeline_testkit::kafka::{brokers, kafka_args};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgConnection, PgPool};

/// A group that applies nothing.
struct Idle(String);

impl Handler for Idle {
    fn group(&self) -> &str {
        &self.0
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(IdleTransaction)
    }
}

struct IdleTransaction;

impl HandlerTransaction for IdleTransaction {
    fn apply<'a>(
        &'a mut self,
        _: &'a mut PgConnection,
        _: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Runs `pipeline args…` in-process against `pool`'s database with `tally` registered.
async fn pipeline(pool: &PgPool, args: &[&str]) -> anyhow::Result<()> {
    let (url, brokers) = (database_url(pool), brokers());
    let argv = [
        "pipeline",
        "--database-url",
        &url,
        "--kafka-brokers",
        &brokers,
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(args.iter().map(|a| (*a).to_owned()));
    let cli = Cli::try_parse_from(argv).expect("arguments");
    let groups = Groups::new().register("tally", Idle);
    operator::run(cli, &groups).await
}

/// Asserts that `pipeline args…` refuses `group` as unknown, with exit status 2.
async fn refused(pool: &PgPool, args: &[&str], group: &str) {
    let error = pipeline(pool, args)
        .await
        .expect_err("an unknown group is an error");
    assert_eq!(exit_code(&error), 2, "{error:#}");
    let message = format!("{error:#}");
    assert!(
        message.contains(&format!("unknown consumer group {group}")),
        "{message}"
    );
    assert!(
        message.contains("this program registers tally"),
        "{message}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_group_name_must_be_registered_in_the_database_or_known_to_kafka(pool: PgPool) {
    outbox::MIGRATOR.run(&pool).await.expect("outbox tables");
    consumer::MIGRATOR
        .run(&pool)
        .await
        .expect("consumer tables");

    // Nothing knows it: every command refuses it.
    refused(
        &pool,
        &["dead-letters", "--group", "nosuchgroup", "list"],
        "nosuchgroup",
    )
    .await;
    refused(&pool, &["status", "--group", "nosuchgroup"], "nosuchgroup").await;
    refused(
        &pool,
        &["trace", "--group", "nosuchgroup", "o-1"],
        "nosuchgroup",
    )
    .await;

    // Registered: known before it has processed anything.
    pipeline(&pool, &["dead-letters", "--group", "tally", "list"])
        .await
        .expect("a registered group");
    pipeline(&pool, &["status", "--group", "tally"])
        .await
        .expect("a registered group");

    // Rows in its database: a group this program no longer registers.
    sqlx::query(
        "INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset, outcome)
         VALUES ('retired', gen_random_uuid(), 't', 0, 0, 'applied')",
    )
    .execute(&pool)
    .await
    .expect("a processed row");
    pipeline(&pool, &["dead-letters", "--group", "retired", "list"])
        .await
        .expect("a group with rows");

    // Known to Kafka only (committed offsets): enough for status, not for its dead letters.
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let (topic, group) = (format!("known-{run_id}"), format!("kafka-only-{run_id}"));
    let kafka = kafka_args(&brokers());
    kafka
        .ensure_topics(std::slice::from_ref(&topic), 1)
        .await
        .expect("topic");
    {
        let (kafka, topic, group) = (kafka.clone(), topic.clone(), group.clone());
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer = kafka
                .client_config()
                .set("group.id", &group)
                .create()
                .expect("client");
            let mut offsets = TopicPartitionList::new();
            offsets
                .add_partition_offset(&topic, 0, Offset::Offset(0))
                .expect("offsets");
            // A new topic's leader may take a moment to be elected.
            let mut attempts = 0;
            while let Err(e) = client.commit(&offsets, CommitMode::Sync) {
                attempts += 1;
                assert!(attempts < 50, "commit: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        })
        .await
        .expect("commit task");
    }
    pipeline(&pool, &["status", "--group", &group, "--topic", &topic])
        .await
        .expect("a group Kafka knows");
    refused(&pool, &["dead-letters", "--group", &group, "list"], &group).await;
}
