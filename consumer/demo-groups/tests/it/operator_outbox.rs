//! `pipeline outbox requeue`, `trace` and `status` on the outbox's side, against a real
//! PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): the relay's own code fails an event, the command
//! requeues it, and the relay's own claim then publishes it and its order's held events in order.

use crate::common;

use std::time::Duration;

use common::{enqueue, pipeline};
use relay::claim::{claim_batch, ClaimSessions};
use relay::lease::{Elector, LeaseSettings};
use relay::mark::{record_failures, FailedAttempt};
use sqlx::PgPool;

/// Fails event `id` for good through the relay's `record_failures`, under a lease of its own.
async fn fail_for_good(pool: &PgPool, id: i64, error: &str) {
    let mut elector = Elector::new(
        LeaseSettings {
            lock_key: i64::from(rand::random::<i32>()),
            lease_ttl: Duration::from_secs(120),
            standby_retry: Duration::from_millis(100),
        },
        (*pool.connect_options()).clone(),
    );
    let (lease, _) = elector
        .try_acquire()
        .await
        .expect("lease statement")
        .expect("a vacant lease");
    for give_up in [false, true] {
        let failed = FailedAttempt {
            id,
            error: error.to_owned(),
            retry_in: Duration::ZERO,
            give_up,
        };
        let n = record_failures(pool, lease.fence(), &[failed])
            .await
            .expect("record failure");
        assert_eq!(n, 1);
    }
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn a_requeued_event_is_published_before_its_orders_held_events(pool: PgPool) {
    let (first, first_event) = enqueue(&pool, "order-1", "order.placed").await;
    let (second, _) = enqueue(&pool, "order-1", "order.paid").await;
    let (third, _) = enqueue(&pool, "order-1", "order.shipped").await;
    let (other, _) = enqueue(&pool, "order-2", "order.placed").await;
    fail_for_good(&pool, first, "Broker: Message size too large").await;

    // Held: the failed event's order waits; other orders flow.
    let claimed: Vec<i64> = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim")
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(claimed, vec![other]);

    let status = pipeline(&pool, &["status", "--json"]).json();
    assert_eq!(status["outbox"]["failed"], 1, "{status}");
    assert_eq!(status["outbox"]["pending"], 3, "{status}");

    let run = pipeline(
        &pool,
        &[
            "outbox",
            "requeue",
            "--error",
            "too large",
            "--note",
            "max.message.bytes raised",
            "--json",
        ],
    );
    assert_eq!(run.status, 0, "{}", run.stderr);
    let requeued = run.json();
    assert_eq!(requeued.as_array().map(Vec::len), Some(1), "{requeued}");
    assert_eq!(requeued[0]["event_id"], first_event.to_string());

    // Resumed in order: the requeued event first, then the events it held.
    let claimed: Vec<i64> = claim_batch(&ClaimSessions::new(&pool), 100)
        .await
        .expect("claim")
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(claimed, vec![first, second, third, other]);

    // The history has both attempts, the failure and the requeue with who and why.
    let trace = pipeline(&pool, &["trace", "order-1", "--json"]).json();
    let steps: Vec<(String, Option<i64>)> = trace["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter(|s| s["sequence"] == 1)
        .map(|s| {
            (
                s["transition"].as_str().unwrap_or_default().to_owned(),
                s["sequence"].as_i64(),
            )
        })
        .collect();
    let names: Vec<&str> = steps.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(
        names,
        ["written", "attempt_failed", "failed", "requeued"],
        "{trace}"
    );
    let requeue = trace["steps"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["transition"] == "requeued"))
        .expect("requeued step");
    assert_eq!(
        requeue["detail"],
        "by test-operator: max.message.bytes raised"
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn requeue_refuses_what_is_not_failed_and_changes_nothing(pool: PgPool) {
    let (id, event) = enqueue(&pool, "order-1", "order.placed").await;
    let event = event.to_string();
    let unknown = uuid::Uuid::new_v4().to_string();
    let cases: [(&[&str], &str); 4] = [
        (
            &["outbox", "requeue", "--event", &event, "--note", "n"],
            "is pending, not failed",
        ),
        (
            &["outbox", "requeue", "--event", &unknown, "--note", "n"],
            "no outbox event",
        ),
        (
            &["outbox", "requeue", "--aggregate", "order-1", "--note", "n"],
            "nothing matches",
        ),
        (
            &["outbox", "requeue", "--note", "n"],
            "say which failed events",
        ),
    ];
    for (args, why) in cases {
        let run = pipeline(&pool, args);
        assert_eq!(run.status, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(why), "{args:?}: {}", run.stderr);
    }
    // Bad input the parser catches: a malformed id, a missing note.
    for args in [
        &["outbox", "requeue", "--event", "not-a-uuid", "--note", "n"][..],
        &["outbox", "requeue", "--all"][..],
    ] {
        let run = pipeline(&pool, args);
        assert_eq!(run.status, 2, "{args:?}: {}", run.stderr);
    }
    let (attempts, actions): (i32, i64) = sqlx::query_as(
        "SELECT (SELECT attempts FROM outbox_unpublished WHERE id = $1),
                (SELECT count(*) FROM operator_action)",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .expect("state");
    assert_eq!((attempts, actions), (0, 0));
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn trace_of_an_unknown_order_is_an_error(pool: PgPool) {
    let run = pipeline(&pool, &["trace", "no-such-order"]);
    assert_eq!(run.status, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("no order or event no-such-order"),
        "{}",
        run.stderr
    );
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn status_counts_stop_at_the_cap_and_read_by_index(pool: PgPool) {
    // More queued events than the cap: the figure shows the cap rather than counting on.
    sqlx::query(
        "INSERT INTO outbox (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
         SELECT gen_random_uuid(), 'k' || g, 't', 'o' || g, 1, 'orders', '{}'
         FROM generate_series(1, $1) g",
    )
    .bind(operator::status::CAP + 5)
    .execute(&pool)
    .await
    .expect("fill");
    let status = pipeline(&pool, &["status", "--json"]).json();
    assert_eq!(
        status["outbox"]["pending"],
        operator::status::CAP,
        "{status}"
    );
    assert!(status["outbox"]["oldest_unpublished_seconds"]
        .as_f64()
        .is_some());
    let table = pipeline(&pool, &["status"]);
    assert_eq!(table.status, 0, "{}", table.stderr);
    assert!(
        table
            .stdout
            .contains(&format!("≥{}", operator::status::CAP)),
        "{}",
        table.stdout
    );
}
