//! The export group's handler and worker against a real PostgreSQL (`#[sqlx::test]`,
//! `DATABASE_URL`): a redelivered event leaves the job as it is, an unknown job is rejected, a
//! file renamed by an attempt that died before recording it is adopted rather than rewritten,
//! transient failures are retried then failed as retryable, unreadable filters fail for good, and
//! the jobs waiting are counted as the metrics report them.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use chrono::Utc;
use consumer::{Event, Handler, HandlerError};
use demo_groups::export::worker::{export_next, Step};
use demo_groups::export::{ExportSettings, Exports};
use pipeline_core::envelope::Envelope;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn settings(dir: PathBuf) -> ExportSettings {
    ExportSettings {
        dir,
        ..ExportSettings::default()
    }
}

fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("export-test-{}", Uuid::new_v4().simple()))
}

async fn orders(pool: &PgPool, n: i64, customer: &str) {
    sqlx::query(
        "INSERT INTO orders (order_id, customer_id, status)
         SELECT gen_random_uuid(), $2, 'paid' FROM generate_series(1, $1)",
    )
    .bind(n)
    .bind(customer)
    .execute(pool)
    .await
    .expect("orders");
}

/// A job in `state`, free for a worker to claim when processing.
async fn job(pool: &PgPool, filters: serde_json::Value, state: &str) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO export_job (id, filters, state, lease_until) VALUES ($1, $2, $3, now())",
    )
    .bind(id)
    .bind(filters)
    .bind(state)
    .execute(pool)
    .await
    .expect("job");
    id
}

