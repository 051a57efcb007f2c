//! Records no client of ours would write, from a plain Kafka producer, between valid orders on
//! one partition, through the real consumer: a key that is not UTF-8, NUL bytes in a key and in
//! header values, `\u0000` in a JSON payload. Every valid order is applied in both groups, each
//! hostile record is dead-lettered with its exact bytes, and `pipeline` shows, traces and skips
//! such a letter.

use std::time::Duration;

use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use pipeline_core::envelope::Envelope;
use pipeline_testkit::TestEnv;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

const GROUPS: [&str; 2] = ["inventory", "notification"];

fn snapshot(order: &str, status: OrderStatus) -> Vec<u8> {
    serde_json::to_vec(&OrderSnapshot {
        order_id: order.parse().unwrap_or_else(|_| Uuid::nil()),
        customer_id: "c-hostile".into(),
        email: None,
        status,
        lines: vec![OrderLine {
            product_id: "sku-00001".into(),
            quantity: 1,
        }],
    })
    .expect("json")
}

/// The envelope's headers of `order`'s event, as (name, value) pairs, plus `extra`.
fn envelope(
    order: &str,
    sequence: i64,
    event_type: &str,
    extra: &[(&str, &[u8])],
) -> Vec<(String, Option<Vec<u8>>)> {
    let env = Envelope {
        event_id: Uuid::new_v4(),
        event_type: event_type.into(),
        aggregate_id: order.into(),
        sequence,
        occurred_at: chrono::Utc::now(),
        traceparent: None,
    };
    let mut pairs: Vec<(String, Option<Vec<u8>>)> = vec![
        (
            "event-id".into(),
            Some(env.event_id.to_string().into_bytes()),
        ),
        (
            "event-type".into(),
            Some(env.event_type.clone().into_bytes()),
        ),
        ("sequence".into(), Some(sequence.to_string().into_bytes())),
        ("aggregate-id".into(), Some(order.as_bytes().to_vec())),
        (
            "occurred-at".into(),
            Some(env.occurred_at.to_rfc3339().into_bytes()),
        ),
    ];
    for (name, value) in extra {
        match pairs.iter_mut().find(|(n, _)| n == name) {
            Some(pair) => pair.1 = Some(value.to_vec()),
            None => pairs.push(((*name).to_owned(), Some(value.to_vec()))),
        }
    }
    pairs
}

/// A record as sent: key, headers and payload bytes.
struct Sent {
    key: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    payload: Option<Vec<u8>>,
}

