//! Rate limits on the command line and in the notification dispatcher: `--rate-limit GROUP=N/s`
//! and `--notification-sends-per-second N` map onto the libraries' settings, bad values are
//! refused before anything connects or writes, and the dispatcher calls its sender no faster
//! than its limit (measured, against a real PostgreSQL: `#[sqlx::test]`, `DATABASE_URL`).

use std::num::NonZeroU32;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use consumer::RateLimit;
use demo_groups::cli::{Cli, Command as Subcommand};
use demo_groups::notification::{dispatch, DispatchSettings, Notification, NotificationSender};
use futures::future::BoxFuture;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

fn run_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "consumer",
        "run",
        "--group",
        "inventory",
        "--group",
        "notification",
        "--topic",
        "order-events",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn limits_on_the_command_line_map_onto_the_settings() {
    let cli = Cli::try_parse_from(run_args(&[
        "--rate-limit",
        "inventory=200/s",
        "--rate-limit",
        "notification=30/min",
        "--notification-sends-per-second",
        "50",
    ]))
    .expect("parses");
    let Subcommand::Run(run) = cli.command else {
        panic!("run expected")
    };
    assert_eq!(
        run.run.rate_limits,
        vec![
            RateLimit::per_second("inventory", 200),
            RateLimit::per_minute("notification", 30)
        ]
    );
    run.run.validate().expect("valid");
    assert_eq!(run.notification_sends_per_second, NonZeroU32::new(50));

    let cli = Cli::try_parse_from(run_args(&[])).expect("parses");
    let Subcommand::Run(run) = cli.command else {
        panic!("run expected")
    };
    assert!(run.run.rate_limits.is_empty(), "no limit by default");
    assert_eq!(run.notification_sends_per_second, None);
}

#[test]
fn bad_limits_are_refused_with_the_reason() {
    for (flag, value, reason) in [
        ("--rate-limit", "inventory=0/s", "zero"),
        ("--rate-limit", "inventory=-3/s", "negative"),
        ("--rate-limit", "inventory=lots/s", "not a whole number"),
        ("--rate-limit", "inventory=200", "no unit"),
        ("--rate-limit", "inventory=200/hour", "unknown unit `hour`"),
        ("--rate-limit", "200/s", "GROUP=N/s"),
        ("--notification-sends-per-second", "0", "zero"),
        ("--notification-sends-per-second", "-1", "negative"),
        (
            "--notification-sends-per-second",
            "ten",
            "not a whole number",
        ),
    ] {
        let arg = format!("{flag}={value}");
        let error = Cli::try_parse_from(run_args(&[&arg]))
            .expect_err(value)
            .to_string();
        assert!(error.contains(flag), "{value}: {error}");
        assert!(error.contains(reason), "{value}: {error}");
    }
}

