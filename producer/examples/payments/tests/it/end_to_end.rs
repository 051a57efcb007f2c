//! The example end to end, on the real broker (`KAFKA_BROKERS`, default 127.0.0.1:9092) and a
//! real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): the payments service appends events in its
//! own transactions, the relay publishes them, the `shipping` group applies every one once and
//! in order per payment; the operator's console, nested in the program's router under a prefix,
//! serves and links under it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common;

use operator::console::ConsoleSettings;
use payments_example::program::ConsoleConfig;
use payments_example::{program, Payments};
use pipeline_testkit::db::database_url;
use pipeline_testkit::kafka::{brokers, committed_lag, kafka_args};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const PAYMENTS: usize = 60;

/// Where the program mounts the console.
const CONSOLE: &str = "/ops/console";

#[sqlx::test(migrations = false)]
async fn payments_reach_the_shipping_group_once_and_in_order(pool: PgPool) {
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("payment-events-{run_id}");
    kafka_args(&brokers())
        .ensure_topics(std::slice::from_ref(&topic), 6)
        .await
        .expect("topic");
    let url = database_url(&pool);
    let shutdown = CancellationToken::new();

    // The example's program: its tables, its registry and router, the shipping group, and the
    // relay, in one process.
    let mut config = common::config(&url, &topic, &format!("{run_id}-"));
    config.relay = Some(relay::RelaySettings {
        kafka: kafka_args(&brokers()),
        lock_key: rand_key(),
        ..relay::RelaySettings::default()
    });
    let token = format!("token-{run_id}");
    let token_hash: String = Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    config.console = Some(ConsoleConfig {
        users: format!("ops:operator:sha256:{token_hash}")
            .parse()
            .expect("users"),
        settings: ConsoleSettings {
            prefix: CONSOLE.to_owned(),
            ..ConsoleSettings::default()
        },
    });
    let program = program::start(config, shutdown.clone())
        .await
        .expect("the program starts");
    let addr = program.addr;
    let running = tokio::spawn(program.wait());

    // The service at work: every payment captured, every third one refunded afterwards.
    let payments = Payments::new(pool.clone(), topic.clone());
    let mut expected: BTreeMap<String, Vec<(i64, &str)>> = BTreeMap::new();
    for n in 0..PAYMENTS {
        let id = format!("pay-{n}");
        let captured = payments
            .capture(&id, 1_000 + n as i64)
            .await
            .expect("capture");
        expected
            .entry(id.clone())
            .or_default()
            .push((captured.sequence(), "ship"));
        if n % 3 == 0 {
            let refunded = payments.refund(&id).await.expect("refund");
            expected
                .entry(id)
                .or_default()
                .push((refunded.sequence(), "cancel"));
        }
    }
    let events: usize = expected.values().map(Vec::len).sum();

    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let logged: i64 = sqlx::query_scalar("SELECT count(*) FROM shipment_log")
            .fetch_one(&pool)
            .await
            .expect("count");
        if logged as usize >= events {
            break;
        }
        assert!(!running.is_finished(), "the program stopped");
        assert!(
            Instant::now() < deadline,
            "{logged} of {events} events applied after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Look once nothing more can come: the relay has published everything and the group has
    // committed every offset, so no delivery (a duplicate included) is still on its way.
    let group = format!("{run_id}-shipping");
    loop {
        let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_unpublished")
            .fetch_one(&pool)
            .await
            .expect("count");
        let lag = {
            let (group, topic) = (group.clone(), topic.clone());
            tokio::task::spawn_blocking(move || {
                committed_lag(&kafka_args(&brokers()), &group, &topic)
            })
            .await
            .expect("lag task")
            .expect("lag")
        };
        if unpublished == 0 && lag == Some(0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained after 90 s: {unpublished} unpublished, lag {lag:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT payment_id, sequence, action FROM shipment_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("log");
    let mut applied: BTreeMap<String, Vec<(i64, &str)>> = BTreeMap::new();
    for (payment, sequence, action) in &rows {
        let action = if action == "ship" { "ship" } else { "cancel" };
        applied
            .entry(payment.clone())
            .or_default()
            .push((*sequence, action));
    }
    assert_eq!(rows.len(), events, "every event applied once");
    assert_eq!(applied, expected, "in order per payment");

    // The program's own route and the libraries' metrics, on its one router.
    let http = reqwest::Client::new();
    let refunded: serde_json::Value = http
        .get(format!("http://{addr}/payments/pay-0"))
        .send()
        .await
        .expect("GET /payments/pay-0")
        .json()
        .await
        .expect("json");
    assert_eq!(refunded["status"], "refunded");
    let metrics = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    for name in ["outbox_published_total", "consumer_messages_total"] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }

    console_under_its_prefix(&addr.to_string(), &token).await;

    shutdown.cancel();
    running
        .await
        .expect("the program's task")
        .expect("the program stops cleanly");
}

/// The console in the program's router: its pages, forms, scripts and redirects stay under
/// [`CONSOLE`], a login there opens a session for that path only, and it shows the program's
/// group.
async fn console_under_its_prefix(addr: &str, token: &str) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let base = format!("http://{addr}{CONSOLE}");
    // Without a session: to the login page, under the prefix.
    let refused = http
        .get(format!("{base}/groups"))
        .send()
        .await
        .expect("GET groups");
    assert!(refused.status().is_redirection(), "{}", refused.status());
    let to = refused.headers()["location"].to_str().expect("location");
    assert!(to.starts_with(&format!("{CONSOLE}/login")), "{to}");
    let login = http
        .get(format!("{base}/login"))
        .send()
        .await
        .expect("GET login");
    assert_eq!(login.status(), 200);
    links_under_prefix(&login.text().await.expect("login page"));
    // A login: the session cookie's path is the prefix, and it leads to the overview.
    let opened = http
        .post(format!("{base}/login"))
        .form(&[("user", "ops"), ("password", token), ("next", "")])
        .send()
        .await
        .expect("POST login");
    assert!(opened.status().is_redirection(), "{}", opened.status());
    assert!(
        opened.headers()["location"]
            .to_str()
            .expect("location")
            .starts_with(CONSOLE),
        "{:?}",
        opened.headers()["location"]
    );
    let cookie = opened.headers()["set-cookie"].to_str().expect("cookie");
    assert!(cookie.contains(&format!("Path={CONSOLE};")), "{cookie}");
    let session = cookie.split(';').next().expect("name=value").to_owned();
    // The overview is the prefix itself.
    for page in ["", "/groups", "/dead-letters", "/outbox", "/timeline"] {
        let answer = http
            .get(format!("{base}{page}"))
            .header("cookie", &session)
            .send()
            .await
            .expect("GET page");
        assert_eq!(answer.status(), 200, "{page}");
        links_under_prefix(&answer.text().await.expect("page"));
    }
    let groups: serde_json::Value = http
        .get(format!("{base}/api/groups"))
        .header("cookie", &session)
        .send()
        .await
        .expect("GET api/groups")
        .json()
        .await
        .expect("json");
    assert!(
        groups.to_string().contains("shipping"),
        "the program's group: {groups}"
    );
}

/// Every `href`, `src` and `action` of `html` is a path under [`CONSOLE`].
fn links_under_prefix(html: &str) {
    let mut links = 0;
    for attribute in ["href=\"", "src=\"", "action=\""] {
        for (at, _) in html.match_indices(attribute) {
            let value = &html[at + attribute.len()..];
            let value = &value[..value.find('"').expect("closing quote")];
            assert!(
                value.starts_with(&format!("{CONSOLE}/")) || value == CONSOLE,
                "{attribute}{value}\" is outside {CONSOLE}"
            );
            links += 1;
        }
    }
    assert!(links > 0, "no link in {html}");
}

fn rand_key() -> i64 {
    i64::from(uuid::Uuid::new_v4().as_fields().0)
}
