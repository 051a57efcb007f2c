//! End to end through the real binaries: orders over HTTP, the outbox, the relay, Kafka and both
//! consumer groups, checked in the database: every event applied exactly once per group, each
//! order's events in sequence order, the outbox drained, the groups' lag back to zero.

use std::time::{Duration, Instant};

use pipeline_testkit::{effects, scrape_sum, wait_until, TestEnv};

const GROUPS: [&str; 2] = ["inventory", "notification"];
const STOCK: i64 = 1_000_000;
const PRODUCTS: u32 = 50;

/// Catalogue and stock for the orders the load places.
fn prepare(env: &TestEnv) -> anyhow::Result<()> {
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(STOCK))
}

fn load_args<'a>(url: &'a str, orders: &'a str, rate: &'a str, seed: &'a str) -> Vec<&'a str> {
    vec![
        "--url",
        url,
        "--orders",
        orders,
        "--rate",
        rate,
        "--concurrency",
        "16",
        "--products",
        "50",
        "--seed",
        seed,
    ]
}

/// The properties a user cares about, checked against the database.
async fn assert_exactly_once_in_order(env: &TestEnv, expected_events: i64) -> anyhow::Result<()> {
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(
        events, expected_events,
        "outbox holds every acknowledged state change"
    );
    let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delivery")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(published, events, "outbox drained");

    // Exactly one effect per event in each group, each order's events in sequence order.
    effects::assert_exactly_once_in_order(env, &GROUPS).await?;
    for kind in GROUPS {
        let group = env.group(kind);
        let parked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM parked_event WHERE group_name = $1")
                .bind(&group)
                .fetch_one(&env.pool)
                .await?;
        assert_eq!(parked, 0, "{kind}: events left parked");
    }

    // The inventory's effects are not idempotent by themselves: stock is conserved only if every
    // reservation, release and fulfilment happened exactly once.
    let broken: Vec<(String, i64)> = sqlx::query_as(
        "SELECT s.product_id, s.available + s.reserved + COALESCE(f.qty, 0) FROM inventory_stock s
         LEFT JOIN (SELECT l.product_id, sum(l.quantity) AS qty FROM inventory_reservation_line l
                    JOIN inventory_reservation r USING (order_id)
                    WHERE r.status = 'fulfilled' GROUP BY l.product_id) f USING (product_id)
         WHERE s.available + s.reserved + COALESCE(f.qty, 0) <> $1",
    )
    .bind(STOCK)
    .fetch_all(&env.pool)
    .await?;
    assert!(broken.is_empty(), "stock not conserved: {broken:?}");
    let reserved_mismatch: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inventory_stock s
         LEFT JOIN (SELECT l.product_id, sum(l.quantity) AS qty FROM inventory_reservation_line l
                    JOIN inventory_reservation r USING (order_id)
                    WHERE r.status = 'reserved' GROUP BY l.product_id) r USING (product_id)
         WHERE s.reserved <> COALESCE(r.qty, 0)",
    )
    .fetch_one(&env.pool)
    .await?;
    assert_eq!(
        reserved_mismatch, 0,
        "reserved stock disagrees with open reservations"
    );
    // Every order's final state matches the consumer's view.
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders o LEFT JOIN inventory_reservation r ON r.order_id = o.order_id::text
         WHERE r.status IS DISTINCT FROM CASE o.status WHEN 'cancelled' THEN 'released'
                                                       WHEN 'shipped' THEN 'fulfilled'
                                                       ELSE 'reserved' END",
    )
    .fetch_one(&env.pool)
    .await?;
    assert_eq!(
        mismatched, 0,
        "reservation state disagrees with order state"
    );
    let notifications: i64 = sqlx::query_scalar("SELECT count(*) FROM notification")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(notifications, events, "one notification per event");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_orders_are_applied_exactly_once_in_order() -> anyhow::Result<()> {
    let env = TestEnv::new("e2e", 12).await?;
    prepare(&env)?;
    let (order_service, url) = env.order_service().await?;
    let (relay, _) = env.relay("relay").await?;
    let (consumer, consumer_metrics) = env.consumer("consumer").await?;

    let started = Instant::now();
    let summary = env.log_dir.join("load.json");
    let summary_path = summary.to_string_lossy().into_owned();
    let mut args = load_args(&url, "1000", "0", "7");
    args.extend(["--summary-json", &summary_path]);
    env.run_to_end("load", &args, Duration::from_secs(300))?;
    let load: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&summary)?)?;
    let expected_events = load["events"].as_i64().expect("events in load summary");
    assert_eq!(load["orders"].as_i64(), Some(1000));
    assert!(
        expected_events >= 2000,
        "several events per order: {expected_events}"
    );

    env.wait_drained(&GROUPS, Duration::from_secs(180)).await?;
    let elapsed = started.elapsed();
    assert_exactly_once_in_order(&env, expected_events).await?;
    let processed = scrape_sum(
        &consumer_metrics,
        "consumer_messages_total",
        &["outcome=\"processed\""],
    )
    .await?;
    assert_eq!(
        processed as i64,
        2 * expected_events,
        "metrics count every applied event"
    );
    println!("e2e: 1000 orders, {expected_events} events, both groups drained in {elapsed:.1?}");

    // Graceful shutdown: every process exits cleanly on SIGTERM.
    for service in [consumer, relay, order_service] {
        service.stop_cleanly(Duration::from_secs(30)).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_relay_and_consumer_loses_nothing_and_applies_nothing_twice() -> anyhow::Result<()>
{
    let env = TestEnv::new("kill", 12).await?;
    prepare(&env)?;
    let (_order_service, url) = env.order_service().await?;
    // Two relays: one active, one standing by.
    let (relay_a, metrics_a) = env.relay("relay-a").await?;
    let (relay_b, metrics_b) = env.relay("relay-b").await?;
    let (consumer, _) = env.consumer("consumer-1").await?;

    let active =
        pipeline_testkit::one_active_relay(&[&metrics_a, &metrics_b], Duration::from_secs(30))
            .await?;
    let (active_relay, standby_relay, standby_metrics) = if active == 0 {
        (relay_a, relay_b, metrics_b)
    } else {
        (relay_b, relay_a, metrics_a)
    };

    let summary = env.log_dir.join("load.json");
    let summary_path = summary.to_string_lossy().into_owned();
    let mut args = load_args(&url, "1000", "150", "11");
    args.extend(["--summary-json", &summary_path]);
    let load_bin = pipeline_testkit::bin_dir().join("load");
    let load = tokio::process::Command::new(load_bin)
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()?;

    // Mid-run: kill the active relay and the consumer with SIGKILL.
    wait_until(
        "a third of the events applied",
        Duration::from_secs(120),
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM applied_effect")
                .fetch_one(&env.pool)
                .await?;
            Ok((n >= 1500).then_some(()))
        },
    )
    .await?;
    active_relay.kill_hard()?;
    consumer.kill_hard()?;
    let killed_at = Instant::now();
    let takeover = wait_until(
        "standby relay takes over",
        Duration::from_secs(20),
        || async {
            Ok(
                (scrape_sum(&standby_metrics, "relay_active", &[]).await? as i64 == 1)
                    .then(|| killed_at.elapsed()),
            )
        },
    )
    .await?;
    println!("standby relay active {takeover:.1?} after the active one was killed");
    let (_consumer2, consumer2_metrics) = env.consumer("consumer-2").await?;
    let (_relay_c, _) = env.relay("relay-c").await?;

    let expected_events = finish_load(&env, load, &summary).await?;
    let duplicates = scrape_sum(
        &consumer2_metrics,
        "consumer_messages_total",
        &["outcome=\"duplicate\""],
    )
    .await?;
    println!(
        "kill run: {expected_events} events; standby relay active {takeover:.1?} after the kill; \
         the restarted consumer skipped {duplicates} already-applied deliveries"
    );
    drop(standby_relay);
    Ok(())
}

