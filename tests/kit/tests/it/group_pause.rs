//! Pausing a group through the real binaries: `pipeline group pause inventory` stops the group's
//! members (two consumer processes, the second joining during the pause, so its partitions are
//! assigned paused) from applying anything while orders keep being published; the inventory
//! group's lag grows by exactly what was published, the notification group beside it is not
//! held, and the pause shows in `pipeline status` and in the consumers' metrics. After
//! `pipeline group resume inventory` every event is applied exactly once, each order's in
//! sequence order, and both actions show in `pipeline trace`. The command refuses a pause
//! without a note or of an unknown group with exit status 2.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pipeline_testkit::effects::assert_exactly_once_in_order;
use pipeline_testkit::{bin_dir, metric_sum, scrape, scrape_sum, wait_until, TestEnv};

const GROUPS: [&str; 2] = ["inventory", "notification"];
const PRODUCTS: u32 = 20;

async fn outbox_events(env: &TestEnv) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&env.pool)
        .await?)
}

async fn applied(env: &TestEnv, kind: &str) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM applied_effect WHERE group_name = $1")
            .bind(env.group(kind))
            .fetch_one(&env.pool)
            .await?,
    )
}

/// Waits until the outbox holds nothing unpublished and `kinds` have committed everything.
async fn published_and_drained(env: &TestEnv, kinds: &[&str]) -> anyhow::Result<()> {
    env.wait_drained(kinds, Duration::from_secs(60)).await
}

