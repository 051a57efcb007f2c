//! `pipeline dead-letters` against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): letters
//! raised by the consumer's own batch code are listed, shown, replayed, skipped (an unreadable
//! record's included, releasing its order's parked events in sequence) and discarded, each action
//! idempotent and recorded with who and why; bad input exits 2 and changes nothing.

use crate::common;

use common::{order_message, pipeline, stock};
use consumer::transaction::{process_batch, InboundMessage, Outcome};
use demo_events::order_events::OrderStatus;
use demo_groups::inventory::Inventory;
use sqlx::PgPool;
use uuid::Uuid;

const GROUP: &str = "inventory";

/// A record whose envelope headers cannot be read, keyed by `order`.
fn unreadable(order: Uuid, offset: i64) -> InboundMessage {
    let mut m = order_message("orders", order, 1, OrderStatus::Placed, 1, offset);
    m.envelope = Err(pipeline_core::envelope::EnvelopeError::MissingHeader(
        "event-id",
    ));
    m
}

async fn applied(pool: &PgPool, order: Uuid) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT sequence FROM applied_effect WHERE group_name = $1 AND aggregate_id = $2 ORDER BY id",
    )
    .bind(GROUP)
    .bind(order.to_string())
    .fetch_all(pool)
    .await
    .expect("effects")
}

fn ids(run: &common::Run) -> Vec<i64> {
    run.json()
        .as_array()
        .expect("letters")
        .iter()
        .map(|l| l["id"].as_i64().expect("id"))
        .collect()
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn replay_and_skip_release_parked_events_in_order(pool: PgPool) {
    stock(&pool).await;
    let handler = Inventory::new(GROUP);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // a's first event has a line the handler rejects (quantity 0); b's first record cannot be
    // read at all. Both orders' later events park behind them.
    let batch = vec![
        order_message("orders", a, 1, OrderStatus::Placed, 0, 0),
        order_message("orders", a, 2, OrderStatus::Cancelled, 0, 1),
        unreadable(b, 2),
        order_message("orders", b, 2, OrderStatus::Paid, 1, 3),
        order_message("orders", b, 3, OrderStatus::Shipped, 1, 4),
    ];
    let report = process_batch(&pool, &handler, &batch).await.expect("batch");
    assert_eq!(report.outcomes[0], Outcome::DeadLettered);
    assert_eq!(report.outcomes[1], Outcome::Parked);
    assert_eq!(report.outcomes[2], Outcome::DeadLettered);

    let open = pipeline(&pool, &["dead-letters", "--group", GROUP, "list", "--json"]);
    assert_eq!(open.status, 0, "{}", open.stderr);
    let letters = ids(&open);
    assert_eq!(letters.len(), 2, "{}", open.stdout);
    let by_reason = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "list",
            "--reason",
            "quantity 0",
            "--json",
        ],
    );
    let a_letter = ids(&by_reason);
    assert_eq!(a_letter.len(), 1, "{}", by_reason.stdout);
    let b_letter = *letters
        .iter()
        .find(|l| !a_letter.contains(l))
        .expect("b's letter");

    let shown = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "show",
            &b_letter.to_string(),
            "--json",
        ],
    );
    assert_eq!(shown.status, 0, "{}", shown.stderr);
    assert_eq!(
        shown.json()["parked_sequences"],
        serde_json::json!([2, 3]),
        "{}",
        shown.stdout
    );

    // An unreadable record cannot be replayed; skipping it passes over the gap: b's parked
    // events are applied in sequence.
    let replay_b = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "replay",
            "--id",
            &b_letter.to_string(),
            "--note",
            "try",
        ],
    );
    assert_eq!(replay_b.status, 2, "{}", replay_b.stderr);
    let skip_b = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "skip",
            "--id",
            &b_letter.to_string(),
            "--note",
            "garbage record",
        ],
    );
    assert_eq!(skip_b.status, 0, "{}", skip_b.stderr);
    assert_eq!(applied(&pool, b).await, vec![2, 3]);

    // Replaying a's letter with the bad line still in it is refused and changes nothing.
    let still = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "replay",
            "--reason",
            "quantity 0",
            "--note",
            "retry",
        ],
    );
    assert_eq!(still.status, 2, "{}", still.stderr);
    assert!(
        still.stderr.contains("rejected the event again"),
        "{}",
        still.stderr
    );
    assert_eq!(applied(&pool, a).await, Vec::<i64>::new());
    // Discarding a letter with events parked behind it is refused too: skip or replay it.
    let discard = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "discard",
            "--id",
            &a_letter[0].to_string(),
            "--note",
            "n",
        ],
    );
    assert_eq!(discard.status, 2, "{}", discard.stderr);
    assert!(discard.stderr.contains("skip"), "{}", discard.stderr);

    let skip_a = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "skip",
            "--reason",
            "quantity 0",
            "--note",
            "bad line",
        ],
    );
    assert_eq!(skip_a.status, 0, "{}", skip_a.stderr);
    assert_eq!(applied(&pool, a).await, vec![2]);

    // Idempotent: the same actions again settle nothing more.
    let again = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "skip",
            "--id",
            &b_letter.to_string(),
            "--note",
            "again",
            "--json",
        ],
    );
    assert_eq!(again.status, 0, "{}", again.stderr);
    assert_eq!(again.json()[0]["outcome"], "already skipped");
    let none_open = pipeline(
        &pool,
        &[
            "dead-letters",
            "--group",
            GROUP,
            "skip",
            "--all",
            "--note",
            "x",
        ],
    );
    assert_eq!(none_open.status, 0, "{}", none_open.stderr);
    assert!(
        none_open.stdout.contains("nothing to do"),
        "{}",
        none_open.stdout
    );

    // Each action is recorded with who and why, and shows in the order's trace.
    let actions: Vec<(String, String, String)> =
        sqlx::query_as("SELECT actor, action, reason FROM operator_action ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("actions");
    assert_eq!(
        actions,
        vec![
            (
                "test-operator".into(),
                "dead_letter.skip".into(),
                "garbage record".into()
            ),
            (
                "test-operator".into(),
                "dead_letter.skip".into(),
                "bad line".into()
            ),
        ]
    );
    let trace = pipeline(
        &pool,
        &["trace", &a.to_string(), "--group", GROUP, "--json"],
    )
    .json();
    let steps: Vec<&str> = trace["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| s["transition"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        steps[..3],
        ["dead_lettered", "parked", "dead_letter.skip"],
        "{trace}"
    );
    let mut after: Vec<&str> = steps[3..].to_vec();
    after.sort_unstable();
    assert_eq!(after, ["applied", "unparked"], "{trace}");
}