/// Waits for the load driver started in the background, then for the pipeline to drain, and
/// checks every event it acknowledged (its summary at `summary`); returns their number.
async fn finish_load(
    env: &TestEnv,
    mut load: tokio::process::Child,
    summary: &std::path::Path,
) -> anyhow::Result<i64> {
    let status = tokio::time::timeout(Duration::from_secs(300), load.wait()).await??;
    assert!(status.success(), "load driver failed");
    let load: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(summary)?)?;
    let expected_events = load["events"].as_i64().expect("events in load summary");
    env.wait_drained(&GROUPS, Duration::from_secs(180)).await?;
    assert_exactly_once_in_order(env, expected_events).await?;
    Ok(expected_events)
}

/// Partitions assigned to the member behind `metrics`, both groups together.
async fn assigned(metrics: &str) -> anyhow::Result<i64> {
    Ok(scrape_sum(metrics, "consumer_assigned_partitions", &[]).await? as i64)
}

/// A group on `protocol` under load: a second member joins (the partitions are shared between
/// the two, none held twice), then the first is killed (the survivor takes all of them, after
/// the session timeout), and still every event is applied exactly once and in order.
async fn members_come_and_go(protocol: &str) -> anyhow::Result<()> {
    const PARTITIONS: i64 = 12;
    let every = PARTITIONS * GROUPS.len() as i64;
    let env = TestEnv::new(&format!("proto-{protocol}"), PARTITIONS as i32).await?;
    prepare(&env)?;
    let (_order_service, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let args = ["--group-protocol", protocol];
    let (first, first_metrics) = env.consumer_with_args("consumer-1", &args).await?;
    wait_until(
        "the first member holds every partition",
        Duration::from_secs(60),
        || async { Ok((assigned(&first_metrics).await? == every).then_some(())) },
    )
    .await?;

    let summary = env.log_dir.join("load.json");
    let summary_path = summary.to_string_lossy().into_owned();
    let mut load_args = load_args(&url, "900", "100", "17");
    load_args.extend(["--summary-json", &summary_path]);
    let load = tokio::process::Command::new(pipeline_testkit::bin_dir().join("load"))
        .args(&load_args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()?;

    wait_until("some events applied", Duration::from_secs(60), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM applied_effect")
            .fetch_one(&env.pool)
            .await?;
        Ok((n >= 300).then_some(()))
    })
    .await?;
    let (_second, second_metrics) = env.consumer_with_args("consumer-2", &args).await?;
    let joined = Instant::now();
    let shared = wait_until(
        "the two members share the partitions",
        Duration::from_secs(60),
        || async {
            let (a, b) = (
                assigned(&first_metrics).await?,
                assigned(&second_metrics).await?,
            );
            // Each partition held by one member: the two hold every partition between them.
            Ok((a > 0 && b > 0 && a + b == every).then_some((a, b)))
        },
    )
    .await?;
    let split = joined.elapsed();

    first.kill_hard()?;
    let killed = Instant::now();
    wait_until(
        "the surviving member holds every partition",
        Duration::from_secs(60),
        || async { Ok((assigned(&second_metrics).await? == every).then_some(())) },
    )
    .await?;
    let takeover = killed.elapsed();

    let expected_events = finish_load(&env, load, &summary).await?;
    let rebalances = scrape_sum(&second_metrics, "consumer_rebalances_total", &[]).await?;
    println!(
        "group protocol {protocol}: {expected_events} events; partitions split {}/{} {split:.1?} \
         after the second member started; the survivor held all {every} {takeover:.1?} after the \
         first was killed ({rebalances} rebalance callbacks on it)",
        shared.0, shared.1
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_group_protocol_shares_and_takes_over_partitions_exactly_once() -> anyhow::Result<()>
{
    members_come_and_go("classic").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_group_protocol_shares_and_takes_over_partitions_exactly_once(
) -> anyhow::Result<()> {
    members_come_and_go("consumer").await
}
