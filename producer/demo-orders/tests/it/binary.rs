//! The `producer` binary end to end: seed the catalogue, serve on port 0 (the address read back
//! from the log line), place an order, stop it with SIGTERM. (`tests/load` drives it with the
//! `load` binary.)
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pipeline_testkit::db::database_url;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_producer");
const LISTENING: &str = "order service listening on ";

fn producer(pool: &PgPool, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    let _ = cmd
        .args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("RUST_LOG", "info")
        .env_remove("LOG_JSON")
        .kill_on_drop(true);
    cmd
}

/// Reads the server's stderr until the listening line; returns the address. Keeps draining
/// stderr afterwards so the server never blocks on a full pipe.
async fn listening_address(child: &mut Child) -> String {
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let find = async {
        while let Some(line) = lines.next_line().await.expect("read stderr") {
            if let Some(at) = line.find(LISTENING) {
                return line[at + LISTENING.len()..].trim().to_owned();
            }
        }
        panic!("server exited without logging its address");
    };
    let addr = tokio::time::timeout(Duration::from_secs(30), find)
        .await
        .expect("listening line within 30 s");
    let _drain = tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    addr
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn seed_serve_and_stop(pool: PgPool) {
    let seeded = producer(&pool, &["seed-catalog", "--products", "20"])
        .stderr(Stdio::null())
        .status()
        .await
        .expect("run seed-catalog");
    assert!(seeded.success());

    let mut server = producer(&pool, &["serve", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("start server");
    let addr = listening_address(&mut server).await;
    assert!(
        addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"),
        "{addr}"
    );

    let ready = reqwest::get(format!("http://{addr}/readyz"))
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 200);

    let placed = reqwest::Client::new()
        .post(format!("http://{addr}/orders"))
        .json(&serde_json::json!({
            "customer_id": "customer-1",
            "lines": [{"product_id": "sku-00020", "quantity": 1}]
        }))
        .send()
        .await
        .expect("place an order");
    assert_eq!(placed.status(), 201);
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(outbox, 1, "the order and its event committed together");

    let pid = i32::try_from(server.id().expect("running")).expect("pid");
    kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(15), server.wait())
        .await
        .expect("server stops within 15 s")
        .expect("wait");
    assert!(status.success(), "{status:?}");
}