/// `pipeline args… --group-prefix P --topic T` run to its end: exit status, stdout, stderr.
fn pipeline(env: &TestEnv, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let out = Command::new(bin_dir().join("pipeline"))
        .args(args)
        .args(["--group-prefix", &env.group_prefix, "--topic", &env.topic])
        .env("DATABASE_URL", &env.database_url)
        .env("KAFKA_BROKERS", &env.brokers)
        .env("PIPELINE_ACTOR", "ops-on-call")
        .stdin(Stdio::null())
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `pipeline args…`, which must succeed; its stdout.
fn pipeline_ok(env: &TestEnv, args: &[&str]) -> anyhow::Result<String> {
    let (status, stdout, stderr) = pipeline(env, args)?;
    anyhow::ensure!(
        status == 0,
        "pipeline {args:?}: {status}\n{stdout}\n{stderr}"
    );
    Ok(stdout)
}

/// Waits until the consumer serving `metrics` holds the inventory group paused (or running).
async fn paused_in(env: &TestEnv, metrics: &str, paused: bool) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let label = format!("group=\"{}\"", env.group("inventory"));
    wait_until(
        "the consumer follows the pause",
        Duration::from_secs(10),
        || async {
            let gauge = scrape_sum(metrics, "consumer_group_paused", &[&label]).await?;
            Ok((gauge == f64::from(u8::from(paused))).then_some(()))
        },
    )
    .await?;
    Ok(started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_group_applies_nothing_keeps_its_partitions_and_resumes_exactly_once(
) -> anyhow::Result<()> {
    let env = TestEnv::new("pause", 4).await?;
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(1_000_000))?;
    let (order_service, url) = env.order_service().await?;
    let (relay, _) = env.relay("relay").await?;
    let lag_every = ["--lag-interval", "500ms"];
    let (first, first_metrics) = env.consumer_with_args("consumer-1", &lag_every).await?;
    env.place_orders(&url, 30, PRODUCTS, 1)?;
    published_and_drained(&env, &GROUPS).await?;
    let before = outbox_events(&env).await?;
    assert_eq!(applied(&env, "inventory").await?, before);

    // Bad input changes nothing: no note, an empty note, an unknown group.
    let (status, _, stderr) = pipeline(&env, &["group", "pause", "inventory"])?;
    assert_eq!(status, 2, "a pause without --note: {stderr}");
    assert!(stderr.contains("--note"), "{stderr}");
    let (status, _, stderr) = pipeline(&env, &["group", "pause", "inventory", "--note", " "])?;
    assert_eq!(status, 2, "an empty note: {stderr}");
    let (status, _, stderr) = pipeline(&env, &["group", "pause", "nosuchgroup", "--note", "x"])?;
    assert_eq!(status, 2, "an unknown group: {stderr}");
    assert!(
        stderr.contains("unknown consumer group nosuchgroup"),
        "{stderr}"
    );
    let (status, _, stderr) = pipeline(&env, &["group", "resume", "inventory"])?;
    assert_eq!(status, 2, "a resume without --note: {stderr}");

    let out = pipeline_ok(
        &env,
        &[
            "group",
            "pause",
            "inventory",
            "--note",
            "stock service migration",
        ],
    )?;
    assert!(out.contains("group inventory paused"), "{out}");
    let took = paused_in(&env, &first_metrics, true).await?;
    println!("the member followed the pause within {took:.1?}");
    // Members read the pause every second; five such reads leave room for a machine busy with
    // five processes, and a member that does not read it regularly still fails.
    assert!(took < Duration::from_secs(5), "{took:?}");
    // Pausing again changes and records nothing.
    let again = pipeline_ok(
        &env,
        &["group", "pause", "inventory", "--note", "twice", "--json"],
    )?;
    let again: serde_json::Value = serde_json::from_str(&again)?;
    assert_eq!(again["changed"], false, "{again}");
    assert_eq!(again["pause"]["note"], "stock service migration", "{again}");

    // A second member joins during the pause: the partitions it is given start paused.
    let (second, second_metrics) = env.consumer_with_args("consumer-2", &lag_every).await?;
    paused_in(&env, &second_metrics, true).await?;
    let inventory = format!("group=\"{}\"", env.group("inventory"));
    wait_until(
        "the second member has partitions",
        Duration::from_secs(30),
        || async {
            let assigned = scrape_sum(
                &second_metrics,
                "consumer_assigned_partitions",
                &[&inventory],
            )
            .await?;
            Ok((assigned > 0.0).then_some(()))
        },
    )
    .await?;

    // Orders keep coming: the notification group applies them, the paused group nothing.
    env.place_orders(&url, 30, PRODUCTS, 2)?;
    published_and_drained(&env, &["notification"]).await?;
    let total = outbox_events(&env).await?;
    let published_while_paused = total - before;
    assert!(published_while_paused > 0);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        applied(&env, "inventory").await?,
        before,
        "the paused group applied nothing"
    );
    let lag = env.lag("inventory")?;
    assert_eq!(
        lag,
        Some(published_while_paused),
        "the lag is what was published during the pause"
    );
    wait_until("the lag metric grows", Duration::from_secs(10), || async {
        let page = scrape(&first_metrics).await?;
        let lag = metric_sum(&page, "consumer_group_lag_messages", &[&inventory]);
        Ok((lag == published_while_paused as f64).then_some(()))
    })
    .await?;
    let page = scrape(&second_metrics).await?;
    assert_eq!(
        metric_sum(&page, "consumer_group_members", &[&inventory]),
        2.0,
        "both members stay in the group"
    );

    let status = pipeline_ok(
        &env,
        &[
            "status",
            "--json",
            "--group",
            "inventory",
            "--group",
            "notification",
        ],
    )?;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    let group = |name: &str| {
        status["groups"]
            .as_array()
            .and_then(|g| g.iter().find(|g| g["group"] == name).cloned())
            .unwrap_or_default()
    };
    let inventory_status = group("inventory");
    assert_eq!(inventory_status["state"], "paused", "{status}");
    assert_eq!(
        inventory_status["paused"]["actor"], "ops-on-call",
        "{status}"
    );
    assert_eq!(
        inventory_status["paused"]["note"], "stock service migration",
        "{status}"
    );
    assert!(inventory_status["paused"]["since"].is_string(), "{status}");
    assert_eq!(
        inventory_status["lag_messages"], published_while_paused,
        "{status}"
    );
    assert_eq!(group("notification")["state"], "running", "{status}");
    let text = pipeline_ok(&env, &["status", "--group", "inventory"])?;
    assert!(
        text.contains("paused since") && text.contains("by ops-on-call: stock service migration"),
        "{text}"
    );

    // Resumed: both members go on, every event applied once and in order.
    let out = pipeline_ok(
        &env,
        &["group", "resume", "inventory", "--note", "migration done"],
    )?;
    assert!(out.contains("group inventory resumed"), "{out}");
    paused_in(&env, &first_metrics, false).await?;
    paused_in(&env, &second_metrics, false).await?;
    published_and_drained(&env, &GROUPS).await?;
    assert_exactly_once_in_order(&env, &GROUPS).await?;
    let again = pipeline_ok(&env, &["group", "resume", "inventory", "--note", "twice"])?;
    assert!(again.contains("is not paused; nothing changed"), "{again}");

    // One pause and one resume recorded, with who and why; an order placed before the pause
    // shows both in its trace.
    let actions: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT action, actor, reason FROM operator_action WHERE group_name = $1 ORDER BY id",
    )
    .bind(env.group("inventory"))
    .fetch_all(&env.pool)
    .await?;
    assert_eq!(
        actions,
        vec![
            (
                "group.pause".into(),
                "ops-on-call".into(),
                "stock service migration".into()
            ),
            (
                "group.resume".into(),
                "ops-on-call".into(),
                "migration done".into()
            ),
        ]
    );
    let order: String = sqlx::query_scalar("SELECT aggregate_id FROM outbox ORDER BY id LIMIT 1")
        .fetch_one(&env.pool)
        .await?;
    let trace = pipeline_ok(&env, &["trace", &order, "--json", "--group", "inventory"])?;
    let trace: serde_json::Value = serde_json::from_str(&trace)?;
    let steps: Vec<(String, String)> = trace["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| {
            s["transition"]
                .as_str()
                .is_some_and(|t| t.starts_with("group."))
        })
        .map(|s| {
            (
                s["transition"].as_str().unwrap_or_default().to_owned(),
                s["detail"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        vec![
            (
                "group.pause".into(),
                "by ops-on-call: stock service migration".into()
            ),
            (
                "group.resume".into(),
                "by ops-on-call: migration done".into()
            ),
        ],
        "{trace}"
    );

    first.stop_cleanly(Duration::from_secs(30)).await?;
    second.stop_cleanly(Duration::from_secs(30)).await?;
    order_service.stop_cleanly(Duration::from_secs(30)).await?;
    relay.stop_cleanly(Duration::from_secs(30)).await?;
    Ok(())
}
