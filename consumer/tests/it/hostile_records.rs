//! No record stops a partition, whatever its bytes: generated records (keys of any bytes, NUL
//! and invalid UTF-8 among them; any header names and values; JSON holding `\u0000`; empty,
//! oversized and nested payloads) mixed with valid events go through the batch transaction the
//! partition task runs, on a real PostgreSQL (`DATABASE_URL`). Each batch must commit in one
//! pass, with no retry, and each record end applied, parked, stale, a duplicate or dead-lettered
//! with its exact bytes; the last resort of the retry budget (dead-lettering a message alone)
//! must succeed on any record.

use crate::common;

use std::sync::atomic::{AtomicI64, Ordering};

use chrono::Utc;
use consumer::transaction::{
    dead_letter_alone, decide, process_batch, Decision, InboundMessage, Outcome, RecordHeaders,
    TransactionContext, CUSTOM_PLANS_UP_TO,
};
use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use pipeline_core::envelope::{
    AGGREGATE_ID, EVENT_ID, EVENT_TYPE, MAX_KEY_BYTES, OCCURRED_AT, SEQUENCE, TRACEPARENT,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

const GROUP: &str = "keeper";

/// Writes every event's text and JSON where a handler would: its order and type into `text`
/// columns, its payload into `jsonb`.
struct Keeper;
struct KeeperTransaction;

impl Handler for Keeper {
    fn group(&self) -> &str {
        GROUP
    }
    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(KeeperTransaction)
    }
}

impl HandlerTransaction for KeeperTransaction {
    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO kept (event_id, aggregate_id, event_type, sequence, payload)
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(event.envelope.event_id)
            .bind(&event.envelope.aggregate_id)
            .bind(&event.envelope.event_type)
            .bind(event.envelope.sequence)
            .bind(&event.payload)
            .execute(conn)
            .await?;
            Ok(())
        })
    }
}

/// A header value as generated: a well-formed one for its name, or any bytes.
#[derive(Debug, Clone)]
enum HeaderValue {
    Absent,
    /// The header without a value.
    Null,
    WellFormed,
    Bytes(Vec<u8>),
}

/// One generated record.
#[derive(Debug, Clone)]
struct Generated {
    /// Index into the case's orders, or any bytes (None: no key).
    key: Result<usize, Option<Vec<u8>>>,
    event_id: HeaderValue,
    event_type: HeaderValue,
    sequence: (HeaderValue, i64),
    aggregate_id: HeaderValue,
    occurred_at: HeaderValue,
    traceparent: HeaderValue,
    extra: Vec<(String, Option<Vec<u8>>)>,
    payload: Option<Vec<u8>>,
    /// Repeat the previous record's event id (a Kafka duplicate).
    duplicate: bool,
}

fn any_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..max),
        // Bytes PostgreSQL's text refuses, among text it takes.
        (prop::collection::vec(
            prop_oneof![Just(0u8), Just(0xff), Just(0xc3), 0x20u8..0x7f],
            0..max
        )),
        Just(vec![0xff, 0xfe]),
        Just(b"order\0".to_vec()),
    ]
}

fn value(well_formed_weight: u32) -> impl Strategy<Value = HeaderValue> {
    prop_oneof![
        well_formed_weight => Just(HeaderValue::WellFormed),
        1 => Just(HeaderValue::Absent),
        1 => Just(HeaderValue::Null),
        1 => any_bytes(24).prop_map(HeaderValue::Bytes),
    ]
}