async fn row(pool: &PgPool, id: Uuid) -> (String, Option<i64>, Option<String>, Option<bool>) {
    sqlx::query_as("SELECT state, row_count, checksum, retryable FROM export_job WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .expect("job row")
}

fn requested(id: Uuid, event_type: &str) -> Event {
    Event {
        envelope: Envelope {
            event_id: Uuid::new_v4(),
            event_type: event_type.into(),
            aggregate_id: id.to_string(),
            sequence: 1,
            occurred_at: Utc::now(),
            traceparent: None,
        },
        payload: serde_json::json!({ "job_id": id, "filters": {} }),
    }
}

async fn apply(pool: &PgPool, event: &Event) -> Result<(), HandlerError> {
    let handler = Exports::new("export");
    let mut conn = pool.acquire().await.expect("connection");
    let mut tx = handler.transaction();
    tx.apply(&mut conn, event).await
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_handler_starts_a_pending_job_once_and_rejects_what_it_cannot_start(pool: PgPool) {
    let id = job(&pool, serde_json::json!({}), "pending").await;
    apply(&pool, &requested(id, "export.requested"))
        .await
        .expect("started");
    assert_eq!(row(&pool, id).await.0, "processing");
    sqlx::query("UPDATE export_job SET state = 'succeeded', file_name = 'f', row_count = 1, checksum = 'c' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .expect("finish");
    apply(&pool, &requested(id, "export.requested"))
        .await
        .expect("a redelivery is no error");
    assert_eq!(row(&pool, id).await.0, "succeeded", "left as it was");

    let unknown = apply(&pool, &requested(Uuid::new_v4(), "export.requested")).await;
    assert!(
        matches!(&unknown, Err(HandlerError::Rejected(r)) if r.contains("does not exist")),
        "{unknown:?}"
    );
    let wrong_type = apply(&pool, &requested(id, "order.placed")).await;
    assert!(matches!(wrong_type, Err(HandlerError::Rejected(_))));
    let mut unreadable = requested(id, "export.requested");
    unreadable.payload = serde_json::json!({ "job": 1 });
    assert!(matches!(
        apply(&pool, &unreadable).await,
        Err(HandlerError::Rejected(_))
    ));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_file_renamed_before_its_job_was_recorded_is_adopted_not_rewritten(pool: PgPool) {
    let dir = temp_dir();
    let settings = settings(dir.clone());
    let stop = CancellationToken::new();
    orders(&pool, 3, "c-1").await;
    let id = job(
        &pool,
        serde_json::json!({ "customer_id": "c-1" }),
        "processing",
    )
    .await;
    let step = export_next(&pool, &settings, &stop).await.expect("step");
    assert_eq!(step, Step::Succeeded { id, rows: 3 });
    let (_, rows, checksum, _) = row(&pool, id).await;
    let file = dir.join(format!("export-{id}.csv"));
    let before = std::fs::metadata(&file).expect("file");

    // As if that attempt had died after the rename: the job is processing again, and an order
    // that matches has arrived since (a rewrite would hold it).
    sqlx::query(
        "UPDATE export_job SET state = 'processing', lease_until = now(), row_count = NULL,
                checksum = NULL, file_name = NULL WHERE id = $1",
    )
    .bind(id)
    .execute(&pool)
    .await
    .expect("reset");
    orders(&pool, 1, "c-1").await;
    let step = export_next(&pool, &settings, &stop).await.expect("step");
    assert_eq!(step, Step::Succeeded { id, rows: 3 });
    let after = std::fs::metadata(&file).expect("file");
    assert_eq!(
        (after.ino(), after.mtime_nsec(), after.len()),
        (before.ino(), before.mtime_nsec(), before.len())
    );
    assert_eq!(
        row(&pool, id).await,
        ("succeeded".into(), rows, checksum, None)
    );
    assert_eq!(
        std::fs::read_dir(&dir).expect("dir").count(),
        1,
        "no temporary file"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn failures_are_retried_then_failed_and_unreadable_filters_fail_for_good(pool: PgPool) {
    let stop = CancellationToken::new();
    // The export directory cannot be created: a file stands where it should be.
    let blocked = temp_dir();
    std::fs::write(&blocked, b"not a directory").expect("file");
    let mut settings = settings(blocked.join("exports"));
    settings.max_attempts = 2;
    let id = job(&pool, serde_json::json!({}), "processing").await;
    let first = export_next(&pool, &settings, &stop).await.expect("step");
    assert!(
        matches!(first, Step::RetryLater { id: j, .. } if j == id),
        "{first:?}"
    );
    assert_eq!(
        export_next(&pool, &settings, &stop).await.expect("step"),
        Step::Idle,
        "not before its backoff"
    );
    sqlx::query("UPDATE export_job SET lease_until = now() WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .expect("backoff over");
    let second = export_next(&pool, &settings, &stop).await.expect("step");
    assert!(
        matches!(
            second,
            Step::Failed {
                retryable: true,
                ..
            }
        ),
        "{second:?}"
    );
    assert_eq!(row(&pool, id).await.3, Some(true));
    let _ = std::fs::remove_file(&blocked);

    let dir = temp_dir();
    let id = job(&pool, serde_json::json!({ "colour": "red" }), "processing").await;
    let step = export_next(&pool, &self::settings(dir.clone()), &stop)
        .await
        .expect("step");
    assert!(
        matches!(&step, Step::Failed { retryable: false, reason, .. } if reason.contains("unreadable")),
        "{step:?}"
    );
    assert_eq!(row(&pool, id).await.3, Some(false));
    assert!(!dir.exists() || std::fs::read_dir(&dir).expect("dir").count() == 0);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_jobs_waiting_are_the_pending_and_processing_ones_with_the_oldest_age(pool: PgPool) {
    use demo_groups::export::jobs::waiting;
    assert_eq!(waiting(&pool).await.expect("waiting"), (0, 0.0));
    let old = job(&pool, serde_json::json!({}), "pending").await;
    sqlx::query("UPDATE export_job SET created_at = now() - interval '10 minutes' WHERE id = $1")
        .bind(old)
        .execute(&pool)
        .await
        .expect("age");
    let _ = job(&pool, serde_json::json!({}), "processing").await;
    sqlx::query(
        "INSERT INTO export_job (id, filters, state, file_name, row_count, checksum, created_at)
         VALUES ($1, '{}', 'succeeded', 'f', 1, 'c', now() - interval '1 day')",
    )
    .bind(Uuid::now_v7())
    .execute(&pool)
    .await
    .expect("finished job");
    let (jobs, oldest) = waiting(&pool).await.expect("waiting");
    assert_eq!(jobs, 2, "the finished job does not wait");
    assert!((600.0..660.0).contains(&oldest), "oldest {oldest}");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_sweep_removes_jobs_expired_past_their_retention_and_nothing_unfinished(pool: PgPool) {
    let dir = temp_dir();
    let mut jobs = Vec::new();
    for (state, expired_days_ago) in [
        ("expired", 40),
        ("expired", 5),
        ("failed", 40),
        ("pending", 40),
        ("processing", 40),
    ] {
        let id = job(&pool, serde_json::json!({}), state).await;
        sqlx::query(
            "UPDATE export_job SET expires_at = now() - make_interval(days => $2),
                                   created_at = now() - interval '60 days'
             WHERE id = $1",
        )
        .bind(id)
        .bind(expired_days_ago)
        .execute(&pool)
        .await
        .expect("age");
        jobs.push(id);
    }
    demo_groups::export::worker::sweep(&pool, &settings(dir))
        .await
        .expect("sweep");
    let left: Vec<(Uuid, String)> = sqlx::query_as("SELECT id, state FROM export_job ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("left");
    // Expired 40 days ago: gone, whether the job was marked expired before or by this sweep;
    // expired 5 days ago: kept (30 days); unfinished jobs: kept whatever their age.
    let ids: Vec<Uuid> = left.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![jobs[1], jobs[3], jobs[4]]);
    assert_eq!(left[0].1, "expired");
}