#[derive(sqlx::FromRow)]
struct StoredLetter {
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    header_names: Option<Vec<Vec<u8>>>,
    header_values: Option<Vec<Option<Vec<u8>>>>,
    reason: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bytes_are_dead_lettered_exactly_and_the_partition_moves_on() -> anyhow::Result<()>
{
    let env = TestEnv::new("hostile", 1).await?;
    env.seed_stock(1, None)?;
    let (_consumer, _metrics) = env.consumer("consumer").await?;
    let producer: FutureProducer = env.kafka().client_config().set("acks", "all").create()?;

    let orders: Vec<String> = (0..9).map(|_| Uuid::new_v4().to_string()).collect();
    let other = Uuid::new_v4().to_string();
    let hostile = vec![
        // A key that is not UTF-8, with an envelope that names it.
        Sent {
            key: Some(vec![0xff, 0xfe]),
            headers: envelope("\u{fffd}", 1, "order.placed", &[]),
            payload: Some(snapshot(&other, OrderStatus::Placed)),
        },
        // A NUL byte in the key (the envelope's aggregate-id agrees).
        Sent {
            key: Some(b"order\0one".to_vec()),
            headers: envelope(
                "order",
                1,
                "order.placed",
                &[("aggregate-id", b"order\0one")],
            ),
            payload: Some(snapshot(&other, OrderStatus::Placed)),
        },
        // A NUL in the event type, and a header value that is neither UTF-8 nor NUL-free.
        Sent {
            key: Some(other.clone().into_bytes()),
            headers: envelope(
                &other,
                1,
                "order.placed",
                &[("event-type", b"order.placed\0"), ("x-note", b"\xff\0\xc3")],
            ),
            payload: Some(snapshot(&other, OrderStatus::Placed)),
        },
        // \u0000 inside the JSON payload of an otherwise valid event.
        Sent {
            key: Some(other.clone().into_bytes()),
            headers: envelope(&other, 1, "order.placed", &[("x-empty", b"")]),
            payload: Some(
                format!(
                    r#"{{"order_id": "{other}", "customer_id": "c\u0000", "status": "placed", "lines": []}}"#
                )
                .into_bytes(),
            ),
        },
    ];
    let send = |sent: &Sent| {
        let producer = producer.clone();
        let topic = env.topic.clone();
        let mut headers = OwnedHeaders::new();
        for (name, value) in &sent.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: value.as_deref(),
            });
        }
        let (key, payload) = (sent.key.clone(), sent.payload.clone());
        async move {
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&topic).partition(0).headers(headers);
            if let Some(k) = &key {
                record = record.key(k.as_slice());
            }
            if let Some(p) = &payload {
                record = record.payload(p.as_slice());
            }
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        }
    };
    // Valid orders first, each hostile record between them, then each order paid.
    for (i, order) in orders.iter().enumerate() {
        send(&Sent {
            key: Some(order.clone().into_bytes()),
            headers: envelope(order, 1, "order.placed", &[]),
            payload: Some(snapshot(order, OrderStatus::Placed)),
        })
        .await?;
        if let Some(bad) = hostile.get(i) {
            send(bad).await?;
        }
    }
    for order in &orders {
        send(&Sent {
            key: Some(order.clone().into_bytes()),
            headers: envelope(order, 2, "order.paid", &[]),
            payload: Some(snapshot(order, OrderStatus::Paid)),
        })
        .await?;
    }

    env.wait_drained(&GROUPS, Duration::from_secs(120)).await?;
    for kind in GROUPS {
        let group = env.group(kind);
        for order in &orders {
            let applied: Vec<i64> = sqlx::query_scalar(
                "SELECT sequence FROM applied_effect WHERE group_name = $1 AND aggregate_id = $2 ORDER BY id",
            )
            .bind(&group)
            .bind(order)
            .fetch_all(&env.pool)
            .await?;
            assert_eq!(
                applied,
                vec![1, 2],
                "{kind}: order {order} applied in order"
            );
        }
        let letters: Vec<StoredLetter> = sqlx::query_as(
            "SELECT key, payload, header_names, header_values, reason FROM dead_letter
             WHERE group_name = $1 ORDER BY kafka_offset",
        )
        .bind(&group)
        .fetch_all(&env.pool)
        .await?;
        assert_eq!(
            letters.len(),
            hostile.len(),
            "{kind}: one letter per hostile record"
        );
        for (letter, sent) in letters.iter().zip(&hostile) {
            assert_eq!(letter.key, sent.key, "{kind}: key kept exactly");
            assert_eq!(letter.payload, sent.payload, "{kind}: payload kept exactly");
            let names: Vec<Vec<u8>> = sent
                .headers
                .iter()
                .map(|(n, _)| n.clone().into_bytes())
                .collect();
            let values: Vec<Option<Vec<u8>>> =
                sent.headers.iter().map(|(_, v)| v.clone()).collect();
            assert_eq!(
                letter.header_names.as_ref(),
                Some(&names),
                "{kind}: header names"
            );
            assert_eq!(
                letter.header_values.as_ref(),
                Some(&values),
                "{kind}: header values"
            );
        }
        let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
        assert!(reasons[0].contains("not UTF-8"), "{reasons:?}");
        assert!(reasons[1].contains("NUL"), "{reasons:?}");
        assert!(reasons[2].contains("event-type"), "{reasons:?}");
        assert!(reasons[3].contains("\\u0000"), "{reasons:?}");
    }

    // The operator sees the first letter readably, finds it by its escaped key, and skips it.
    let group = env.group("inventory");
    let id: i64 = sqlx::query_scalar(
        "SELECT id FROM dead_letter WHERE group_name = $1 AND key = '\\xfffe'::bytea",
    )
    .bind(&group)
    .fetch_one(&env.pool)
    .await?;
    let prefix = env.group_prefix.clone();
    let common = [
        "--group-prefix",
        prefix.as_str(),
        "--topic",
        env.topic.as_str(),
    ];
    let pipeline = |args: &[&str]| {
        let mut all: Vec<&str> = common.to_vec();
        all.extend_from_slice(args);
        env.run_to_end("pipeline", &all, Duration::from_secs(60))
    };
    let shown = pipeline(&[
        "--group",
        "inventory",
        "dead-letters",
        "show",
        &id.to_string(),
    ])?;
    assert!(shown.contains("\\xff\\xfe (2 bytes)"), "{shown}");
    assert!(shown.contains("record key is not UTF-8"), "{shown}");
    let shown = pipeline(&[
        "--group",
        "inventory",
        "dead-letters",
        "show",
        &sqlx::query_scalar::<_, i64>(
            "SELECT id FROM dead_letter WHERE group_name = $1 AND reason LIKE '%event-type%'",
        )
        .bind(&group)
        .fetch_one(&env.pool)
        .await?
        .to_string(),
    ])?;
    assert!(shown.contains("x-note: \\xff\\0\\xc3"), "{shown}");
    assert!(shown.contains("event-type: order.placed\\0"), "{shown}");

    let trace = pipeline(&["--group", "inventory", "trace", "\\xff\\xfe"])?;
    assert!(trace.contains("dead_lettered"), "{trace}");

    pipeline(&[
        "--group",
        "inventory",
        "dead-letters",
        "skip",
        "--id",
        &id.to_string(),
        "--actor",
        "test",
        "--note",
        "garbage from a foreign client",
    ])?;
    let status: String = sqlx::query_scalar("SELECT status FROM dead_letter WHERE id = $1")
        .bind(id)
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(status, "skipped");
    let trace = pipeline(&["--group", "inventory", "trace", "\\xff\\xfe"])?;
    assert!(trace.contains("dead_letter.skip"), "{trace}");
    assert!(trace.contains("garbage from a foreign client"), "{trace}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_for_the_dead_letter_topic_is_still_dead_lettered() -> anyhow::Result<()>
{
    use pipeline_testkit::kafka::read_topic;
    use rdkafka::message::{Headers, Message};

    let env = TestEnv::new("hostile-big", 1).await?;
    env.seed_stock(1, None)?;
    let (_consumer, _metrics) = env.consumer("consumer").await?;
    // Larger than the dead-letter producer's message.max.bytes (librdkafka's 1,000,000), within
    // what the broker takes.
    let payload: Vec<u8> = (0..1_040_000u32).map(|i| (i % 251) as u8).collect();
    let producer: FutureProducer = env
        .kafka()
        .client_config()
        .set("acks", "all")
        .set("message.max.bytes", "1048576")
        .create()?;
    producer
        .send(
            FutureRecord::<[u8], [u8]>::to(&env.topic)
                .partition(0)
                .payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    let order = Uuid::new_v4().to_string();
    let mut headers = OwnedHeaders::new();
    for (name, value) in envelope(&order, 1, "order.placed", &[]) {
        headers = headers.insert(Header {
            key: &name,
            value: value.as_deref(),
        });
    }
    producer
        .send(
            FutureRecord::to(&env.topic)
                .partition(0)
                .key(order.as_bytes())
                .payload(&snapshot(&order, OrderStatus::Placed))
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;

    env.wait_drained(&GROUPS, Duration::from_secs(120)).await?;
    for kind in GROUPS {
        let kept: Vec<u8> = sqlx::query_scalar(
            "SELECT payload FROM dead_letter WHERE group_name = $1 AND key IS NULL",
        )
        .bind(env.group(kind))
        .fetch_one(&env.pool)
        .await?;
        assert!(
            kept == payload,
            "{kind}: the table keeps all 1,040,000 bytes"
        );
        let applied: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM applied_effect WHERE group_name = $1 AND aggregate_id = $2",
        )
        .bind(env.group(kind))
        .bind(&order)
        .fetch_one(&env.pool)
        .await?;
        assert_eq!(applied, 1, "{kind}: the order behind it applied");
    }
    // The dead-letter topic has one record per group, without the content, saying why.
    let dlq = format!("{}.dlq", env.topic);
    let omitted: Vec<(Option<String>, Option<usize>)> =
        read_topic(&env.kafka(), &dlq, 2, Duration::from_secs(30))?
            .iter()
            .map(|m| {
                let why = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == "dlq-content-omitted")
                        .and_then(|h| h.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                });
                (why, m.payload().map(<[u8]>::len))
            })
            .collect();
    assert_eq!(omitted.len(), 2, "one dead-letter record per group");
    for (why, payload) in omitted {
        assert!(
            why.as_deref()
                .is_some_and(|w| w.contains("dead_letter table")),
            "{why:?}"
        );
        assert_eq!(payload, None);
    }
    Ok(())
}
