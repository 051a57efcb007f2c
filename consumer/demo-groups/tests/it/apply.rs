//! The batch transaction against a real PostgreSQL: each test gets its own migrated database
//! (`#[sqlx::test]` reads `DATABASE_URL`, e.g. postgres://postgres@127.0.0.1:5432/postgres).

use chrono::Utc;
use std::sync::Arc;

use consumer::metrics::ConsumerMetrics;
use consumer::transaction::{
    claim_partition, process_batch, process_batches, Fence, InboundMessage, Outcome,
    PartitionBatch, ProcessError, SharedTransactionSettings, SharedTransactions,
    TransactionContext, CUSTOM_PLANS_UP_TO,
};
use consumer::{Event, Handler};
use demo_events::order_events::{OrderLine, OrderSnapshot, OrderStatus};
use demo_groups::inventory::Inventory;
use demo_groups::notification::Notifications;
use pipeline_core::envelope::{Envelope, EnvelopeError};
use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const GROUP: &str = "inventory";

fn snapshot(order_id: Uuid, status: OrderStatus, qty: i32) -> OrderSnapshot {
    OrderSnapshot {
        order_id,
        customer_id: "c-1".into(),
        email: Some("c1@example.com".into()),
        status,
        lines: vec![OrderLine {
            product_id: "sku-00001".into(),
            quantity: qty,
        }],
    }
}

fn message(order_id: Uuid, sequence: i64, status: OrderStatus, offset: i64) -> InboundMessage {
    message_with_id(Uuid::new_v4(), order_id, sequence, status, offset)
}

