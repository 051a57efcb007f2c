//! Rate limits through the real binaries: a group limited to N events a second applies a backlog
//! at that rate (measured on its effects' commit times) while an unlimited group beside it does
//! not wait, every event still applied once and in order per order; the limit shows in the
//! metrics and in `pipeline status`, the lag drains at the limit's pace, and a limited consumer
//! stops at once on SIGTERM, losing nothing.

use std::time::{Duration, Instant};

use pipeline_testkit::effects::assert_exactly_once_in_order;
use pipeline_testkit::{metric_sum, scrape, scrape_sum, wait_until, TestEnv};

const GROUPS: [&str; 2] = ["inventory", "notification"];
const PRODUCTS: u32 = 50;
/// The limit of the measured test, in events a second.
const LIMIT: f64 = 200.0;

/// The test's orders placed and published (the consumer not yet running, so they wait in Kafka
/// as a backlog); returns how many events they made.
async fn backlog(env: &TestEnv, orders: u32) -> anyhow::Result<i64> {
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(1_000_000))?;
    let (order_service, url) = env.order_service().await?;
    let (relay, _) = env.relay("relay").await?;
    let orders = orders.to_string();
    env.run_to_end(
        "load",
        &[
            "--url",
            &url,
            "--orders",
            &orders,
            "--rate",
            "0",
            "--concurrency",
            "16",
            "--products",
            "50",
            "--seed",
            "11",
        ],
        Duration::from_secs(300),
    )?;
    wait_until("outbox published", Duration::from_secs(120), || async {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
            .fetch_one(&env.pool)
            .await?;
        Ok((pending == 0).then_some(()))
    })
    .await?;
    order_service.stop_cleanly(Duration::from_secs(30)).await?;
    relay.stop_cleanly(Duration::from_secs(30)).await?;
    Ok(sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&env.pool)
        .await?)
}

/// Events applied by `kind`, the seconds from its first commit to its last, and the most it
/// committed within any one second.
async fn applied_span(env: &TestEnv, kind: &str) -> anyhow::Result<(i64, f64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*),
                EXTRACT(EPOCH FROM max(applied_at) - min(applied_at))::float8,
                COALESCE(max(in_a_second), 0)
         FROM (SELECT applied_at,
                      count(*) OVER (ORDER BY applied_at
                                     RANGE BETWEEN CURRENT ROW AND '999 milliseconds' FOLLOWING)
                          AS in_a_second
               FROM applied_effect WHERE group_name = $1) a",
    )
    .bind(env.group(kind))
    .fetch_one(&env.pool)
    .await?)
}

/// One group's line of `pipeline status`: its name, lag in messages and rate limit.
type GroupLine = (String, Option<i64>, Option<String>);

