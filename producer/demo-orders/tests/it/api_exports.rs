//! The export API's answers: a valid request is accepted at once with its job and event written
//! together; bad input gets a 4xx naming the problem and writes nothing; a job's download
//! answers 404, 409, 410 by its state. Needs `DATABASE_URL` (see `common/mod.rs`).

use crate::common;

use common::{spawn_app, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;

const JSON: Option<&str> = Some("application/json");

/// Rows in `export_job` and `outbox`.
async fn written(app: &TestApp) -> (i64, i64) {
    sqlx::query_as("SELECT (SELECT count(*) FROM export_job), (SELECT count(*) FROM outbox)")
        .fetch_one(&app.pool)
        .await
        .expect("count rows")
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_valid_request_is_accepted_at_once_with_its_event(pool: PgPool) {
    let app = spawn_app(pool).await;
    let answer = app
        .http
        .post(app.url("/exports"))
        .json(&json!({"status": "paid", "customer_id": "customer-1",
                      "created_from": "2026-01-01T00:00:00Z", "created_to": "2026-02-01T00:00:00Z"}))
        .send()
        .await
        .expect("send");
    assert_eq!(answer.status(), 202);
    let location = answer.headers()["location"]
        .to_str()
        .expect("location")
        .to_owned();
    let job: Value = answer.json().await.expect("json");
    let id = job["id"].as_str().expect("id").to_owned();
    assert_eq!(job["state"], "pending");
    assert_eq!(location, format!("/exports/{id}"));
    assert_eq!(job["status_url"], location);
    assert_eq!(job["download_url"], format!("/exports/{id}/download"));

    // The job and its event, in the same transaction.
    let (event_type, topic, key, payload): (String, String, String, Value) = sqlx::query_as(
        "SELECT event_type, topic, business_key, payload FROM outbox WHERE aggregate_id = $1",
    )
    .bind(&id)
    .fetch_one(&app.pool)
    .await
    .expect("the job's event");
    assert_eq!(
        (event_type.as_str(), topic.as_str(), key.as_str()),
        ("export.requested", "export-jobs", id.as_str())
    );
    assert_eq!(payload["job_id"], id);
    assert_eq!(payload["filters"]["status"], "paid");
    assert_eq!(written(&app).await, (1, 1));

    let (status, polled) = app.get(&format!("/exports/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(polled["state"], "pending");
    assert_eq!(polled["filters"]["customer_id"], "customer-1");

    // Not written yet: 409 naming the state.
    let (status, refused) = app.get(&format!("/exports/{id}/download")).await;
    assert_eq!(status, 409);
    assert!(
        refused["error"]
            .as_str()
            .unwrap_or_default()
            .contains("pending"),
        "{refused}"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn bad_requests_are_refused_with_a_reason_and_write_nothing(pool: PgPool) {
    let app = spawn_app(pool).await;
    let cases: [(&str, Vec<u8>, u16, &str); 9] = [
        (
            "unknown field",
            br#"{"colour": "red"}"#.to_vec(),
            422,
            "unknown field `colour`",
        ),
        (
            "unknown status",
            br#"{"status": "lost"}"#.to_vec(),
            422,
            "`lost`",
        ),
        (
            "inverted range",
            br#"{"created_from": "2026-02-01T00:00:00Z", "created_to": "2026-01-01T00:00:00Z"}"#
                .to_vec(),
            422,
            "must be before",
        ),
        (
            "time not RFC 3339",
            br#"{"created_from": "last week"}"#.to_vec(),
            422,
            "RFC 3339",
        ),
        (
            "empty customer",
            br#"{"customer_id": ""}"#.to_vec(),
            422,
            "customer_id",
        ),
        (
            "oversize customer",
            serde_json::to_vec(&json!({"customer_id": "c".repeat(201)})).expect("json"),
            422,
            "at most 200",
        ),
        (
            "status not a string",
            br#"{"status": 3}"#.to_vec(),
            422,
            "invalid request body",
        ),
        (
            "malformed JSON",
            br#"{"status": "#.to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "not an object",
            br#"[1, 2]"#.to_vec(),
            422,
            "request body must be a JSON object, not an array",
        ),
    ];
    for (name, body, expected, reason) in cases {
        let (status, answer) = app.post_raw("/exports", JSON, body).await;
        assert_eq!(status, expected, "{name}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(reason), "{name}: `{error}` lacks `{reason}`");
    }
    let (status, _) = app.post_raw("/exports", None, b"{}".to_vec()).await;
    assert_eq!(status, 415, "no JSON content type");
    for path in [
        "/exports/not-a-uuid",
        "/exports/not-a-uuid/download",
        "/exports/1234/download",
    ] {
        let (status, answer) = app.get(path).await;
        assert_eq!(status, 400, "{path}: {answer}");
        assert!(answer["error"]
            .as_str()
            .unwrap_or_default()
            .contains("is not a UUID"));
    }
    let unknown = uuid::Uuid::new_v4();
    for path in [
        format!("/exports/{unknown}"),
        format!("/exports/{unknown}/download"),
    ] {
        let (status, answer) = app.get(&path).await;
        assert_eq!(status, 404, "{path}: {answer}");
    }
    assert_eq!(written(&app).await, (0, 0), "nothing written");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn downloads_answer_by_the_jobs_state(pool: PgPool) {
    let app = spawn_app(pool).await;
    let id = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO export_job (id, filters) VALUES ($1, '{}')")
        .bind(id)
        .execute(&app.pool)
        .await
        .expect("job");
    let set = |sql: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query(sql)
                .bind(id)
                .execute(&pool)
                .await
                .expect("update");
        }
    };
    let download = format!("/exports/{id}/download");

    set("UPDATE export_job SET state = 'processing', lease_until = now() WHERE id = $1").await;
    let (status, answer) = app.get(&download).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (409, Some(format!("export {id} is processing").as_str()))
    );

    set(
        "UPDATE export_job SET state = 'failed', failure_reason = 'disk full', retryable = true,
         expires_at = now() + interval '1 hour' WHERE id = $1",
    )
    .await;
    let (status, answer) = app.get(&download).await;
    assert_eq!(status, 409);
    assert_eq!(answer["error"], format!("export {id} is failed: disk full"));
    let (_, job) = app.get(&format!("/exports/{id}")).await;
    assert_eq!(
        (job["state"].as_str(), job["retryable"].as_bool()),
        (Some("failed"), Some(true))
    );

    // Succeeded but past its expiry: expired at once, before any sweep removed the file.
    set(
        "UPDATE export_job SET state = 'succeeded', file_name = 'export-' || id || '.csv',
         row_count = 1, checksum = 'ab', failure_reason = NULL,
         expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .await;
    let (_, job) = app.get(&format!("/exports/{id}")).await;
    assert_eq!(job["state"], "expired");
    let (status, answer) = app.get(&download).await;
    assert_eq!(status, 410, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap_or_default()
        .contains("expired"));
}

/// Each job reads orders and writes a file, so a flood of requests must not queue without end:
/// at most `--export-max-pending` jobs (64 by default) are pending or being written; of 80 sent
/// at once exactly 64 are accepted and the rest refused with 429, writing nothing, until one
/// finishes.
#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn requests_beyond_the_pending_cap_are_refused_until_one_finishes(pool: PgPool) {
    let app = spawn_app(pool).await;
    let submit = || async {
        app.http
            .post(app.url("/exports"))
            .json(&json!({"status": "paid"}))
            .send()
            .await
            .expect("send")
    };
    let answers = futures::future::join_all((0..80).map(|_| submit())).await;
    let mut accepted = 0;
    for answer in answers {
        match answer.status().as_u16() {
            202 => accepted += 1,
            429 => {
                let body: Value = answer.json().await.expect("json");
                let error = body["error"].as_str().unwrap_or_default();
                assert!(error.contains("64 exports are pending"), "{body}");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(accepted, 64);
    assert_eq!(written(&app).await, (64, 64));
    let _ = sqlx::query(
        "UPDATE export_job SET state = 'failed', failure_reason = 'test', finished_at = now()
         WHERE id = (SELECT id FROM export_job ORDER BY id LIMIT 1)",
    )
    .execute(&app.pool)
    .await
    .expect("finish one");
    assert_eq!(submit().await.status(), 202);
    assert_eq!(written(&app).await, (65, 65));
}
