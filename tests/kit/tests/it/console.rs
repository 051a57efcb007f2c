//! The web console in a browser against the real stack: the order service, a relay, the
//! consumer's inventory and notification groups and `pipeline console`, with an order whose first
//! event the inventory group dead-lettered (a stale reservation, removed before the replay) and
//! an order whose first event failed in the outbox. The scenario itself is
//! `tests/console/console.test.mjs`, run with node (playwright-core driving Debian's headless
//! chromium; `scripts/test.sh` installs both): log in, the overview, find and replay the
//! dead-lettered order and see its parked events applied in order, requeue the failed event,
//! pause and resume a group, a read-only user, a POST without the CSRF token, a wrong password;
//! all of it with the console under a path prefix (`--prefix /ops`), every link followed there.
//!
//! Screenshots go to `CONSOLE_SCREENSHOT_DIR` (default: the test's log folder); their paths are
//! printed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_testkit::{wait_until, TestEnv};
use serde_json::json;
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// The repository's root (this crate is tests/kit).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn sha256_hex(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn place(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let response = http
        .post(format!("{url}/orders"))
        .json(&json!({ "customer_id": "c-console", "lines": [{ "product_id": "sku-00001", "quantity": 1 }] }))
        .send()
        .await?;
    anyhow::ensure!(response.status() == 201, "place: {}", response.status());
    let order: serde_json::Value = response.json().await?;
    Ok(order["order_id"].as_str().unwrap_or_default().to_owned())
}

/// The path the console is served under.
const PREFIX: &str = "/ops";

async fn act(http: &reqwest::Client, url: &str, order: &str, verb: &str) -> anyhow::Result<()> {
    let response = http
        .post(format!("{url}/orders/{order}/{verb}"))
        .send()
        .await?;
    anyhow::ensure!(response.status() == 200, "{verb}: {}", response.status());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_browser_replays_requeues_pauses_and_refuses() -> anyhow::Result<()> {
    let node_modules = repo_root().join("tests/console/node_modules/playwright-core");
    if !node_modules.exists() || !Path::new("/usr/bin/chromium").exists() {
        bail!(
            "the browser test needs chromium and tests/console's packages: \
             bash -c 'source scripts/lib.sh; ensure_chromium' and (cd tests/console && npm ci)"
        );
    }
    let env = TestEnv::new("console", 3).await?;
    env.seed_catalog(1)?;
    env.seed_stock(1, Some(1_000_000))?;
    let (_orders, url) = env.order_service().await?;
    let http = reqwest::Client::new();

    // Written while no relay runs: an order the inventory group will dead-letter (a stale
    // reservation of its id), with two later events that will park behind it...
    let dead = place(&http, &url).await?;
    act(&http, &url, &dead, "pay").await?;
    act(&http, &url, &dead, "ship").await?;
    let _ = sqlx::query(
        "INSERT INTO inventory_reservation (order_id, status, reason) VALUES ($1, 'reserved', 'stale')",
    )
    .bind(&dead)
    .execute(&env.pool)
    .await?;
    // ...and an order whose first event failed for good, as the relay records it, holding its
    // second.
    let failed = place(&http, &url).await?;
    act(&http, &url, &failed, "pay").await?;
    let failed_event: Uuid = sqlx::query_scalar(
        "WITH f AS (UPDATE outbox_unpublished u SET state = 'failed', attempts = 5,
                           last_error = 'Broker: Message size too large'
                    FROM outbox o
                    WHERE o.id = u.id AND o.aggregate_id = $1 AND o.sequence = 1
                    RETURNING o.id, o.event_id)
         , a AS (INSERT INTO outbox_attempt (event, attempt, error, gave_up, relay_epoch)
                 SELECT f.id, 5, 'Broker: Message size too large', true, 1 FROM f)
         SELECT event_id FROM f",
    )
    .bind(&failed)
    .fetch_one(&env.pool)
    .await?;

    let (_relay, _) = env.relay("relay").await?;
    let (_consumer, _) = env.consumer("consumer").await?;
    let inventory = env.group("inventory");
    wait_until("the dead letter and its two parked events", Duration::from_secs(90), || async {
        let (letters, parked): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM dead_letter WHERE group_name = $1 AND aggregate_id = $2 AND status = 'open'),
                    (SELECT count(*) FROM parked_event WHERE group_name = $1 AND aggregate_id = $2)",
        )
        .bind(&inventory)
        .bind(&dead)
        .fetch_one(&env.pool)
        .await?;
        Ok((letters == 1 && parked == 2).then_some(()))
    })
    .await?;
    // The cause is fixed; the letter waits for an operator.
    let _ = sqlx::query("DELETE FROM inventory_reservation WHERE order_id = $1")
        .bind(&dead)
        .execute(&env.pool)
        .await?;

    // Users in a file of the test's own, never in the repository.
    let (operator_password, viewer_password) = (
        Uuid::new_v4().simple().to_string(),
        Uuid::new_v4().simple().to_string(),
    );
    let users_file = env.log_dir.join("console-users");
    std::fs::write(
        &users_file,
        format!(
            "ada:operator:sha256:{}\nvic:viewer:sha256:{}\n",
            sha256_hex(&operator_password),
            sha256_hex(&viewer_password)
        ),
    )?;
    let users = users_file.to_string_lossy().into_owned();
    let console = env.spawn_with_env(
        "pipeline",
        "console",
        &[
            "--topic",
            &env.topic,
            "--group-prefix",
            &env.group_prefix,
            "console",
            "--listen",
            "127.0.0.1:0",
            "--refresh",
            "1s",
            // Under a prefix, as behind a proxy: the browser's scenario follows every link
            // from there, so each must carry it.
            "--prefix",
            PREFIX,
        ],
        &[("PIPELINE_CONSOLE_USERS_FILE", &users)],
    )?;
    let addr = console
        .wait_for_log_value("pipeline console listening on ", Duration::from_secs(30))
        .await?;

    let shots = std::env::var("CONSOLE_SCREENSHOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| env.log_dir.join("screenshots"));
    let script_dir = repo_root().join("tests/console");
    let envs = [
        ("CONSOLE_URL", format!("http://{addr}{PREFIX}")),
        ("ORDER_SERVICE_URL", url.clone()),
        ("OPERATOR_USER", "ada".to_owned()),
        ("OPERATOR_PASSWORD", operator_password.clone()),
        ("VIEWER_USER", "vic".to_owned()),
        ("VIEWER_PASSWORD", viewer_password.clone()),
        ("DEAD_ORDER", dead.clone()),
        ("FAILED_ORDER", failed.clone()),
        ("FAILED_EVENT", failed_event.to_string()),
        ("PAUSE_GROUP", "notification".to_owned()),
        ("SCREENSHOT_DIR", shots.to_string_lossy().into_owned()),
        ("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1".to_owned()),
    ];
    let output = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .args(["--test", "--test-reporter=spec", "console.test.mjs"])
            .current_dir(&script_dir)
            .envs(envs)
            .output()
    })
    .await?
    .context("running node (is Node.js installed?)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}");
    // Passwords and session ids never reach the console's log.
    let log = console.log();
    assert!(
        !log.contains(&operator_password) && !log.contains(&viewer_password),
        "a password in the console's log"
    );
    assert!(
        output.status.success(),
        "the browser test failed ({}); console log:\n{log}",
        output.status
    );
    for name in ["overview.png", "timeline.png"] {
        let path = shots.join(name);
        assert!(path.exists(), "no screenshot {}", path.display());
        println!("screenshot {}", path.display());
    }
    Ok(())
}
