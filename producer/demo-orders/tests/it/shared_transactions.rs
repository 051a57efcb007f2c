//! Shared transactions: changes requested while a shared transaction runs are written together
//! in the next one, and each still gets exactly the answer and the writes it would get alone.
//! Needs `DATABASE_URL` (see `common/mod.rs`).
//!
//! The tests make changes wait deterministically: one runner, whose first transaction is held
//! on a row lock this test owns, while the other changes queue up behind it.

use crate::common;

use std::time::Duration;

use common::{order_service, outbox_rows, PRODUCTS};
use demo_orders::orders::{Action, Order, OrderError, OrderService, SharedTransactionSettings};
use demo_orders::validation::{validate_order, CreateOrderRequest, RequestedLine, ValidOrder};
use outbox::{enqueue, NewEvent};
use prometheus::Registry;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::task::JoinHandle;
use uuid::Uuid;

const ONE_RUNNER: SharedTransactionSettings = SharedTransactionSettings {
    runners: 1,
    max_ops: 64,
    patience: Duration::ZERO,
};

fn order(product_id: &str) -> ValidOrder {
    validate_order(CreateOrderRequest {
        customer_id: "customer-1".into(),
        email: None,
        lines: vec![RequestedLine {
            product_id: product_id.into(),
            quantity: 1,
        }],
        payment_reminder_at: None,
    })
    .expect("valid order")
}

async fn setup(pool: &PgPool) -> (OrderService, Registry) {
    demo_orders::catalog::seed_catalog(pool, PRODUCTS)
        .await
        .expect("seed catalogue");
    let registry = Registry::new();
    (order_service(pool, Some(ONE_RUNNER), &registry), registry)
}

async fn placed(orders: &OrderService) -> Uuid {
    let placed = orders
        .place(&order("sku-00001"), None, None)
        .await
        .expect("place");
    placed.order.order_id
}

/// Locks `order_id`'s row in a transaction of the test's own, and returns it.
async fn lock_order(pool: &PgPool, order_id: Uuid) -> Transaction<'static, Postgres> {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE")
        .bind(order_id)
        .fetch_one(&mut *tx)
        .await
        .expect("lock order");
    tx
}

/// Waits until some session of this database waits for a lock.
async fn wait_for_lock_waiter(pool: &PgPool) {
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no session ever waited for the test's lock");
}

/// Holds the runner: its next transaction, a pay of `held`, waits on a row lock the test owns, so
/// every change sent meanwhile queues behind it. Returns the lock (commit it to let the runner
/// go) and the pay.
async fn hold_runner(
    pool: &PgPool,
    orders: &OrderService,
    held: Uuid,
) -> (
    Transaction<'static, Postgres>,
    JoinHandle<Result<Order, OrderError>>,
) {
    let lock = lock_order(pool, held).await;
    let pay_held = tokio::spawn({
        let orders = orders.clone();
        async move { orders.transition(held, Action::Pay, None).await }
    });
    wait_for_lock_waiter(pool).await;
    (lock, pay_held)
}

/// Waits until `n` changes wait for the held runner's next transaction.
async fn wait_queued(registry: &Registry, n: i64) {
    let queued = || {
        registry
            .gather()
            .into_iter()
            .find(|f| f.name() == "order_shared_transaction_queued_changes")
            .map_or(0, |f| f.get_metric()[0].get_gauge().get_value() as i64)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while queued() != n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} changes queued after 10 s, expected {n}",
            queued()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// (transactions, changes) the service's shared transactions wrote so far.
fn transactions_and_changes(registry: &Registry) -> (u64, f64) {
    let family = registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "order_transaction_changes")
        .expect("order_transaction_changes registered");
    let histogram = family.get_metric()[0].get_histogram();
    (histogram.get_sample_count(), histogram.get_sample_sum())
}

/// Asserts that since `before` (from [`transactions_and_changes`]) the shared transactions wrote
/// `changes` changes in at most `transactions` transactions, none of them failed.
fn assert_written_together(
    registry: &Registry,
    before: (u64, f64),
    changes: f64,
    transactions: u64,
) {
    let (after_tx, after_changes) = transactions_and_changes(registry);
    let (written_in, written) = (after_tx - before.0, after_changes - before.1);
    assert_eq!(written, changes);
    assert!(
        written_in <= transactions,
        "{written} changes in {written_in} transactions"
    );
    assert_eq!(failures(registry), 0);
}

