//! The `pipeline` binary of the demonstration knows every group the demonstration runs, the
//! `export` group's included: its dead letters are listed, shown, replayed and discarded with the
//! export handler. A name that no program registers, no database holds and Kafka does not know
//! is an error with exit status 2 for every command, not an empty, healthy group. Against a real
//! PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`) and broker (`KAFKA_BROKERS`).

use crate::common;

use chrono::Utc;
use common::pipeline;
use consumer::transaction::{process_batch, InboundMessage, Outcome};
use demo_groups::export::Exports;
use pipeline_core::envelope::Envelope;
use sqlx::PgPool;
use uuid::Uuid;

/// An `export.requested` event for `job` at `offset` of partition 0 of `export-jobs`.
fn export_requested(job: Uuid, offset: i64) -> InboundMessage {
    InboundMessage {
        topic: "export-jobs".into(),
        partition: 0,
        offset,
        key: Some(job.to_string().into_bytes()),
        payload: Some(
            serde_json::to_vec(&serde_json::json!({ "job_id": job, "filters": {} })).expect("json"),
        ),
        headers: serde_json::json!({"occurred-at": Utc::now().to_rfc3339()}).into(),
        envelope: Ok(Envelope {
            event_id: Uuid::new_v4(),
            event_type: "export.requested".into(),
            aggregate_id: job.to_string(),
            sequence: 1,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

async fn job_state(pool: &PgPool, job: Uuid) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM export_job WHERE id = $1")
        .bind(job)
        .fetch_optional(pool)
        .await
        .expect("job")
}

fn letter_of(run: &common::Run, job: Uuid) -> i64 {
    run.json()
        .as_array()
        .expect("letters")
        .iter()
        .find(|l| l["aggregate_id"] == serde_json::json!(job.to_string()))
        .and_then(|l| l["id"].as_i64())
        .unwrap_or_else(|| panic!("no letter of {job}: {}", run.stdout))
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn the_export_groups_dead_letters_are_resolved_with_its_handler(pool: PgPool) {
    // Two requests for jobs that do not exist (yet): the export handler rejects both.
    let (late, bogus) = (Uuid::now_v7(), Uuid::now_v7());
    let batch = vec![export_requested(late, 0), export_requested(bogus, 1)];
    let report = process_batch(&pool, &Exports::new("export"), &batch)
        .await
        .expect("batch");
    assert_eq!(
        report.outcomes,
        vec![Outcome::DeadLettered, Outcome::DeadLettered]
    );

    let open = pipeline(
        &pool,
        &["dead-letters", "--group", "export", "list", "--json"],
    );
    assert_eq!(open.status, 0, "{}", open.stderr);
    let (late_letter, bogus_letter) = (letter_of(&open, late), letter_of(&open, bogus));
    let shown = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            "export",
            "show",
            &late_letter.to_string(),
            "--json",
        ],
    );
    assert_eq!(shown.status, 0, "{}", shown.stderr);
    assert!(
        shown.json()["reason"]
            .as_str()
            .is_some_and(|r| r.contains("does not exist")),
        "{}",
        shown.stdout
    );

    // Once the job exists, the replay starts it through the export handler.
    sqlx::query("INSERT INTO export_job (id, filters, state) VALUES ($1, '{}', 'pending')")
        .bind(late)
        .execute(&pool)
        .await
        .expect("job");
    let replayed = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            "export",
            "replay",
            "--id",
            &late_letter.to_string(),
            "--note",
            "the job row arrived late",
        ],
    );
    assert_eq!(
        replayed.status, 0,
        "{}\n{}",
        replayed.stdout, replayed.stderr
    );
    assert_eq!(job_state(&pool, late).await.as_deref(), Some("processing"));

    // A replay of the request whose job never existed is rejected again and changes nothing;
    // it is discarded instead.
    let again = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            "export",
            "replay",
            "--id",
            &bogus_letter.to_string(),
            "--note",
            "try",
        ],
    );
    assert_eq!(again.status, 2, "{}\n{}", again.stdout, again.stderr);
    assert!(again.stderr.contains("rejected"), "{}", again.stderr);
    let discarded = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            "export",
            "discard",
            "--id",
            &bogus_letter.to_string(),
            "--note",
            "no such job",
        ],
    );
    assert_eq!(discarded.status, 0, "{}", discarded.stderr);
    assert_eq!(job_state(&pool, bogus).await, None);

    let settled: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, status FROM dead_letter WHERE group_name = 'export' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("letters");
    let mut expected = vec![
        (late_letter, "replayed".to_owned()),
        (bogus_letter, "discarded".to_owned()),
    ];
    expected.sort();
    assert_eq!(settled, expected);
    let left = pipeline(
        &pool,
        &["dead-letters", "--group", "export", "list", "--json"],
    );
    assert_eq!(left.status, 0, "{}", left.stderr);
    assert_eq!(left.json(), serde_json::json!([]), "{}", left.stdout);
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_group_nothing_knows_is_an_error_for_every_command(pool: PgPool) {
    for args in [
        &["dead-letters", "--group", "nosuchgroup", "list"][..],
        &["dead-letters", "--group", "nosuchgroup", "show", "1"],
        &["status", "--group", "nosuchgroup"],
        &["trace", "--group", "nosuchgroup", "some-order"],
        &[
            "reprocess",
            "--group",
            "nosuchgroup",
            "--from",
            "0",
            "--note",
            "n",
        ],
    ] {
        let run = pipeline(&pool, args);
        assert_eq!(run.status, 2, "{args:?}: {}\n{}", run.stdout, run.stderr);
        assert!(
            run.stderr.contains("unknown consumer group nosuchgroup"),
            "{args:?}: {}",
            run.stderr
        );
        assert!(
            run.stderr.contains("inventory, notification"),
            "{args:?} names the registered groups: {}",
            run.stderr
        );
        assert!(!run.stdout.contains("letter(s)"), "{}", run.stdout);
    }
    // Registered groups are known before they have done anything.
    for group in ["inventory", "notification", "export"] {
        let run = pipeline(&pool, &["dead-letters", "--group", group, "list"]);
        assert_eq!(run.status, 0, "{group}: {}", run.stderr);
        assert!(run.stdout.contains("0 letter(s)"), "{}", run.stdout);
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn status_shows_the_export_jobs_waiting_beside_the_export_group(pool: PgPool) {
    for state in ["pending", "processing", "failed"] {
        sqlx::query(
            "INSERT INTO export_job (id, filters, state, created_at)
             VALUES ($1, '{}', $2, now() - interval '90 seconds')",
        )
        .bind(Uuid::now_v7())
        .bind(state)
        .execute(&pool)
        .await
        .expect("job");
    }
    let run = pipeline(
        &pool,
        &[
            "status",
            "--json",
            "--group",
            "export",
            "--topic",
            "export-jobs",
        ],
    );
    assert_eq!(run.status, 0, "{}\n{}", run.stdout, run.stderr);
    let status = run.json();
    let export = status["groups"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["group"] == "export"))
        .unwrap_or_else(|| panic!("the export group: {status}"));
    // Pending and processing jobs wait; a finished one does not.
    assert_eq!(export["waiting"]["what"], "export jobs", "{export}");
    assert_eq!(export["waiting"]["count"], 2, "{export}");
    let oldest = export["waiting"]["oldest_seconds"]
        .as_f64()
        .expect("oldest");
    assert!((90.0..600.0).contains(&oldest), "{export}");
    // The table says it too.
    let table = pipeline(
        &pool,
        &["status", "--group", "export", "--topic", "export-jobs"],
    );
    assert!(
        table
            .stdout
            .contains("export: 2 export jobs waiting, the oldest for"),
        "{}",
        table.stdout
    );
}