/// Runs the `consumer` binary against a database that does not exist on a port nothing listens
/// on: whatever it refuses, it refuses before connecting, so it writes nothing.
fn consumer_binary(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_consumer"))
        .args(args)
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/nothing")
        .env("KAFKA_BROKERS", "127.0.0.1:1")
        .env_remove("CONSUMER_RATE_LIMITS")
        .env_remove("CONSUMER_GROUPS")
        .envs(env.iter().copied())
        .output()
        .expect("run consumer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_binary_refuses_bad_limits_before_connecting_and_exits_non_zero() {
    let run = ["run", "--group", "inventory", "--topic", "order-events"];
    let with = |extra: &[&'static str]| {
        let mut args = run.to_vec();
        args.extend_from_slice(extra);
        args
    };
    let (status, stderr) = consumer_binary(&with(&["--rate-limit", "inventory=0/s"]), &[]);
    assert_ne!(status, 0);
    assert!(stderr.contains("a limit of zero"), "{stderr}");

    // From the environment, comma separated; a group this process does not run.
    let (status, stderr) = consumer_binary(
        &run,
        &[("CONSUMER_RATE_LIMITS", "inventory=200/s,notification=5/s")],
    );
    assert_ne!(status, 0);
    assert!(
        stderr.contains("does not run group notification"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("connect"),
        "refused before connecting: {stderr}"
    );

    let (status, stderr) = consumer_binary(
        &with(&[
            "--rate-limit",
            "inventory=5/s",
            "--rate-limit",
            "inventory=9/s",
        ]),
        &[],
    );
    assert_ne!(status, 0);
    assert!(stderr.contains("two limits"), "{stderr}");

    let (status, stderr) = consumer_binary(&with(&["--notification-sends-per-second", "0"]), &[]);
    assert_ne!(status, 0);
    assert!(stderr.contains("a limit of zero"), "{stderr}");
}

/// Records when each notification was sent.
#[derive(Default)]
struct RecordingSender {
    sent: Mutex<Vec<(i64, Instant)>>,
}

impl NotificationSender for RecordingSender {
    fn send<'a>(&'a self, n: &'a Notification) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.sent
                .lock()
                .map_err(|_| "poisoned".to_owned())?
                .push((n.id, Instant::now()));
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_dispatcher_calls_its_sender_no_faster_than_its_limit(pool: PgPool) {
    const NOTIFICATIONS: usize = 90;
    const PER_SECOND: u32 = 30;
    sqlx::query(
        "INSERT INTO notification (event_id, order_id, recipient, channel, template)
         SELECT gen_random_uuid(), 'o' || g, 'u' || g || '@example.com', 'email', 'order-shipped'
         FROM generate_series(1, $1) AS g",
    )
    .bind(NOTIFICATIONS as i32)
    .execute(&pool)
    .await
    .expect("notifications");
    let sender = Arc::new(RecordingSender::default());
    let settings = DispatchSettings {
        sends_per_second: NonZeroU32::new(PER_SECOND),
        ..DispatchSettings::default()
    };
    let stop = CancellationToken::new();
    let dispatcher = tokio::spawn(dispatch(
        pool.clone(),
        sender.clone(),
        settings,
        stop.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while sender.sent.lock().expect("sent").len() < NOTIFICATIONS {
        assert!(Instant::now() < deadline, "not all sent within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    dispatcher.await.expect("dispatcher");

    let sent = sender.sent.lock().expect("sent").clone();
    assert_eq!(sent.len(), NOTIFICATIONS, "each sent once");
    let span = sent[sent.len() - 1].1 - sent[0].1;
    let rate = (sent.len() - 1) as f64 / span.as_secs_f64();
    println!("{NOTIFICATIONS} sends limited to {PER_SECOND}/s: {rate:.1}/s over {span:.2?}");
    let limit = f64::from(PER_SECOND);
    // Never above the limit; below it by at most what a busy machine's stalls take over these
    // few seconds (a limiter that held back twice as much would still fail).
    assert!(
        (limit * 0.75..=limit * 1.15).contains(&rate),
        "{rate:.1} sends/s against a limit of {limit}/s"
    );
    // No second sends more than the limit and the bucket (a tenth of a second's sends).
    for (i, (_, at)) in sent.iter().enumerate() {
        let within = sent[i..]
            .iter()
            .take_while(|(_, later)| *later - *at < Duration::from_secs(1))
            .count();
        assert!(
            within as f64 <= limit * 1.1 + 1.0,
            "{within} sends within a second from send {i}"
        );
    }
    let unsent: i64 =
        sqlx::query_scalar("SELECT count(*) FROM notification WHERE status <> 'sent'")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(unsent, 0);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn each_process_records_its_groups_limit_for_the_operator(pool: PgPool) {
    let limit = RateLimit::per_minute("inventory", 90);
    consumer::rate_limit::record(&pool, "t-inventory", Some(&limit))
        .await
        .expect("record");
    let faster = RateLimit::per_second("inventory", 200);
    consumer::rate_limit::record(&pool, "t-inventory", Some(&faster))
        .await
        .expect("record again");
    let row: (String, f64, i32) = sqlx::query_as(
        "SELECT rate, events_per_second, burst FROM group_rate_limit WHERE group_name = 't-inventory'",
    )
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(row, ("200/s".to_owned(), 200.0, 20), "the last one started");
    consumer::rate_limit::record(&pool, "t-inventory", None)
        .await
        .expect("no limit");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM group_rate_limit")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 0, "a process without a limit removes it");
}
