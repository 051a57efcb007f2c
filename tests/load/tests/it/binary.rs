//! The `load` binary against an in-process order service: a run's summary on stdout and as JSON
//! matches the outbox, and a run against a service that is not there exits non-zero.
//! Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use std::process::Stdio;

use common::{spawn_app, PRODUCTS};
use sqlx::PgPool;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_load");

fn load(url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    let _ = cmd
        .args(["--url", url, "--products", &PRODUCTS.to_string()])
        .env("RUST_LOG", "info")
        .env_remove("LOG_JSON")
        .kill_on_drop(true);
    cmd
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_run_prints_and_writes_its_summary_and_fails_without_a_service(pool: PgPool) {
    let app = spawn_app(pool).await;
    let dir = std::env::temp_dir().join(format!("pipeline-load-bin-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("summary.json");
    let run = load(&app.url(""))
        .args([
            "--orders",
            "25",
            "--rate",
            "0",
            "--seed",
            "5",
            "--summary-json",
        ])
        .arg(&json_path)
        .stdout(Stdio::piped())
        .output()
        .await
        .expect("run load");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}");
    assert!(stdout.contains("orders created:   25"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).expect("summary file")).expect("JSON");
    let (_, _, outbox) = app.row_counts().await;
    assert_eq!(summary["events"], outbox);
    std::fs::remove_dir_all(dir).expect("clean up");

    // Against a service that is not there (a port nobody listens on), load fails with a
    // non-zero exit.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind port 0");
    let gone = format!("http://{}", closed.local_addr().expect("address"));
    drop(closed);
    let failed = load(&gone)
        .args(["--orders", "2", "--max-retries", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .expect("run load");
    assert!(!failed.success());
}