#[sqlx::test(migrator = "demo_events::MIGRATOR")]
async fn bad_input_exits_2_and_changes_nothing(pool: PgPool) {
    stock(&pool).await;
    let handler = Inventory::new(GROUP);
    let a = Uuid::new_v4();
    let report = process_batch(
        &pool,
        &handler,
        &[order_message("orders", a, 1, OrderStatus::Placed, 0, 0)],
    )
    .await
    .expect("batch");
    assert_eq!(report.outcomes, vec![Outcome::DeadLettered]);
    let cases: [&[&str]; 6] = [
        &["dead-letters", "--group", GROUP, "show", "999999"],
        &[
            "dead-letters",
            "--group",
            GROUP,
            "replay",
            "--id",
            "999999",
            "--note",
            "n",
        ],
        &["dead-letters", "--group", GROUP, "skip", "--note", "n"],
        &[
            "dead-letters",
            "--group",
            "no-such-group",
            "replay",
            "--all",
            "--note",
            "n",
        ],
        &["dead-letters", "--group", GROUP, "list", "--status", "lost"],
        &[
            "dead-letters",
            "--group",
            GROUP,
            "list",
            "--since",
            "yesterday",
        ],
    ];
    for args in cases {
        let run = pipeline(&pool, args);
        assert_eq!(run.status, 2, "{args:?}: {}{}", run.stdout, run.stderr);
        assert!(
            run.stderr.lines().any(|l| l.starts_with("error: ")),
            "{args:?}: {}",
            run.stderr
        );
    }
    let (open, actions): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM dead_letter WHERE status = 'open'),
                (SELECT count(*) FROM operator_action)",
    )
    .fetch_one(&pool)
    .await
    .expect("state");
    assert_eq!((open, actions), (1, 0));
}
