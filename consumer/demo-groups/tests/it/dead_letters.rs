//! Dead letters keep per-order order: later events of the order park until the dead letter is
//! replayed or skipped; other orders flow. Real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`).

use chrono::Utc;
use consumer::operator::dead_letters::{list, resolve, Request, Resolution, ResolveError};
use consumer::transaction::{
    claim_partition, process_batch, process_batch_with, Fence, InboundMessage, Outcome,
    ProcessError, TransactionContext, CUSTOM_PLANS_UP_TO,
};
use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use demo_groups::inventory::Inventory;
use pipeline_core::envelope::Envelope;
use sqlx::PgPool;
use uuid::Uuid;

const GROUP: &str = "inventory";

fn request(id: i64, how: Resolution, note: &str) -> Request<'_> {
    Request {
        id,
        how,
        actor: "test",
        note,
        for_aggregate: None,
    }
}

fn message(
    order_id: Uuid,
    sequence: i64,
    status: OrderStatus,
    quantity: i32,
    offset: i64,
) -> InboundMessage {
    let snapshot = OrderSnapshot {
        order_id,
        customer_id: "c".into(),
        email: None,
        status,
        lines: vec![OrderLine {
            product_id: "sku-00001".into(),
            quantity,
        }],
    };
    InboundMessage {
        topic: "orders".into(),
        partition: 0,
        offset,
        key: Some(order_id.to_string().into_bytes()),
        payload: Some(serde_json::to_vec(&snapshot).expect("json")),
        headers: serde_json::json!({"occurred-at": Utc::now().to_rfc3339()}).into(),
        envelope: Ok(Envelope {
            event_id: Uuid::new_v4(),
            event_type: status.event_type().into(),
            aggregate_id: order_id.to_string(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

async fn setup(pool: &PgPool) {
    sqlx::query("INSERT INTO inventory_stock (product_id, available) VALUES ('sku-00001', 100)")
        .execute(pool)
        .await
        .expect("stock");
}

async fn applied(pool: &PgPool, order: Uuid) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT sequence FROM applied_effect WHERE group_name = $1 AND aggregate_id = $2 ORDER BY id",
    )
    .bind(GROUP)
    .bind(order.to_string())
    .fetch_all(pool)
    .await
    .expect("effects")
}

async fn parked(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM parked_event")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_dead_letter_parks_its_orders_later_events_and_skip_releases_them(pool: PgPool) {
    setup(&pool).await;
    let handler = Inventory::new(GROUP);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // a's first event carries a line the handler rejects (quantity 0).
    let batch = vec![
        message(a, 1, OrderStatus::Placed, 0, 0),
        message(b, 1, OrderStatus::Placed, 1, 1),
        message(a, 2, OrderStatus::Paid, 0, 2),
        message(a, 3, OrderStatus::Cancelled, 0, 3),
        message(b, 2, OrderStatus::Paid, 1, 4),
    ];
    let report = process_batch(&pool, &handler, &batch).await.expect("batch");
    assert_eq!(
        report.outcomes,
        vec![
            Outcome::DeadLettered,
            Outcome::Applied,
            Outcome::Parked,
            Outcome::Parked,
            Outcome::Applied
        ]
    );
    assert_eq!(
        applied(&pool, a).await,
        Vec::<i64>::new(),
        "nothing of a applied past its dead letter"
    );
    assert_eq!(applied(&pool, b).await, vec![1, 2], "other orders flow");
    assert_eq!(parked(&pool).await, 2);

    let letters = list(&pool, GROUP, Some("open")).await.expect("list");
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].parked_behind, 2);
    assert!(
        letters[0].reason.contains("quantity 0"),
        "{}",
        letters[0].reason
    );

    // Replaying the same bad payload is refused and changes nothing.
    let again = resolve(
        &pool,
        &handler,
        None,
        request(letters[0].id, Resolution::Replay, "retry"),
    )
    .await;
    assert!(
        matches!(again, Err(ResolveError::StillRejected(_))),
        "{again:?}"
    );
    assert_eq!(parked(&pool).await, 2);

    let done = resolve(
        &pool,
        &handler,
        None,
        request(letters[0].id, Resolution::Skip, "bad line"),
    )
    .await
    .expect("skip");
    assert!(!done.applied);
    assert_eq!((done.unparked, done.last_sequence), (2, Some(3)));
    assert_eq!(
        applied(&pool, a).await,
        vec![2, 3],
        "parked events applied in sequence order"
    );
    assert_eq!(parked(&pool).await, 0);
    let status: String = sqlx::query_scalar("SELECT status FROM dead_letter")
        .fetch_one(&pool)
        .await
        .expect("status");
    assert_eq!(status, "skipped");
    // The order's next event flows normally now.
    let report = process_batch(
        &pool,
        &handler,
        &[message(a, 4, OrderStatus::Shipped, 0, 5)],
    )
    .await
    .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn replay_after_fixing_the_data_applies_the_event_then_the_parked_ones(pool: PgPool) {
    setup(&pool).await;
    let handler = Inventory::new(GROUP);
    let a = Uuid::new_v4();
    // Stale data makes the reservation clash.
    sqlx::query("INSERT INTO inventory_reservation (order_id, status) VALUES ($1, 'rejected')")
        .bind(a.to_string())
        .execute(&pool)
        .await
        .expect("stale row");
    let batch = vec![
        message(a, 1, OrderStatus::Placed, 2, 0),
        message(a, 2, OrderStatus::Cancelled, 2, 1),
    ];
    let report = process_batch(&pool, &handler, &batch).await.expect("batch");
    assert_eq!(
        report.outcomes,
        vec![Outcome::DeadLettered, Outcome::Parked]
    );
    let id = list(&pool, GROUP, None).await.expect("list")[0].id;

    // A later sequence cannot be resolved before an earlier one.
    sqlx::query("DELETE FROM inventory_reservation WHERE order_id = $1")
        .bind(a.to_string())
        .execute(&pool)
        .await
        .expect("fix");
    let done = resolve(
        &pool,
        &handler,
        None,
        request(id, Resolution::Replay, "fixed stale reservation"),
    )
    .await
    .expect("replay");
    assert!(done.applied);
    assert_eq!((done.unparked, done.last_sequence), (1, Some(2)));
    assert_eq!(applied(&pool, a).await, vec![1, 2]);
    let (available, reserved): (i32, i32) =
        sqlx::query_as("SELECT available, reserved FROM inventory_stock")
            .fetch_one(&pool)
            .await
            .expect("stock");
    assert_eq!(
        (available, reserved),
        (100, 0),
        "reserved by the replay, released by the parked cancel"
    );
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM processed_message ORDER BY kafka_offset")
            .fetch_all(&pool)
            .await
            .expect("outcomes");
    assert_eq!(outcomes, vec!["applied", "applied"]);
    let again = resolve(
        &pool,
        &handler,
        None,
        request(id, Resolution::Replay, "twice"),
    )
    .await;
    assert!(
        matches!(again, Err(ResolveError::AlreadyResolved { .. })),
        "{again:?}"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_consumer_that_lost_its_partition_applies_nothing(pool: PgPool) {
    setup(&pool).await;
    let handler = Inventory::new(GROUP);
    let zombie = Fence {
        topic: "orders".into(),
        partition: 0,
        owner: Uuid::new_v4(),
    };
    let successor = Fence {
        owner: Uuid::new_v4(),
        ..zombie.clone()
    };
    claim_partition(&pool, GROUP, &zombie).await.expect("claim");
    claim_partition(&pool, GROUP, &successor)
        .await
        .expect("takeover");

    let a = Uuid::new_v4();
    let ctx = TransactionContext {
        pool: &pool,
        handler: &handler,
        fence: Some(&zombie),
        dead_letters: None,
        custom_plans_up_to: CUSTOM_PLANS_UP_TO,
    };
    let result = process_batch_with(&ctx, &[message(a, 1, OrderStatus::Placed, 1, 0)]).await;
    assert!(matches!(result, Err(ProcessError::Fenced)), "{result:?}");
    assert!(applied(&pool, a).await.is_empty());
    let processed: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_message")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(processed, 0, "not even recorded");

    let ctx = TransactionContext {
        fence: Some(&successor),
        ..ctx
    };
    let report = process_batch_with(&ctx, &[message(a, 1, OrderStatus::Placed, 1, 0)])
        .await
        .expect("owner");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_parked_event_rejected_when_unparked_is_dead_lettered_with_its_record_as_it_arrived(
    pool: PgPool,
) {
    setup(&pool).await;
    let handler = Inventory::new(GROUP);
    let a = Uuid::new_v4();
    // Sequence 2 arrives first, with a line the handler rejects, a payload written in an order
    // jsonb would not keep, and headers of its own.
    let mut early = message(a, 2, OrderStatus::Placed, 0, 0);
    let raw = format!(
        r#"{{ "status":"placed", "order_id":"{a}", "lines":[{{"quantity":0,"product_id":"sku-00001"}}], "customer_id":"c", "email":null }}"#
    )
    .into_bytes();
    early.payload = Some(raw.clone());
    early.headers = pipeline_core::record::RecordHeaders::from_pairs([
        ("x-trace", Some(b"a\xffb".as_slice())),
        ("x-trace", None),
        ("x-empty", Some(b"".as_slice())),
    ]);
    let report = process_batch(&pool, &handler, &[early.clone()])
        .await
        .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Parked]);
    let report = process_batch(&pool, &handler, &[message(a, 1, OrderStatus::Placed, 1, 1)])
        .await
        .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    type Stored = (Option<Vec<u8>>, Vec<Vec<u8>>, Vec<Option<Vec<u8>>>);
    let (payload, names, values): Stored = sqlx::query_as(
        "SELECT payload, header_names, header_values FROM dead_letter WHERE kafka_offset = 0",
    )
    .fetch_one(&pool)
    .await
    .expect("the unparked event's dead letter");
    assert_eq!(
        payload,
        Some(raw),
        "the payload's bytes, not jsonb's rewrite"
    );
    assert_eq!((names, values), early.headers.to_columns());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM parked_record")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0, "the parked record goes with its event");
}