fn payload() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        6 => "[a-zé ]{0,12}".prop_map(|s| Some(serde_json::to_vec(&serde_json::json!({"note": s, "n": 1})).expect("json"))),
        1 => Just(None),
        1 => Just(Some(Vec::new())),
        1 => any_bytes(64).prop_map(Some),
        1 => Just(Some(br#"{"note": "a\u0000b"}"#.to_vec())),
        1 => Just(Some(br#"{"a\u0000": 1}"#.to_vec())),
        1 => Just(Some(br#"[1, {"deep": ["\u0000"]}]"#.to_vec())),
        1 => Just(Some(br#"{"escaped": "\\u0000 is text"}"#.to_vec())),
        1 => Just(Some(br#"{"lone": "\ud800"}"#.to_vec())),
        1 => Just(Some(br#"{"big": 1e400}"#.to_vec())),
        1 => Just(Some(format!("{}{}", "[".repeat(200), "]".repeat(200)).into_bytes())),
        // Oversized: close to what a broker takes by default (1 MB).
        1 => Just(Some(serde_json::to_vec(&serde_json::json!({"blob": "x".repeat(900_000)})).expect("json"))),
    ]
}

fn record() -> impl Strategy<Value = Generated> {
    let key = prop_oneof![
        6 => (0usize..3).prop_map(Ok),
        1 => Just(Err(None)),
        2 => any_bytes(32).prop_map(|k| Err(Some(k))),
        1 => Just(Err(Some(vec![b'k'; MAX_KEY_BYTES + 1]))),
    ];
    let extra = prop::collection::vec(
        (
            prop_oneof![
                ".{0,8}",
                Just("x-\0".to_owned()),
                Just(EVENT_TYPE.to_owned())
            ],
            prop::option::of(any_bytes(16)),
        ),
        0..4,
    );
    (
        key,
        (value(8), value(8), (value(8), 1i64..5), value(8)),
        (value(8), value(2)),
        extra,
        payload(),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(
                key,
                (event_id, event_type, sequence, aggregate_id),
                (occurred_at, traceparent),
                extra,
                payload,
                duplicate,
            )| {
                Generated {
                    key,
                    event_id,
                    event_type,
                    sequence,
                    aggregate_id,
                    occurred_at,
                    traceparent,
                    extra,
                    payload,
                    duplicate,
                }
            },
        )
}

static OFFSET: AtomicI64 = AtomicI64::new(0);

/// The Kafka record `g` stands for, read as the partition's consumer reads one.
fn message(
    g: &Generated,
    topic: &str,
    orders: &[String],
    previous_id: Option<Uuid>,
) -> InboundMessage {
    let key: Option<Vec<u8>> = match &g.key {
        Ok(i) => Some(orders[*i].clone().into_bytes()),
        Err(bytes) => bytes.clone(),
    };
    let event_id = match (g.duplicate, previous_id) {
        (true, Some(id)) => id,
        _ => Uuid::new_v4(),
    };
    let well_formed = |name: &str| -> Vec<u8> {
        match name {
            EVENT_ID => event_id.to_string().into_bytes(),
            EVENT_TYPE => b"order.placed".to_vec(),
            SEQUENCE => g.sequence.1.to_string().into_bytes(),
            AGGREGATE_ID => key.clone().unwrap_or_default(),
            OCCURRED_AT => Utc::now().to_rfc3339().into_bytes(),
            _ => b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
        }
    };
    let mut pairs: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    for (name, v) in [
        (EVENT_ID, &g.event_id),
        (EVENT_TYPE, &g.event_type),
        (SEQUENCE, &g.sequence.0),
        (AGGREGATE_ID, &g.aggregate_id),
        (OCCURRED_AT, &g.occurred_at),
        (TRACEPARENT, &g.traceparent),
    ] {
        match v {
            HeaderValue::Absent => {}
            HeaderValue::Null => pairs.push((name.to_owned(), None)),
            HeaderValue::WellFormed => pairs.push((name.to_owned(), Some(well_formed(name)))),
            HeaderValue::Bytes(b) => pairs.push((name.to_owned(), Some(b.clone()))),
        }
    }
    pairs.extend(g.extra.iter().cloned());
    let headers = RecordHeaders::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_deref())));
    InboundMessage::from_record(
        topic,
        0,
        OFFSET.fetch_add(1, Ordering::Relaxed),
        key.as_deref(),
        g.payload.as_deref(),
        headers,
    )
}

#[derive(sqlx::FromRow)]
struct StoredLetter {
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    header_names: Option<Vec<Vec<u8>>>,
    header_values: Option<Vec<Option<Vec<u8>>>>,
    reason: String,
}

async fn stored_letter(pool: &PgPool, msg: &InboundMessage) -> Option<StoredLetter> {
    sqlx::query_as(
        "SELECT key, payload, header_names, header_values, reason FROM dead_letter
         WHERE group_name = $1 AND topic = $2 AND partition = $3 AND kafka_offset = $4",
    )
    .bind(GROUP)
    .bind(&msg.topic)
    .bind(msg.partition)
    .bind(msg.offset)
    .fetch_optional(pool)
    .await
    .expect("dead letter lookup")
}

/// The dead letter of `msg` keeps its exact bytes.
async fn check_letter(pool: &PgPool, msg: &InboundMessage) -> Result<(), TestCaseError> {
    let letter = stored_letter(pool, msg).await;
    prop_assert!(letter.is_some(), "no dead letter for offset {}", msg.offset);
    let letter = letter.expect("checked");
    prop_assert_eq!(&letter.key, &msg.key);
    prop_assert_eq!(&letter.payload, &msg.payload);
    let (names, values) = msg.headers.to_columns();
    prop_assert_eq!(letter.header_names.as_ref(), Some(&names));
    prop_assert_eq!(letter.header_values.as_ref(), Some(&values));
    prop_assert!(!letter.reason.is_empty());
    Ok(())
}

/// One case: a batch of generated records through `process_batch`, then each checked.
async fn batch_case(pool: &PgPool, records: Vec<Generated>) -> Result<(), TestCaseError> {
    let topic = format!("hostile-{}", Uuid::new_v4().simple());
    let orders: Vec<String> = (0..3).map(|_| Uuid::new_v4().to_string()).collect();
    let mut previous: Option<Uuid> = None;
    let batch: Vec<InboundMessage> = records
        .iter()
        .map(|g| {
            let m = message(g, &topic, &orders, previous);
            if let Ok(env) = &m.envelope {
                previous = Some(env.event_id);
            }
            m
        })
        .collect();
    // One pass: the transaction commits on its first attempt.
    let report = process_batch(pool, &Keeper, &batch).await;
    prop_assert!(report.is_ok(), "batch failed: {:?}", report.err());
    let report = report.expect("checked");
    prop_assert_eq!(report.outcomes.len(), batch.len());
    for (msg, outcome) in batch.iter().zip(&report.outcomes) {
        match decide(msg, 0) {
            Decision::DeadLetter(_) => {
                prop_assert_eq!(*outcome, Outcome::DeadLettered, "offset {}", msg.offset);
                check_letter(pool, msg).await?;
            }
            Decision::Apply(event) | Decision::Park(event) | Decision::Stale(event) => {
                prop_assert!(
                    matches!(
                        outcome,
                        Outcome::Applied | Outcome::Parked | Outcome::Stale | Outcome::Duplicate
                    ),
                    "readable event {} ended {:?}",
                    event.envelope.event_id,
                    outcome
                );
                if *outcome == Outcome::Applied {
                    let kept: Option<serde_json::Value> =
                        sqlx::query_scalar("SELECT payload FROM kept WHERE event_id = $1")
                            .bind(event.envelope.event_id)
                            .fetch_optional(pool)
                            .await
                            .expect("kept");
                    prop_assert_eq!(kept.as_ref(), Some(&event.payload));
                }
            }
        }
    }
    // A parked event waits in `parked_event`, or was applied when its gap closed; none is lost.
    // (Another event claiming a sequence its order already holds is not kept twice.)
    for (msg, outcome) in batch.iter().zip(&report.outcomes) {
        let (Outcome::Parked, Ok(env)) = (outcome, &msg.envelope) else {
            continue;
        };
        let kept: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM parked_event
                            WHERE group_name = $1 AND aggregate_id = $2 AND sequence = $3)
                 OR EXISTS (SELECT 1 FROM kept WHERE aggregate_id = $2 AND sequence = $3)",
        )
        .bind(GROUP)
        .bind(&env.aggregate_id)
        .bind(env.sequence)
        .fetch_one(pool)
        .await
        .expect("parked");
        prop_assert!(kept, "parked event {} lost", env.event_id);
    }
    Ok(())
}

/// The retry budget's last resort takes any record.
async fn alone_case(pool: &PgPool, g: Generated) -> Result<(), TestCaseError> {
    let topic = format!("alone-{}", Uuid::new_v4().simple());
    let orders: Vec<String> = (0..3).map(|_| Uuid::new_v4().to_string()).collect();
    let msg = message(&g, &topic, &orders, None);
    let ctx = TransactionContext {
        pool,
        handler: &Keeper,
        fence: None,
        dead_letters: None,
        custom_plans_up_to: CUSTOM_PLANS_UP_TO,
    };
    let outcome = dead_letter_alone(
        &ctx,
        &msg,
        "retry budget exhausted after 11 attempts: some error",
        11,
        Utc::now(),
    )
    .await;
    prop_assert!(
        matches!(outcome, Ok(Outcome::DeadLettered)),
        "dead-lettering alone failed: {:?}",
        outcome
    );
    check_letter(pool, &msg).await
}

/// A database of its own, migrated, with the keeper's table, and its name.
fn database(rt: &tokio::runtime::Runtime) -> (PgPool, String) {
    rt.block_on(common::database(
        "hostile",
        "CREATE TABLE kept (event_id uuid PRIMARY KEY, aggregate_id text NOT NULL,
                            event_type text NOT NULL, sequence bigint NOT NULL,
                            payload jsonb NOT NULL)",
    ))
}

/// Drops a database `database` made, once its test passed.
fn drop_database(rt: &tokio::runtime::Runtime, pool: PgPool, name: &str) {
    rt.block_on(common::drop_database(pool, name));
}

/// `PROPTEST_CASES` cases (128 by default); a failing case is kept in
/// `tests/hostile_records.proptest-regressions` and tried first on every later run.
fn config() -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(128),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/hostile_records.proptest-regressions",
        ))),
        ..Config::default()
    }
}

#[test]
fn every_record_is_applied_parked_or_dead_lettered_in_one_pass() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (pool, name) = database(&rt);
    let mut runner = TestRunner::new(config());
    runner
        .run(&prop::collection::vec(record(), 1..10), |records| {
            rt.block_on(batch_case(&pool, records))
        })
        .expect("property");
    drop_database(&rt, pool, &name);
}

#[test]
fn dead_lettering_alone_takes_any_record() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (pool, name) = database(&rt);
    let mut runner = TestRunner::new(config());
    runner
        .run(&record(), |g| rt.block_on(alone_case(&pool, g)))
        .expect("property");
    drop_database(&rt, pool, &name);
}