fn failures(registry: &Registry) -> u64 {
    registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "order_shared_transaction_failures_total")
        .map_or(0, |f| f.get_metric()[0].get_counter().get_value() as u64)
}

async fn status(pool: &PgPool, order_id: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM orders WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(pool)
        .await
        .expect("status")
}

async fn event_types(pool: &PgPool, order_id: Uuid) -> Vec<(String, i64)> {
    outbox_rows(pool, &order_id.to_string())
        .await
        .into_iter()
        .map(|(event_type, sequence, ..)| (event_type, sequence))
        .collect()
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn waiting_changes_share_a_transaction_and_keep_their_own_answers(pool: PgPool) {
    let (orders, registry) = setup(&pool).await;
    let held = placed(&orders).await;
    let to_ship = placed(&orders).await;
    let (before_tx, before_changes) = transactions_and_changes(&registry);

    let (lock, pay_held) = hold_runner(&pool, &orders, held).await;

    let places: Vec<_> = (0..5)
        .map(|i| {
            let orders = orders.clone();
            let key = format!("key-{i}");
            tokio::spawn(async move { orders.place(&order("sku-00002"), Some(&key), None).await })
        })
        .collect();
    let unknown = tokio::spawn({
        let orders = orders.clone();
        async move { orders.place(&order("sku-nope"), None, None).await }
    });
    let missing = Uuid::now_v7();
    let ship_missing = tokio::spawn({
        let orders = orders.clone();
        async move { orders.transition(missing, Action::Ship, None).await }
    });
    let ship_placed = tokio::spawn({
        let orders = orders.clone();
        async move { orders.transition(to_ship, Action::Ship, None).await }
    });
    wait_queued(&registry, 8).await;
    lock.commit().await.expect("release lock");

    let paid = pay_held.await.expect("join").expect("pay");
    assert_eq!(paid.status.as_str(), "paid");
    let mut new_orders = Vec::new();
    for place in places {
        let placed = place.await.expect("join").expect("place");
        assert!(placed.created);
        new_orders.push(placed.order.order_id);
    }
    match unknown.await.expect("join") {
        Err(OrderError::UnknownProducts(products)) => assert_eq!(products, ["sku-nope"]),
        other => panic!("unknown product placed: {other:?}"),
    }
    match ship_missing.await.expect("join") {
        Err(OrderError::NotFound(id)) => assert_eq!(id, missing),
        other => panic!("missing order shipped: {other:?}"),
    }
    match ship_placed.await.expect("join") {
        Err(OrderError::IllegalTransition(e)) => assert_eq!(e.status.as_str(), "placed"),
        other => panic!("unpaid order shipped: {other:?}"),
    }

    // Every accepted change is written with its one event; the refused ones wrote nothing.
    assert_eq!(
        event_types(&pool, held).await,
        [("order.placed".into(), 1), ("order.paid".into(), 2)]
    );
    for id in &new_orders {
        assert_eq!(status(&pool, *id).await, "placed");
        assert_eq!(event_types(&pool, *id).await, [("order.placed".into(), 1)]);
    }
    assert_eq!(status(&pool, to_ship).await, "placed");
    let orders_total: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(orders_total, 7, "two set-up orders and five placed");

    // Nine changes, written in fewer transactions than changes: some shared one.
    let (after_tx, after_changes) = transactions_and_changes(&registry);
    let (transactions, changes) = (after_tx - before_tx, after_changes - before_changes);
    assert_eq!(changes, 9.0);
    assert!(
        (transactions as f64) < changes,
        "{changes} changes in {transactions} transactions"
    );
    assert_eq!(failures(&registry), 0);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_change_that_must_be_undone_sends_the_others_alone(pool: PgPool) {
    let (orders, registry) = setup(&pool).await;
    let held = placed(&orders).await;
    let broken = placed(&orders).await;
    // The outbox already holds `broken`'s paid event: paying it must be refused and undone.
    let mut tx = pool.begin().await.expect("begin");
    let _ = enqueue(
        &mut tx,
        &NewEvent {
            business_key: broken.to_string(),
            event_type: "order.paid".into(),
            aggregate_id: broken.to_string(),
            topic: common::TOPIC.into(),
            payload: serde_json::json!({}),
            headers: Vec::new(),
        },
    )
    .await
    .expect("enqueue");
    tx.commit().await.expect("commit");

    let (lock, pay_held) = hold_runner(&pool, &orders, held).await;
    let pay_broken = tokio::spawn({
        let orders = orders.clone();
        async move { orders.transition(broken, Action::Pay, None).await }
    });
    let places: Vec<_> = (0..3)
        .map(|_| {
            let orders = orders.clone();
            tokio::spawn(async move { orders.place(&order("sku-00003"), None, None).await })
        })
        .collect();
    wait_queued(&registry, 4).await;
    lock.commit().await.expect("release lock");

    let paid = pay_held.await.expect("join").expect("pay");
    assert_eq!(paid.status.as_str(), "paid");
    match pay_broken.await.expect("join") {
        Err(OrderError::EventAlreadyRecorded { order_id, .. }) => assert_eq!(order_id, broken),
        other => panic!("pay of an order with a recorded paid event: {other:?}"),
    }
    for place in places {
        let placed = place.await.expect("join").expect("place");
        assert_eq!(
            event_types(&pool, placed.order.order_id).await,
            [("order.placed".into(), 1)]
        );
    }
    // The refused change was undone; the others committed once each, after being handed back.
    assert_eq!(status(&pool, broken).await, "placed");
    assert_eq!(
        event_types(&pool, held).await,
        [("order.placed".into(), 1), ("order.paid".into(), 2)]
    );
    let orders_total: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(orders_total, 5);
    assert!(failures(&registry) >= 1, "no shared transaction failed");
}

/// The order a transition answered with.
async fn answered(task: JoinHandle<Result<Order, OrderError>>) -> Order {
    task.await.expect("join").expect("transition")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn transitions_of_a_shared_transaction_are_made_together_in_arrival_order(pool: PgPool) {
    let (orders, registry) = setup(&pool).await;
    let held = placed(&orders).await;
    let (a, b, c) = (
        placed(&orders).await,
        placed(&orders).await,
        placed(&orders).await,
    );
    let (before_tx, before_changes) = transactions_and_changes(&registry);

    let (lock, pay_held) = hold_runner(&pool, &orders, held).await;
    let transition = |id: Uuid, action: Action| {
        let orders = orders.clone();
        tokio::spawn(async move { orders.transition(id, action, None).await })
    };
    // Queued behind the held transaction: a first change of three orders, then a second one of
    // each, which must see the first (the same transaction, a later round).
    let first = [
        transition(a, Action::Pay),
        transition(b, Action::Pay),
        transition(c, Action::Cancel),
    ];
    wait_queued(&registry, 3).await;
    let second = [
        transition(a, Action::Ship),
        transition(b, Action::Ship),
        transition(c, Action::Pay),
    ];
    wait_queued(&registry, 6).await;
    lock.commit().await.expect("release lock");

    assert_eq!(answered(pay_held).await.status.as_str(), "paid");
    let [pay_a, pay_b, cancel_c] = first;
    assert_eq!(answered(pay_a).await.status.as_str(), "paid");
    assert_eq!(answered(pay_b).await.status.as_str(), "paid");
    let cancelled = answered(cancel_c).await;
    assert_eq!(cancelled.status.as_str(), "cancelled");
    assert_eq!(
        cancelled.lines.len(),
        1,
        "the answer carries the order's lines"
    );
    let [ship_a, ship_b, pay_c] = second;
    assert_eq!(answered(ship_a).await.status.as_str(), "shipped");
    assert_eq!(answered(ship_b).await.status.as_str(), "shipped");
    match pay_c.await.expect("join") {
        Err(OrderError::IllegalTransition(e)) => assert_eq!(e.status.as_str(), "cancelled"),
        other => panic!("a cancelled order was paid: {other:?}"),
    }

    for id in [a, b] {
        assert_eq!(status(&pool, id).await, "shipped");
        assert_eq!(
            event_types(&pool, id).await,
            [
                ("order.placed".into(), 1),
                ("order.paid".into(), 2),
                ("order.shipped".into(), 3)
            ]
        );
    }
    assert_eq!(status(&pool, c).await, "cancelled");
    assert_eq!(
        event_types(&pool, c).await,
        [("order.placed".into(), 1), ("order.cancelled".into(), 2)]
    );
    assert_written_together(&registry, (before_tx, before_changes), 7.0, 2);
}

fn order_of(lines: &[(&str, i64)]) -> ValidOrder {
    validate_order(CreateOrderRequest {
        customer_id: "customer-2".into(),
        email: Some("c2@example.com".into()),
        lines: lines
            .iter()
            .map(|(product_id, quantity)| RequestedLine {
                product_id: (*product_id).into(),
                quantity: *quantity,
            })
            .collect(),
        payment_reminder_at: None,
    })
    .expect("valid order")
}

async fn lines_of(pool: &PgPool, order_id: Uuid) -> Vec<(i32, String, i32)> {
    sqlx::query_as(
        "SELECT line_no, product_id, quantity FROM order_line WHERE order_id = $1 ORDER BY line_no",
    )
    .bind(order_id)
    .fetch_all(pool)
    .await
    .expect("order lines")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn places_of_a_shared_transaction_are_made_together_with_their_own_answers(pool: PgPool) {
    let (orders, registry) = setup(&pool).await;
    let held = placed(&orders).await;
    let taken = orders
        .place(&order("sku-00004"), Some("taken"), None)
        .await
        .expect("place with a key");
    let (before_tx, before_changes) = transactions_and_changes(&registry);

    let (lock, pay_held) = hold_runner(&pool, &orders, held).await;
    let place = |order: ValidOrder, key: Option<&str>| {
        let (orders, key) = (orders.clone(), key.map(str::to_owned));
        tokio::spawn(async move { orders.place(&order, key.as_deref(), None).await })
    };
    let two_lines = order_of(&[("sku-00001", 2), ("sku-00002", 3)]);
    let first = place(two_lines.clone(), Some("k-1"));
    let no_key = place(order("sku-00003"), None);
    let reused = place(order("sku-00002"), Some("taken"));
    let unknown = place(
        order_of(&[("sku-00001", 1), ("sku-nope", 1), ("sku-zzz", 2)]),
        Some("k-2"),
    );
    wait_queued(&registry, 4).await;
    // The same keys again, after the first ones: later rounds of the same transaction.
    let replay = place(two_lines, Some("k-1"));
    let replay_taken = place(order("sku-00004"), Some("taken"));
    wait_queued(&registry, 6).await;
    lock.commit().await.expect("release lock");

    assert_eq!(
        pay_held.await.expect("join").expect("pay").status.as_str(),
        "paid"
    );
    let first = first.await.expect("join").expect("place");
    assert!(first.created);
    assert_eq!(
        lines_of(&pool, first.order.order_id).await,
        [(1, "sku-00001".into(), 2), (2, "sku-00002".into(), 3)]
    );
    assert_eq!(first.order.lines.len(), 2, "the answer carries the lines");
    let no_key = no_key.await.expect("join").expect("place");
    assert!(no_key.created);
    assert_eq!(
        lines_of(&pool, no_key.order.order_id).await,
        [(1, "sku-00003".into(), 1)]
    );
    match reused.await.expect("join") {
        Err(OrderError::IdempotencyKeyReused) => {}
        other => panic!("a taken key placed another order: {other:?}"),
    }
    match unknown.await.expect("join") {
        Err(OrderError::UnknownProducts(products)) => assert_eq!(products, ["sku-nope", "sku-zzz"]),
        other => panic!("unknown products placed: {other:?}"),
    }
    let replay = replay.await.expect("join").expect("replay");
    assert!(!replay.created);
    assert_eq!(replay.order.order_id, first.order.order_id);
    let replay_taken = replay_taken.await.expect("join").expect("replay");
    assert!(!replay_taken.created);
    assert_eq!(replay_taken.order.order_id, taken.order.order_id);

    // One event per order written, nothing for the refusals and replays.
    for id in [first.order.order_id, no_key.order.order_id] {
        assert_eq!(event_types(&pool, id).await, [("order.placed".into(), 1)]);
    }
    let (orders_total, keys): (i64, Vec<String>) = sqlx::query_as(
        "SELECT count(*), array_agg(idempotency_key ORDER BY idempotency_key)
                FILTER (WHERE idempotency_key IS NOT NULL)
         FROM orders",
    )
    .fetch_one(&pool)
    .await
    .expect("orders");
    assert_eq!(orders_total, 4, "the set-up orders and the two placed");
    assert_eq!(keys, ["k-1", "taken"]);
    let outbox_total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .expect("outbox");
    assert_eq!(
        outbox_total, 5,
        "three placed, one paid, one for each new order"
    );

    assert_written_together(&registry, (before_tx, before_changes), 7.0, 2);
}