fn message_with_id(
    event_id: Uuid,
    order_id: Uuid,
    sequence: i64,
    status: OrderStatus,
    offset: i64,
) -> InboundMessage {
    let payload = serde_json::to_vec(&snapshot(order_id, status, 2)).expect("serialisable");
    InboundMessage {
        topic: "orders".into(),
        partition: 0,
        offset,
        key: Some(order_id.to_string().into_bytes()),
        payload: Some(payload),
        headers: serde_json::json!({}).into(),
        envelope: Ok(Envelope {
            event_id,
            event_type: status.event_type().into(),
            aggregate_id: order_id.to_string(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

async fn stock(pool: &PgPool, available: i32) {
    sqlx::query("INSERT INTO inventory_stock (product_id, available) VALUES ('sku-00001', $1)")
        .bind(available)
        .execute(pool)
        .await
        .expect("stock");
}

async fn effects(pool: &PgPool, group: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT aggregate_id, sequence FROM applied_effect WHERE group_name = $1 ORDER BY id",
    )
    .bind(group)
    .fetch_all(pool)
    .await
    .expect("effects")
}

async fn available(pool: &PgPool) -> (i32, i32) {
    sqlx::query_as("SELECT available, reserved FROM inventory_stock WHERE product_id = 'sku-00001'")
        .fetch_one(pool)
        .await
        .expect("stock row")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn redelivered_batch_applies_nothing_twice(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Inventory::new(GROUP);
    let order = Uuid::new_v4();
    let batch = vec![
        message(order, 1, OrderStatus::Placed, 0),
        message(order, 2, OrderStatus::Paid, 1),
        message(order, 3, OrderStatus::Cancelled, 2),
    ];
    let first = process_batch(&pool, &handler, &batch[..2])
        .await
        .expect("first batch");
    assert_eq!(first.outcomes, vec![Outcome::Applied, Outcome::Applied]);
    assert_eq!(available(&pool).await, (98, 2), "reserved once");
    // The offset commit was lost: the whole range comes again, plus the next event.
    let again = process_batch(&pool, &handler, &batch)
        .await
        .expect("redelivery");
    assert_eq!(
        again.outcomes,
        vec![Outcome::Duplicate, Outcome::Duplicate, Outcome::Applied]
    );
    assert_eq!(available(&pool).await, (100, 0), "released once");
    assert_eq!(effects(&pool, GROUP).await.len(), 3);
    // The redelivered events are in their history as duplicates, with their new offsets.
    let steps: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT transition, sequence, kafka_offset FROM group_history
         WHERE group_name = $1 AND aggregate_id = $2 ORDER BY at, sequence",
    )
    .bind(GROUP)
    .bind(order.to_string())
    .fetch_all(&pool)
    .await
    .expect("history");
    let duplicates: Vec<i64> = steps
        .iter()
        .filter(|(t, _, _)| t == "duplicate")
        .map(|(_, seq, _)| *seq)
        .collect();
    assert_eq!(duplicates, vec![1, 2], "{steps:?}");
    assert_eq!(
        steps.iter().filter(|(t, _, _)| t == "applied").count(),
        3,
        "{steps:?}"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn same_event_twice_in_one_batch_is_applied_once(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Inventory::new(GROUP);
    let order = Uuid::new_v4();
    let id = Uuid::new_v4();
    let batch = vec![
        message_with_id(id, order, 1, OrderStatus::Placed, 0),
        message_with_id(id, order, 1, OrderStatus::Placed, 1),
    ];
    let report = process_batch(&pool, &handler, &batch).await.expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied, Outcome::Duplicate]);
    assert_eq!(available(&pool).await, (98, 2));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn event_ahead_of_its_predecessor_is_parked_then_applied_in_order(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Inventory::new(GROUP);
    let order = Uuid::new_v4();
    let placed = message(order, 1, OrderStatus::Placed, 5);
    let paid = message(order, 2, OrderStatus::Paid, 3);
    let cancelled = message(order, 3, OrderStatus::Cancelled, 4);
    // Sequence 2 and 3 arrive first (e.g. sequence 1 was retried by the relay).
    let report = process_batch(&pool, &handler, &[paid.clone(), cancelled.clone()])
        .await
        .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Parked, Outcome::Parked]);
    assert_eq!(report.out_of_sequence, 2);
    assert!(
        effects(&pool, GROUP).await.is_empty(),
        "nothing applied out of order"
    );
    assert_eq!(available(&pool).await, (100, 0));

    let report = process_batch(&pool, &handler, &[placed])
        .await
        .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    assert_eq!(report.unparked, 2);
    let seqs: Vec<i64> = effects(&pool, GROUP)
        .await
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    assert_eq!(seqs, vec![1, 2, 3], "applied in sequence order");
    assert_eq!(available(&pool).await, (100, 0), "reserved then released");
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM parked_event")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(parked, 0);
    // The relay's second copies of 2 and 3 are duplicates.
    let report = process_batch(&pool, &handler, &[paid, cancelled])
        .await
        .expect("batch");
    assert_eq!(
        report.outcomes,
        vec![Outcome::Duplicate, Outcome::Duplicate]
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn gap_closed_within_one_batch_records_every_event_as_applied(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Inventory::new(GROUP);
    let order = Uuid::new_v4();
    let report = process_batch(
        &pool,
        &handler,
        &[
            message(order, 2, OrderStatus::Paid, 0),
            message(order, 1, OrderStatus::Placed, 1),
        ],
    )
    .await
    .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Parked, Outcome::Applied]);
    let seqs: Vec<i64> = effects(&pool, GROUP)
        .await
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    assert_eq!(seqs, vec![1, 2]);
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM processed_message ORDER BY kafka_offset")
            .fetch_all(&pool)
            .await
            .expect("outcomes");
    assert_eq!(outcomes, vec!["applied", "applied"]);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn bad_records_are_dead_lettered_with_their_cause_and_others_flow(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Notifications::new("notification");
    let order = Uuid::new_v4();
    let mut no_key = message(order, 1, OrderStatus::Placed, 0);
    no_key.key = None;
    no_key.envelope = Err(EnvelopeError::MissingKey);
    let mut not_json = message(Uuid::new_v4(), 1, OrderStatus::Placed, 1);
    not_json.payload = Some(b"{not json".to_vec());
    let mut unknown_type = message(Uuid::new_v4(), 1, OrderStatus::Placed, 2);
    if let Ok(env) = unknown_type.envelope.as_mut() {
        env.event_type = "order.teleported".into();
    }
    let good = message(order, 1, OrderStatus::Placed, 3);
    let report = process_batch(&pool, &handler, &[no_key, not_json, unknown_type, good])
        .await
        .expect("batch");
    assert_eq!(
        report.outcomes,
        vec![
            Outcome::DeadLettered,
            Outcome::DeadLettered,
            Outcome::DeadLettered,
            Outcome::Applied
        ]
    );
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM dead_letter ORDER BY kafka_offset")
            .fetch_all(&pool)
            .await
            .expect("dead letters");
    assert_eq!(reasons.len(), 3);
    assert!(reasons[0].contains("no key"), "{reasons:?}");
    assert!(reasons[1].contains("not JSON"), "{reasons:?}");
    assert!(reasons[2].contains("unknown event type"), "{reasons:?}");
    let notifications: i64 = sqlx::query_scalar("SELECT count(*) FROM notification")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(
        notifications, 1,
        "the good event still produced its notification"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn insufficient_stock_is_a_rejected_reservation_not_an_error(pool: PgPool) {
    stock(&pool, 1).await;
    let handler = Inventory::new(GROUP);
    let order = Uuid::new_v4();
    let report = process_batch(
        &pool,
        &handler,
        &[message(order, 1, OrderStatus::Placed, 0)],
    )
    .await
    .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    let (status, reason) = reservation(&pool, order).await;
    assert_eq!(status, "rejected");
    assert!(reason.unwrap_or_default().contains("insufficient stock"));
    assert_eq!(available(&pool).await, (1, 0), "stock untouched");
    // Cancelling a rejected order releases nothing.
    let report = process_batch(
        &pool,
        &handler,
        &[message(order, 2, OrderStatus::Cancelled, 1)],
    )
    .await
    .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    assert_eq!(available(&pool).await, (1, 0));
}

/// The event a message carries, as a handler gets it.
fn event_of(msg: &InboundMessage) -> Event {
    Event {
        envelope: msg.envelope.clone().expect("envelope"),
        payload: serde_json::from_slice(msg.payload.as_deref().expect("payload")).expect("json"),
    }
}

/// An inventory transaction that has read and decided `msgs`, waiting to be flushed; meanwhile
/// `other` (a placed event of another order) is applied and committed by a second transaction.
/// The second must not wait for the first: stock rows are locked only when written. Returns the
/// stock the first transaction wrote.
async fn interleave(pool: &PgPool, msgs: &[InboundMessage], other: InboundMessage) -> (i32, i32) {
    let handler = Inventory::new(GROUP);
    let events: Vec<Event> = msgs.iter().map(event_of).collect();
    let mut tx = pool.begin().await.expect("begin");
    let mut handler_tx = handler.transaction();
    handler_tx.prepare(&mut tx, &events).await.expect("prepare");
    for e in &events {
        handler_tx.apply(&mut tx, e).await.expect("apply");
    }
    let report = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        process_batch(pool, &handler, &[other]),
    )
    .await
    .expect("the other batch waited for the first one's stock locks")
    .expect("other batch");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    handler_tx.flush(&mut tx).await.expect("flush");
    drop(handler_tx);
    tx.commit().await.expect("commit");
    available(pool).await
}

async fn reservation(pool: &PgPool, order: Uuid) -> (String, Option<String>) {
    sqlx::query_as("SELECT status, reason FROM inventory_reservation WHERE order_id = $1")
        .bind(order.to_string())
        .fetch_one(pool)
        .await
        .expect("reservation")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn stock_taken_meanwhile_by_another_batch_is_decided_on_again(pool: PgPool) {
    // 3 in stock, each order wants 2: the batch that read 3 must not reserve once the other
    // batch has taken 2 of them.
    stock(&pool, 3).await;
    let (first, second) = (Uuid::new_v4(), Uuid::new_v4());
    let stock = interleave(
        &pool,
        &[message(first, 1, OrderStatus::Placed, 0)],
        message(second, 1, OrderStatus::Placed, 0),
    )
    .await;
    assert_eq!(
        stock,
        (1, 2),
        "only the second order's reservation holds stock"
    );
    assert_eq!(reservation(&pool, second).await.0, "reserved");
    let (status, reason) = reservation(&pool, first).await;
    assert_eq!(status, "rejected");
    assert!(
        reason.unwrap_or_default().contains("available 1"),
        "decided on the locked stock"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn stock_changed_meanwhile_is_kept_when_writing(pool: PgPool) {
    stock(&pool, 10).await;
    let (first, cancelled, second) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let stock = interleave(
        &pool,
        &[
            message(first, 1, OrderStatus::Placed, 0),
            message(cancelled, 1, OrderStatus::Placed, 1),
            message(cancelled, 2, OrderStatus::Cancelled, 2),
        ],
        message(second, 1, OrderStatus::Placed, 0),
    )
    .await;
    // Both live reservations hold 2; the cancelled one gave its 2 back; nothing is lost.
    assert_eq!(stock, (6, 4));
    assert_eq!(reservation(&pool, first).await.0, "reserved");
    assert_eq!(reservation(&pool, second).await.0, "reserved");
    assert_eq!(reservation(&pool, cancelled).await.0, "released");
}

/// Fails every send to down@example.com and records when each attempt was made.
#[derive(Default)]
struct FlakySender {
    attempts: std::sync::Mutex<Vec<std::time::Instant>>,
}

impl demo_groups::notification::NotificationSender for FlakySender {
    fn send<'a>(
        &'a self,
        n: &'a demo_groups::notification::Notification,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            if n.recipient == "down@example.com" {
                self.attempts
                    .lock()
                    .expect("attempts")
                    .push(std::time::Instant::now());
                Err("mailbox unavailable".to_owned())
            } else {
                Ok(())
            }
        })
    }
}

fn dispatch_settings() -> demo_groups::notification::DispatchSettings {
    demo_groups::notification::DispatchSettings {
        // Long enough that the test's next look comes before the first retry is due on a busy
        // machine (equal jitter: at least half of it).
        retry_base: std::time::Duration::from_millis(1_000),
        retry_max: std::time::Duration::from_millis(1_000),
        ..Default::default()
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn dispatch_records_each_outcome_backs_off_and_gives_up_after_ten_attempts(pool: PgPool) {
    sqlx::query(
        "INSERT INTO notification (event_id, order_id, recipient, channel, template)
         SELECT gen_random_uuid(), 'o' || g, CASE WHEN g = 2 THEN 'down@example.com'
                                                  ELSE 'u' || g || '@example.com' END,
                'email', 'order.placed'
         FROM generate_series(1, 3) AS g",
    )
    .execute(&pool)
    .await
    .expect("notifications");
    let sender = FlakySender::default();
    let settings = dispatch_settings();
    let dispatch = || demo_groups::notification::dispatch_due(&pool, &sender, &settings);
    assert_eq!(dispatch().await.expect("dispatch"), 3);
    let rows: Vec<(String, String, i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT order_id, status, attempts, last_error, sent_at IS NOT NULL
         FROM notification ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(
        rows,
        vec![
            ("o1".to_owned(), "sent".to_owned(), 1, None, true),
            (
                "o2".to_owned(),
                "pending".to_owned(),
                1,
                Some("mailbox unavailable".to_owned()),
                false
            ),
            ("o3".to_owned(), "sent".to_owned(), 1, None, true),
        ]
    );
    // The failed one is not retried at once: it waits for its backoff.
    assert_eq!(
        dispatch().await.expect("dispatch"),
        0,
        "retried without a backoff"
    );
    // Only the failed one is retried, each time once due, until its tenth attempt fails it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let status: String =
            sqlx::query_scalar("SELECT status FROM notification WHERE order_id = 'o2'")
                .fetch_one(&pool)
                .await
                .expect("status");
        if status == "failed" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not failed after 30 s"
        );
        assert!(dispatch().await.expect("dispatch") <= 1);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let attempts = sender.attempts.lock().expect("attempts").clone();
    assert_eq!(attempts.len(), 10);
    for (n, pair) in attempts.windows(2).enumerate() {
        // Equal jitter: at least half the nominal delay (1 s, capped).
        let least = std::time::Duration::from_millis(500);
        assert!(
            pair[1] - pair[0] >= least,
            "attempt {} came {:?} after the one before",
            n + 2,
            pair[1] - pair[0]
        );
    }
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM notification WHERE order_id = 'o2'")
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!((status.as_str(), attempts), ("failed", 10));
    assert_eq!(dispatch().await.expect("dispatch"), 0);
}

/// Blocks every send until released.
struct SlowSender {
    release: tokio::sync::Notify,
    sending: tokio::sync::Notify,
}

impl demo_groups::notification::NotificationSender for SlowSender {
    fn send<'a>(
        &'a self,
        _: &'a demo_groups::notification::Notification,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.sending.notify_one();
            self.release.notified().await;
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn dispatch_holds_no_lock_while_it_sends(pool: PgPool) {
    sqlx::query(
        "INSERT INTO notification (event_id, order_id, recipient, channel, template)
         VALUES (gen_random_uuid(), 'o1', 'u1@example.com', 'email', 'order.placed')",
    )
    .execute(&pool)
    .await
    .expect("notification");
    let sender = Arc::new(SlowSender {
        release: tokio::sync::Notify::new(),
        sending: tokio::sync::Notify::new(),
    });
    let dispatching = {
        let (pool, sender) = (pool.clone(), sender.clone());
        tokio::spawn(async move {
            demo_groups::notification::dispatch_due(&pool, sender.as_ref(), &dispatch_settings())
                .await
        })
    };
    sender.sending.notified().await;
    // Mid-send: the row can be locked at once, and no second dispatcher claims it meanwhile.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM notification WHERE order_id = 'o1' FOR UPDATE NOWAIT")
        .execute(&mut *tx)
        .await
        .expect("the row is not locked while it is sent");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        demo_groups::notification::dispatch_due(
            &pool,
            &FlakySender::default(),
            &dispatch_settings()
        )
        .await
        .expect("second dispatcher"),
        0,
        "a claimed notification is not sent twice"
    );
    sender.release.notify_one();
    assert_eq!(dispatching.await.expect("task").expect("dispatch"), 1);
    let status: String =
        sqlx::query_scalar("SELECT status FROM notification WHERE order_id = 'o1'")
            .fetch_one(&pool)
            .await
            .expect("status");
    assert_eq!(status, "sent");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_dispatcher_under_a_trickle_looks_about_once_a_notification(pool: PgPool) {
    let claims = || pipeline_testkit::db::statement_calls(&pool, "FOR UPDATE SKIP LOCKED) due");
    let sender = Arc::new(FlakySender::default());
    let stop = CancellationToken::new();
    let before = claims().await;
    let dispatcher = tokio::spawn(demo_groups::notification::dispatch(
        pool.clone(),
        sender.clone(),
        dispatch_settings(),
        stop.clone(),
    ));
    // One notification every 40 ms for two seconds: closer together than the dispatcher's
    // first pause (50 ms).
    const NOTIFICATIONS: i64 = 50;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(40));
    for n in 0..NOTIFICATIONS {
        let _ = tick.tick().await;
        sqlx::query(
            "INSERT INTO notification (event_id, order_id, recipient, channel, template)
             VALUES (gen_random_uuid(), $1, 'u@example.com', 'email', 'order.placed')",
        )
        .bind(format!("o{n}"))
        .execute(&pool)
        .await
        .expect("notification");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let sent = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM notification WHERE status = 'sent'")
            .fetch_one(&pool)
            .await
            .expect("sent")
    };
    while sent().await < NOTIFICATIONS {
        assert!(std::time::Instant::now() < deadline, "all sent within 10 s");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let looked = claims().await - before;
    stop.cancel();
    dispatcher.await.expect("dispatcher");
    println!("{looked} claims for {NOTIFICATIONS} notifications, one every 40 ms");
    // A look that takes one notification and looks again at once would make two a notification.
    assert!(
        looked <= NOTIFICATIONS * 13 / 10,
        "{looked} claims for {NOTIFICATIONS} notifications"
    );
}

fn on_partition(mut m: InboundMessage, partition: i32) -> InboundMessage {
    m.partition = partition;
    m
}

fn fence(partition: i32) -> Fence {
    Fence {
        topic: "orders".into(),
        partition,
        owner: Uuid::new_v4(),
    }
}

async fn processed_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM processed_message")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn batches_of_several_partitions_in_one_transaction_keep_dedupe_and_order(pool: PgPool) {
    stock(&pool, 5).await;
    let handler = Inventory::new(GROUP);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let a_placed = on_partition(message(a, 1, OrderStatus::Placed, 10), 0);
    // Partition 1 saw order b's first event already (a redelivery follows).
    let b_placed = on_partition(message(b, 1, OrderStatus::Placed, 20), 1);
    process_batch(&pool, &handler, std::slice::from_ref(&b_placed))
        .await
        .expect("earlier batch");
    assert_eq!(available(&pool).await, (3, 2));

    let p0 = vec![
        a_placed,
        on_partition(message(a, 2, OrderStatus::Paid, 11), 0),
    ];
    let p1 = vec![
        b_placed,
        on_partition(message(b, 3, OrderStatus::Shipped, 21), 1),
        on_partition(message(b, 2, OrderStatus::Cancelled, 22), 1),
    ];
    let ctx = TransactionContext {
        pool: &pool,
        handler: &handler,
        fence: None,
        dead_letters: None,
        custom_plans_up_to: CUSTOM_PLANS_UP_TO,
    };
    let reports = process_batches(
        &ctx,
        &[
            PartitionBatch {
                fence: None,
                messages: &p0,
            },
            PartitionBatch {
                fence: None,
                messages: &p1,
            },
        ],
    )
    .await
    .expect("shared transaction");
    assert_eq!(reports.len(), 2);
    assert_eq!(
        reports[0].outcomes,
        vec![Outcome::Applied, Outcome::Applied]
    );
    // b's sequence 3 came before 2: parked, then unparked when 2 was applied.
    assert_eq!(
        reports[1].outcomes,
        vec![Outcome::Duplicate, Outcome::Parked, Outcome::Applied]
    );
    assert_eq!(reports[1].unparked, 1);
    assert_eq!(reports[0].applied_occurred_at.len(), 2);
    assert_eq!(reports[1].applied_occurred_at.len(), 2);
    // a reserved 2 of the 3 left; b released its 2 (cancelled), then shipped nothing reserved.
    assert_eq!(available(&pool).await, (3, 2));
    let a_id = a.to_string();
    let b_id = b.to_string();
    let applied = effects(&pool, GROUP).await;
    let of = |order: &str| -> Vec<i64> {
        applied
            .iter()
            .filter(|(o, _)| o == order)
            .map(|(_, s)| *s)
            .collect()
    };
    assert_eq!(of(&a_id), vec![1, 2]);
    assert_eq!(of(&b_id), vec![1, 2, 3]);
}

/// Partition 0 owned by this consumer; partition 1 claimed by it, then taken over by another.
async fn owned_and_lost(pool: &PgPool) -> (Fence, Fence) {
    let (owned, lost) = (fence(0), fence(1));
    claim_partition(pool, GROUP, &owned).await.expect("claim");
    claim_partition(pool, GROUP, &lost).await.expect("claim");
    let successor = Fence {
        owner: Uuid::new_v4(),
        ..lost.clone()
    };
    claim_partition(pool, GROUP, &successor)
        .await
        .expect("taken over");
    (owned, lost)
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_fenced_batch_rolls_back_the_shared_transaction(pool: PgPool) {
    stock(&pool, 100).await;
    let handler = Inventory::new(GROUP);
    let (owned, lost) = owned_and_lost(&pool).await;
    let p0 = vec![on_partition(
        message(Uuid::new_v4(), 1, OrderStatus::Placed, 0),
        0,
    )];
    let p1 = vec![on_partition(
        message(Uuid::new_v4(), 1, OrderStatus::Placed, 0),
        1,
    )];
    let ctx = TransactionContext {
        pool: &pool,
        handler: &handler,
        fence: None,
        dead_letters: None,
        custom_plans_up_to: CUSTOM_PLANS_UP_TO,
    };
    let result = process_batches(
        &ctx,
        &[
            PartitionBatch {
                fence: Some(&owned),
                messages: &p0,
            },
            PartitionBatch {
                fence: Some(&lost),
                messages: &p1,
            },
        ],
    )
    .await;
    assert!(matches!(result, Err(ProcessError::Fenced)), "{result:?}");
    assert_eq!(processed_count(&pool).await, 0, "nothing of either batch");
    assert_eq!(available(&pool).await, (100, 0));
}

fn shared(pool: &PgPool, transactions: usize, metrics: &ConsumerMetrics) -> SharedTransactions {
    shared_by(pool, transactions, 1, std::time::Duration::ZERO, metrics)
}

/// Runners for `groups` groups, waiting `gather` for another group's batch.
fn shared_by(
    pool: &PgPool,
    transactions: usize,
    groups: usize,
    gather: std::time::Duration,
    metrics: &ConsumerMetrics,
) -> SharedTransactions {
    SharedTransactions::start(
        SharedTransactionSettings {
            pool: pool.clone(),
            groups,
            dead_letters: None,
            metrics: metrics.clone(),
            transactions,
            gather,
            patience: std::time::Duration::ZERO,
            max_messages: 500,
            custom_plans_up_to: CUSTOM_PLANS_UP_TO,
        },
        CancellationToken::new(),
    )
}

fn inventory() -> Arc<dyn Handler> {
    Arc::new(Inventory::new(GROUP))
}

/// The transaction ids that wrote each group's dedupe rows.
async fn writers_by_group(pool: &PgPool) -> Vec<(String, Vec<String>)> {
    sqlx::query_as(
        "SELECT group_name, array_agg(DISTINCT xmin::text) FROM processed_message
         GROUP BY group_name ORDER BY group_name",
    )
    .fetch_all(pool)
    .await
    .expect("writers")
}

// `#[sqlx::test]` runs on a current-thread runtime: every batch below is handed over before the
// runner first runs, as when partitions' batches arrive while a transaction is in flight.
#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn waiting_batches_of_many_partitions_share_transactions(pool: PgPool) {
    stock(&pool, 1_000).await;
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let shared = shared(&pool, 1, &metrics);
    let handler = inventory();
    let partitions: Vec<(Fence, Uuid)> = (0..8).map(|p| (fence(p), Uuid::new_v4())).collect();
    for (f, _) in &partitions {
        claim_partition(&pool, GROUP, f).await.expect("claim");
    }
    let results = futures::future::join_all(partitions.iter().map(|(f, order)| {
        let batch = vec![
            on_partition(message(*order, 1, OrderStatus::Placed, 0), f.partition),
            on_partition(message(*order, 2, OrderStatus::Cancelled, 1), f.partition),
        ];
        shared.process(&handler, f, Arc::new(batch))
    }))
    .await;
    for result in results {
        let report = result.expect("applied").expect("committed");
        assert_eq!(report.outcomes, vec![Outcome::Applied, Outcome::Applied]);
    }
    assert_eq!(processed_count(&pool).await, 16);
    assert_eq!(available(&pool).await, (1_000, 0));
    let h = metrics.transaction_partitions.with_label_values(&[GROUP]);
    assert_eq!(
        h.get_sample_sum() as u64,
        8,
        "every batch in one transaction"
    );
    assert!(
        h.get_sample_count() < 8,
        "{} transactions for 8 waiting batches",
        h.get_sample_count()
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn batches_of_a_failed_shared_transaction_are_handed_back(pool: PgPool) {
    stock(&pool, 100).await;
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let shared = shared(&pool, 1, &metrics);
    let handler = inventory();
    let (owned, lost) = owned_and_lost(&pool).await;
    let p0 = Arc::new(vec![on_partition(
        message(Uuid::new_v4(), 1, OrderStatus::Placed, 0),
        0,
    )]);
    let p1 = Arc::new(vec![on_partition(
        message(Uuid::new_v4(), 1, OrderStatus::Placed, 0),
        1,
    )]);
    let (r0, r1) = futures::join!(
        shared.process(&handler, &owned, p0.clone()),
        shared.process(&handler, &lost, p1.clone())
    );
    assert!(r0.is_none() && r1.is_none(), "{r0:?} {r1:?}");
    assert_eq!(processed_count(&pool).await, 0);
    assert_eq!(
        metrics
            .shared_transaction_failures
            .with_label_values(&[GROUP])
            .get(),
        1
    );
    // Alone, each batch gets its own answer.
    let r0 = shared.process(&handler, &owned, p0).await.expect("ran");
    assert_eq!(r0.expect("owned").outcomes, vec![Outcome::Applied]);
    let r1 = shared.process(&handler, &lost, p1).await.expect("ran");
    assert!(matches!(r1, Err(ProcessError::Fenced)), "{r1:?}");
    assert_eq!(processed_count(&pool).await, 1);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_groups_batches_of_the_same_events_share_one_transaction(pool: PgPool) {
    stock(&pool, 1_000).await;
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let shared = shared_by(&pool, 1, 2, std::time::Duration::ZERO, &metrics);
    let groups: Vec<Arc<dyn Handler>> =
        vec![inventory(), Arc::new(Notifications::new("notification"))];
    let f = fence(0);
    for handler in &groups {
        claim_partition(&pool, handler.group(), &f)
            .await
            .expect("claim");
    }
    let order = Uuid::new_v4();
    let batch = Arc::new(vec![
        message(order, 1, OrderStatus::Placed, 0),
        message(order, 2, OrderStatus::Paid, 1),
    ]);
    let results =
        futures::future::join_all(groups.iter().map(|h| shared.process(h, &f, batch.clone())))
            .await;
    for result in results {
        let report = result.expect("applied").expect("committed");
        assert_eq!(report.outcomes, vec![Outcome::Applied, Outcome::Applied]);
    }
    let writers = writers_by_group(&pool).await;
    assert_eq!(writers.len(), 2, "{writers:?}");
    assert_eq!(writers[0].1.len(), 1, "{writers:?}");
    assert_eq!(writers[0].1, writers[1].1, "both groups in one transaction");
    assert_eq!(
        available(&pool).await,
        (998, 2),
        "the inventory's effects: 2 reserved"
    );
    let progress: Vec<(String, i64)> = sqlx::query_as(
        "SELECT group_name, last_sequence FROM aggregate_progress ORDER BY group_name",
    )
    .fetch_all(&pool)
    .await
    .expect("progress");
    assert_eq!(
        progress,
        vec![("inventory".to_owned(), 2), ("notification".to_owned(), 2)],
        "each group's own progress"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_batch_alone_waits_the_gather_for_another_groups(pool: PgPool) {
    stock(&pool, 1_000).await;
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let gather = std::time::Duration::from_secs(2);
    let shared = shared_by(&pool, 1, 2, gather, &metrics);
    let (inventory, notification): (Arc<dyn Handler>, Arc<dyn Handler>) =
        (inventory(), Arc::new(Notifications::new("notification")));
    let f = fence(0);
    for handler in [&inventory, &notification] {
        claim_partition(&pool, handler.group(), &f)
            .await
            .expect("claim");
    }
    let batch = Arc::new(vec![message(Uuid::new_v4(), 1, OrderStatus::Placed, 0)]);
    let started = std::time::Instant::now();
    let late = async {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        shared.process(&notification, &f, batch.clone()).await
    };
    let (first, second) = futures::join!(shared.process(&inventory, &f, batch.clone()), late);
    let waited = started.elapsed();
    assert!(first.expect("applied").is_ok() && second.expect("applied").is_ok());
    assert!(
        waited >= std::time::Duration::from_millis(200) && waited < gather,
        "the first batch waited for the second, not the whole gather: {waited:?}"
    );
    let writers = writers_by_group(&pool).await;
    assert_eq!(writers[0].1, writers[1].1, "one transaction: {writers:?}");

    // With no other group's batch on its way, a batch waits the gather out, then commits alone.
    let alone = Arc::new(vec![message(Uuid::new_v4(), 1, OrderStatus::Placed, 1)]);
    let started = std::time::Instant::now();
    let report = shared
        .process(&inventory, &f, alone)
        .await
        .expect("applied")
        .expect("committed");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    assert!(started.elapsed() >= gather, "{:?}", started.elapsed());
}