/// `pipeline status --json` for the test's groups.
fn status(env: &TestEnv) -> anyhow::Result<Vec<GroupLine>> {
    let out = env.run_to_end(
        "pipeline",
        &[
            "status",
            "--json",
            "--group",
            "inventory",
            "--group",
            "notification",
            "--group-prefix",
            &env.group_prefix,
            "--topic",
            &env.topic,
        ],
        Duration::from_secs(60),
    )?;
    let status: serde_json::Value = serde_json::from_str(&out)?;
    Ok(status["groups"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|g| {
            (
                g["group"].as_str().unwrap_or_default().to_owned(),
                g["lag_messages"].as_i64(),
                g["rate_limit"].as_str().map(str::to_owned),
            )
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_group_applies_a_backlog_at_its_rate_exactly_once_in_order() -> anyhow::Result<()>
{
    let env = TestEnv::new("ratelimit", 12).await?;
    let events = backlog(&env, 900).await?;
    assert!(
        events >= 2_000,
        "a backlog of at least 2,000 events: {events}"
    );

    let (consumer, metrics) = env
        .consumer_with_args("consumer", &["--rate-limit", "inventory=200/s"])
        .await?;
    let started = Instant::now();
    // Mid-burst: the limit shows beside the lag, which the limited group is still working off.
    // Lag counts from committed offsets, so first a second's worth of events applied (the group
    // joined and committed); the whole backlog takes ten seconds or more at the limit.
    wait_until(
        "the limited group applying",
        Duration::from_secs(60),
        || async {
            let (applied, _, _) = applied_span(&env, "inventory").await?;
            Ok((applied >= LIMIT as i64).then_some(()))
        },
    )
    .await?;
    let groups = status(&env)?;
    let inventory = groups
        .iter()
        .find(|g| g.0 == "inventory")
        .expect("inventory in the status");
    assert_eq!(inventory.2.as_deref(), Some("200/s"), "{groups:?}");
    assert!(
        inventory.1.is_some_and(|lag| lag > 0),
        "the limited group lags mid-burst: {groups:?}"
    );
    let notification = groups.iter().find(|g| g.0 == "notification");
    assert_eq!(notification.and_then(|g| g.2.clone()), None, "{groups:?}");

    env.wait_drained(&GROUPS, Duration::from_secs(120)).await?;
    let drained = started.elapsed();
    assert_exactly_once_in_order(&env, &GROUPS).await?;

    let (applied, span, busiest_second) = applied_span(&env, "inventory").await?;
    assert_eq!(applied, events);
    let rate = (applied - 1) as f64 / span;
    println!(
        "rate limit {LIMIT}/s: {applied} events applied in {span:.2} s = {rate:.1} events/s \
         (busiest second {busiest_second}); drained in {drained:.1?}"
    );
    // Never above the limit; below it by at most what a busy machine's stalls take (a limiter
    // that held back twice as much would still fail).
    assert!(
        (LIMIT * 0.75..=LIMIT * 1.15).contains(&rate),
        "{rate:.1} events/s against a limit of {LIMIT}/s"
    );
    // A bucket of a tenth of a second's events: no second applies much more than the limit.
    assert!(
        (busiest_second as f64) <= LIMIT * 1.5,
        "{busiest_second} events applied within one second"
    );
    // The unlimited group beside it did not wait for the limit.
    let (_, unlimited_span, _) = applied_span(&env, "notification").await?;
    assert!(
        unlimited_span < span / 2.0,
        "the unlimited group took {unlimited_span:.2} s, the limited one {span:.2} s"
    );

    let page = scrape(&metrics).await?;
    let inventory = format!("group=\"{}\"", env.group("inventory"));
    let notification = format!("group=\"{}\"", env.group("notification"));
    let gauge = metric_sum(
        &page,
        "consumer_rate_limit_events_per_second",
        &[&inventory],
    );
    assert_eq!(gauge, LIMIT);
    let delayed = metric_sum(
        &page,
        "consumer_rate_limit_delayed_events_total",
        &[&inventory],
    );
    assert!(
        delayed >= 0.9 * events as f64 && delayed <= events as f64,
        "{delayed} of {events} events delayed"
    );
    let waited = metric_sum(
        &page,
        "consumer_rate_limit_wait_seconds_total",
        &[&inventory],
    );
    assert!(
        waited >= span * 0.5,
        "waited {waited} s over a {span:.1} s burst"
    );
    assert_eq!(
        metric_sum(
            &page,
            "consumer_rate_limit_delayed_events_total",
            &[&notification]
        ),
        0.0
    );
    assert!(!page.contains(&format!(
        "consumer_rate_limit_events_per_second{{{notification}}}"
    )));
    consumer.stop_cleanly(Duration::from_secs(30)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_waiting_for_its_limit_stops_at_once_and_loses_nothing() -> anyhow::Result<()> {
    let env = TestEnv::new("ratestop", 6).await?;
    let events = backlog(&env, 300).await?;
    // 20 events a second: the backlog would take half a minute.
    let (consumer, metrics) = env
        .consumer_with_args("limited", &["--rate-limit", "inventory=20/s"])
        .await?;
    wait_until(
        "the limit delays events",
        Duration::from_secs(60),
        || async {
            let delayed = scrape_sum(
                &metrics,
                "consumer_rate_limit_delayed_events_total",
                &[&format!("group=\"{}\"", env.group("inventory"))],
            )
            .await?;
            Ok((delayed > 0.0).then_some(()))
        },
    )
    .await?;
    let stopping = Instant::now();
    consumer.stop_cleanly(Duration::from_secs(15)).await?;
    let stopped_in = stopping.elapsed();
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM applied_effect WHERE group_name = $1")
            .bind(env.group("inventory"))
            .fetch_one(&env.pool)
            .await?;
    println!("stopped in {stopped_in:.1?} with {applied} of {events} events applied");
    assert!(applied < events, "stopped mid-backlog");
    assert!(
        stopped_in < Duration::from_secs(10),
        "waited for the limit on shutdown: {stopped_in:?}"
    );

    // Without the limit the rest is applied, nothing twice; the operator sees no limit.
    let (consumer, _) = env.consumer("unlimited").await?;
    env.wait_drained(&GROUPS, Duration::from_secs(120)).await?;
    assert_exactly_once_in_order(&env, &GROUPS).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM group_rate_limit")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(
        rows, 0,
        "a consumer without a limit removes the recorded one"
    );
    consumer.stop_cleanly(Duration::from_secs(30)).await?;
    Ok(())
}
