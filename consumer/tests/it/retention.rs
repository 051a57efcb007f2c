//! Retention of the groups' tables on a real PostgreSQL (`DATABASE_URL`): the window rule (an
//! event redelivered after retention removed its dedupe row, or its order's progress, is stale,
//! never applied twice), what is never removed (parked events, open dead letters and the
//! history of their orders), dry runs, one runner at a time, and the floors. Time is moved by
//! running retention as if it were later.

use crate::common;

use chrono::{DateTime, Duration, Utc};
use consumer::retention::{rules, RetentionSettings};
use consumer::transaction::{process_batch, InboundMessage, Outcome, RecordHeaders};
use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use pipeline_core::envelope::{AGGREGATE_ID, EVENT_ID, EVENT_TYPE, OCCURRED_AT, SEQUENCE};
use pipeline_core::retention::{Backlog, RetentionMetrics, Runner, Window};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

pub(crate) const GROUP: &str = "ledger";
pub(crate) const TOPIC: &str = "orders";

/// Counts each event it applies, so a second application shows.
pub(crate) struct Ledger;
struct LedgerTransaction;

impl Handler for Ledger {
    fn group(&self) -> &str {
        GROUP
    }
    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(LedgerTransaction)
    }
}

impl HandlerTransaction for LedgerTransaction {
    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if event.envelope.event_type == "order.rejected" {
                return Err(HandlerError::Rejected("rejected on purpose".to_owned()));
            }
            sqlx::query("INSERT INTO ledger (event_id) VALUES ($1)")
                .bind(event.envelope.event_id)
                .execute(conn)
                .await?;
            Ok(())
        })
    }
}

/// One event of `order` as its Kafka record, at `offset`.
pub(crate) fn record(
    order: &str,
    sequence: i64,
    event_id: Uuid,
    event_type: &str,
    occurred_at: DateTime<Utc>,
    offset: i64,
) -> InboundMessage {
    let (id, seq, at) = (
        event_id.to_string(),
        sequence.to_string(),
        occurred_at.to_rfc3339(),
    );
    let pairs: [(&str, Option<&[u8]>); 5] = [
        (EVENT_ID, Some(id.as_bytes())),
        (EVENT_TYPE, Some(event_type.as_bytes())),
        (SEQUENCE, Some(seq.as_bytes())),
        (AGGREGATE_ID, Some(order.as_bytes())),
        (OCCURRED_AT, Some(at.as_bytes())),
    ];
    InboundMessage::from_record(
        TOPIC,
        0,
        offset,
        Some(order.as_bytes()),
        Some(br#"{"order": true}"#),
        RecordHeaders::from_pairs(pairs),
    )
}

/// The events of a new order, sequences 1..=n, occurring now.
fn order_events(order: &str, n: i64, first_offset: i64) -> Vec<InboundMessage> {
    (1..=n)
        .map(|s| {
            record(
                order,
                s,
                Uuid::now_v7(),
                "order.updated",
                Utc::now(),
                first_offset + s,
            )
        })
        .collect()
}

async fn database() -> (PgPool, String) {
    // The group owns a partition, as every running group does.
    common::database(
        "retention",
        &format!(
            "CREATE TABLE ledger (event_id uuid NOT NULL);
             INSERT INTO partition_owner (group_name, topic, partition, owner)
             VALUES ('{GROUP}', '{TOPIC}', 0, gen_random_uuid());"
        ),
    )
    .await
}

async fn drop_database(pool: PgPool, name: &str) {
    common::drop_database(pool, name).await;
}

/// The effect history ages a month: its rows move to a partition of the past (the effects of a
/// run are otherwise in the partition of the time now, which no run removes while that time
/// lasts, whatever time the run is told it is).
async fn age_history(pool: &PgPool) {
    sqlx::query("UPDATE applied_effect SET applied_at = applied_at - interval '30 days'")
        .execute(pool)
        .await
        .expect("age the history");
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

fn runner() -> Runner {
    Runner::new(rules(&RetentionSettings::default()), "test")
}

/// `runner`, yielding to `backlog`, and the metrics it serves.
fn yielding_runner(runner: Runner, backlog: &Backlog) -> (Runner, RetentionMetrics) {
    let metrics =
        RetentionMetrics::register(&prometheus::Registry::new(), "consumer").expect("metrics");
    let runner = runner
        .yield_to(backlog.clone())
        .with_metrics(metrics.clone());
    (runner, metrics)
}

#[tokio::test]
async fn a_redelivery_after_its_dedupe_row_was_removed_is_stale_not_applied() {
    let (pool, name) = database().await;
    let events = order_events("order-1", 3, 0);
    let report = process_batch(&pool, &Ledger, &events)
        .await
        .expect("first delivery");
    assert!(report.outcomes.iter().all(|o| *o == Outcome::Applied));

    // Nine days on: the dedupe rows (8 days) and the history (7 days) are gone, the order's
    // progress (a year) is kept.
    let later = Utc::now() + Duration::days(9);
    age_history(&pool).await;
    let run = runner()
        .run_once(&pool, later, false)
        .await
        .expect("retention");
    assert!(!run.skipped);
    let removed = |t: &str| run.tables.iter().find(|r| r.table == t).expect(t).removed;
    assert_eq!(removed("processed_message"), 3);
    assert_eq!(removed("applied_effect"), 3);
    assert_eq!(removed("aggregate_progress"), 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM aggregate_progress").await,
        1
    );

    // Kafka redelivers the same records (a reprocess, a lost commit): none is applied again.
    let report = process_batch(&pool, &Ledger, &events)
        .await
        .expect("redelivery");
    assert!(
        report.outcomes.iter().all(|o| *o == Outcome::Stale),
        "{:?}",
        report.outcomes
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM ledger").await, 3);
    // Each is a `stale` step of its event's history, saying why.
    let details: Vec<String> = sqlx::query_scalar(
        "SELECT detail FROM group_transition WHERE transition = 'stale' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("transitions");
    assert_eq!(details.len(), 3);
    assert!(
        details[0].contains("past the dedupe window"),
        "{}",
        details[0]
    );

    // The order's next event still applies.
    let next = record(
        "order-1",
        4,
        Uuid::now_v7(),
        "order.updated",
        Utc::now(),
        10,
    );
    let report = process_batch(&pool, &Ledger, &[next]).await.expect("next");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn an_order_whose_progress_was_removed_is_never_applied_again() {
    let (pool, name) = database().await;
    let events = order_events("order-2", 2, 0);
    process_batch(&pool, &Ledger, &events)
        .await
        .expect("first delivery");

    // A year and more on. The first runs announce the group's progress horizon; progress goes
    // only once the announcement is a minute old (moved back here instead of waiting).
    let later = Utc::now() + Duration::days(400);
    runner().run_once(&pool, later, false).await.expect("seed");
    runner()
        .run_once(&pool, later, false)
        .await
        .expect("announce");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM aggregate_progress").await,
        1
    );
    sqlx::query("UPDATE progress_horizon SET announced_at = announced_at - interval '2 minutes'")
        .execute(&pool)
        .await
        .expect("age the announcement");
    runner()
        .run_once(&pool, later, false)
        .await
        .expect("remove");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM aggregate_progress").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        0
    );

    // The first event again, dedupe row and progress both gone: stale, not applied.
    let report = process_batch(&pool, &Ledger, &events[..1])
        .await
        .expect("redelivery");
    assert_eq!(report.outcomes, vec![Outcome::Stale]);
    assert_eq!(count(&pool, "SELECT count(*) FROM ledger").await, 2);
    let detail: String = sqlx::query_scalar(
        "SELECT detail FROM group_transition WHERE transition = 'stale' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .expect("transition");
    assert!(detail.contains("progress horizon"), "{detail}");

    // A new order whose events occur after the horizon is applied as always.
    let after = later + Duration::minutes(1);
    let fresh = record("order-3", 1, Uuid::now_v7(), "order.placed", after, 20);
    let report = process_batch(&pool, &Ledger, &[fresh])
        .await
        .expect("new order");
    assert_eq!(report.outcomes, vec![Outcome::Applied]);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn parked_events_open_dead_letters_and_their_history_are_kept() {
    let (pool, name) = database().await;
    // order-p: sequence 2 arrives without 1 and is parked.
    let parked = record("order-p", 2, Uuid::now_v7(), "order.updated", Utc::now(), 1);
    // order-d: sequence 1 applied, 2 rejected by the handler (an open dead letter).
    let applied = record("order-d", 1, Uuid::now_v7(), "order.placed", Utc::now(), 2);
    let rejected = record(
        "order-d",
        2,
        Uuid::now_v7(),
        "order.rejected",
        Utc::now(),
        3,
    );
    // order-x: applied, nothing pending: all of it may go.
    let done = record("order-x", 1, Uuid::now_v7(), "order.placed", Utc::now(), 4);
    let report = process_batch(&pool, &Ledger, &[parked, applied, rejected, done])
        .await
        .expect("batch");
    assert_eq!(
        report.outcomes,
        vec![
            Outcome::Parked,
            Outcome::Applied,
            Outcome::DeadLettered,
            Outcome::Applied
        ]
    );

    age_history(&pool).await;
    let run = runner()
        .run_once(&pool, Utc::now() + Duration::days(40), false)
        .await
        .expect("retention");
    assert!(!run.skipped);
    assert_eq!(count(&pool, "SELECT count(*) FROM parked_event").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM dead_letter WHERE status = 'open'"
        )
        .await,
        1
    );
    // Dedupe rows of the parked and the dead-lettered event stay; the applied ones go.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_message WHERE outcome IN ('parked', 'dead_lettered')"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_message WHERE outcome = 'applied'"
        )
        .await,
        0
    );
    // The history of the orders held back stays; order-x's goes.
    let history: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT aggregate_id FROM group_history ORDER BY aggregate_id")
            .fetch_all(&pool)
            .await
            .expect("history");
    assert_eq!(history, vec!["order-d", "order-p"]);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn rows_kept_behind_the_cursor_go_on_a_run_from_the_start_once_released() {
    let (pool, name) = database().await;
    // order-d: sequence 1 applied, 2 rejected (an open dead letter holds its rows).
    let applied = record("order-d", 1, Uuid::now_v7(), "order.placed", Utc::now(), 1);
    let rejected = record(
        "order-d",
        2,
        Uuid::now_v7(),
        "order.rejected",
        Utc::now(),
        2,
    );
    process_batch(&pool, &Ledger, &[applied, rejected])
        .await
        .expect("batch");
    let later = Utc::now() + Duration::days(40);
    runner().run_once(&pool, later, false).await.expect("first");
    let held = "SELECT count(*) FROM processed_message WHERE outcome = 'dead_lettered'";
    assert_eq!(count(&pool, held).await, 1);

    // The letter is resolved, and a new order is applied and ages past the window.
    sqlx::query("UPDATE dead_letter SET status = 'discarded', resolved_at = now()")
        .execute(&pool)
        .await
        .expect("resolve");
    process_batch(&pool, &Ledger, &order_events("order-n", 2, 10))
        .await
        .expect("new order");

    // A run taken up where the last one stopped removes the new rows, not those behind it...
    let resumed = runner().resume_once(&pool, later).await.expect("resumed");
    assert!(!resumed.skipped);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_message WHERE outcome = 'applied'"
        )
        .await,
        0
    );
    assert_eq!(count(&pool, held).await, 1);
    // ...which a run from the start (the loop makes one an hour) removes.
    runner().run_once(&pool, later, false).await.expect("full");
    assert_eq!(count(&pool, held).await, 0);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_dry_run_removes_nothing_and_one_runner_works_at_a_time() {
    let (pool, name) = database().await;
    process_batch(&pool, &Ledger, &order_events("order-4", 5, 0))
        .await
        .expect("batch");
    let later = Utc::now() + Duration::days(9);

    let dry = runner()
        .run_once(&pool, later, true)
        .await
        .expect("dry run");
    assert!(dry.dry_run);
    let would = dry
        .tables
        .iter()
        .find(|t| t.table == "processed_message")
        .expect("dedupe")
        .removed;
    assert_eq!(would, 5);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        5
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM retention_state").await,
        0
    );

    // Another runner holds the database: this one does nothing.
    let mut other = pool.begin().await.expect("begin");
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(pipeline_core::retention::runner::GROUPS_LOCK)
        .fetch_one(&mut *other)
        .await
        .expect("lock");
    assert!(held);
    let busy = runner()
        .run_once(&pool, later, false)
        .await
        .expect("busy run");
    assert!(busy.skipped);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        5
    );
    other.rollback().await.expect("release");

    // In small steps (two rows each), the run still removes all and records what it did.
    let run = runner()
        .batch_size(2)
        .run_once(&pool, later, false)
        .await
        .expect("run");
    assert!(!run.skipped);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        0
    );
    let (removed, window): (i64, i64) = sqlx::query_as(
        "SELECT total_removed, window_seconds FROM retention_state
         WHERE table_name = 'processed_message'",
    )
    .fetch_one(&pool)
    .await
    .expect("state");
    assert_eq!((removed, window), (5, 8 * 86_400));
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_runner_waits_while_the_pipeline_is_behind_and_goes_on_once_it_caught_up() {
    let (pool, name) = database().await;
    process_batch(&pool, &Ledger, &order_events("order-5", 4, 0))
        .await
        .expect("batch");
    let later = Utc::now() + Duration::days(9);
    let backlog = Backlog::new();
    let (yielding, metrics) = yielding_runner(runner(), &backlog);

    // A partition keeps finding full batches for a second and a half: the run waits, removing
    // nothing, and starts once nothing was behind for a while.
    backlog.behind();
    let behind = backlog.clone();
    let catching_up = tokio::spawn(async move {
        for _ in 0..15 {
            behind.behind();
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    });
    let started = std::time::Instant::now();
    let run = tokio::spawn({
        let pool = pool.clone();
        async move { yielding.run_once(&pool, later, false).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        4,
        "retention removed rows while the pipeline was behind"
    );
    catching_up.await.expect("catching up");
    let run = run.await.expect("run").expect("retention");
    assert!(!run.skipped);
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(1_500),
        "the run did not wait for the backlog ({:?})",
        started.elapsed()
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        0
    );
    let backlog_waits = metrics.yielded.with_label_values(&["backlog"]).get();
    assert!(backlog_waits >= 1.0, "{backlog_waits}");
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_runner_gives_a_pipeline_that_stays_slow_a_bounded_share_of_its_time() {
    let (pool, name) = database().await;
    process_batch(&pool, &Ledger, &order_events("order-s", 300, 0))
        .await
        .expect("batch");
    age_history(&pool).await;
    let later = Utc::now() + Duration::days(9);
    let backlog = Backlog::new();
    // Steps of 50 rows: 6 steps for the dedupe rows; the effects go in one partition.
    let (yielding, metrics) = yielding_runner(runner().batch_size(50), &backlog);

    // Every batch of the pipeline takes long, for as long as the run lasts (a saturated
    // database), but none finds a backlog.
    let stop = tokio_util::sync::CancellationToken::new();
    let slow = tokio::spawn({
        let (backlog, stop) = (backlog.clone(), stop.clone());
        async move {
            while !stop.is_cancelled() {
                backlog.took(pipeline_core::retention::backlog::SLOW);
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    });
    let started = std::time::Instant::now();
    let run = yielding.run_once(&pool, later, false).await.expect("run");
    let took = started.elapsed();
    stop.cancel();
    slow.await.expect("slow pipeline");

    // It waited before its steps, but each wait at most as long as the step and pause before
    // it: everything went, in less than one wait for a backlog (30 s) would take.
    assert!(!run.skipped);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_message").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM applied_effect").await, 0);
    let slow_waits = metrics.yielded.with_label_values(&["slow"]).get();
    assert!(slow_waits > 0.0, "the runner did not yield to slowness");
    assert!(
        slow_waits <= took.as_secs_f64() / 2.0 + 0.2,
        "yielded {slow_waits:.2} s of a {took:?} run"
    );
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    assert_eq!(metrics.yielded.with_label_values(&["backlog"]).get(), 0.0);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_table_with_a_long_backlog_does_not_hold_off_the_tables_after_it() {
    let (pool, name) = database().await;
    // 600 events: 600 dedupe rows (the first table), 600 effects (the second, in a partition of
    // their own), all past their windows at `later`.
    process_batch(&pool, &Ledger, &order_events("order-b", 600, 0))
        .await
        .expect("batch");
    age_history(&pool).await;
    let later = Utc::now() + Duration::days(9);
    // Steps of 50 rows, each followed by a pause fifty times as long: the dedupe rows alone take
    // 12 steps, seconds in all.
    let sliced = runner()
        .batch_size(50)
        .pause_ratio(50.0)
        .table_slice(std::time::Duration::from_millis(300));
    let dedupe_rows = "SELECT count(*) FROM processed_message";
    let effects = "SELECT count(*) FROM applied_effect";

    let first = sliced.resume_once(&pool, later).await.expect("first run");
    let part = |table: &str| {
        first
            .tables
            .iter()
            .find(|t| t.table == table)
            .unwrap_or_else(|| panic!("{table} in the run"))
            .clone()
    };
    assert!(
        !part("processed_message").caught_up && count(&pool, dedupe_rows).await > 0,
        "the first table's part of the run was not cut short: {first:?}"
    );
    assert!(
        part("applied_effect").removed > 0,
        "the run did not reach the second table: {first:?}"
    );

    // The runs after it take each table up where the last one stopped, until none is left.
    for _ in 0..30 {
        if count(&pool, dedupe_rows).await == 0 && count(&pool, effects).await == 0 {
            break;
        }
        sliced.resume_once(&pool, later).await.expect("next run");
    }
    assert_eq!(count(&pool, dedupe_rows).await, 0);
    assert_eq!(count(&pool, effects).await, 0);
    drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_paced_runner_removes_a_backlog_no_faster_than_its_pace_and_a_run_by_hand_at_once() {
    let (pool, name) = database().await;
    // 3,000 dedupe rows past their window, and no new ones arriving: the pace is its floor,
    // 1,000 rows a second.
    process_batch(&pool, &Ledger, &order_events("order-p", 3_000, 0))
        .await
        .expect("batch");
    age_history(&pool).await;
    inserts_reported(&pool, 3_000).await;
    let later = Utc::now() + Duration::days(9);
    let dedupe_rows = "SELECT count(*) FROM processed_message";
    let (paced, metrics) = yielding_runner(
        runner()
            .batch_size(500)
            .pause_ratio(0.0)
            .catch_up(1.5)
            .table_slice(std::time::Duration::from_secs(20)),
        &Backlog::new(),
    );

    let started = std::time::Instant::now();
    let run = paced.resume_once(&pool, later).await.expect("paced run");
    let took = started.elapsed();
    assert!(!run.skipped);
    assert_eq!(count(&pool, dedupe_rows).await, 0, "{run:?}");
    // The first step is free; the other 2,500 rows take 2.5 s at 1,000 a second.
    assert!(
        took >= std::time::Duration::from_millis(2_400),
        "3,000 rows went in {took:?}, faster than the pace"
    );
    // The pace shows as yields, unless the machine was slower than the pace itself (each step
    // then took its share of the time or more, and there was nothing to wait for).
    let yields = metrics.yielded.with_label_values(&["pace"]).get();
    assert!(
        yields >= 2.0 || took >= std::time::Duration::from_millis(3_500),
        "{yields} yields in {took:?}"
    );

    // A run by hand is not paced: the same backlog goes in one go.
    process_batch(&pool, &Ledger, &order_events("order-q", 3_000, 3_000))
        .await
        .expect("batch");
    let started = std::time::Instant::now();
    paced
        .run_once(&pool, later, false)
        .await
        .expect("run by hand");
    assert_eq!(count(&pool, dedupe_rows).await, 0);
    assert!(
        started.elapsed() < std::time::Duration::from_millis(2_000),
        "a run by hand took {:?}",
        started.elapsed()
    );
    drop_database(pool, &name).await;
}

/// Waits until PostgreSQL's statistics count `rows` inserts into the dedupe rows: a session
/// reports its counts when it goes idle, up to 10 s later, and a pace must not count the rows
/// inserted before it began as arriving while it runs.
async fn inserts_reported(pool: &PgPool, rows: i64) {
    let sql = "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'processed_message'";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while count(pool, sql).await < rows {
        assert!(
            std::time::Instant::now() < deadline,
            "inserts never reported"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[test]
fn windows_below_their_floors_are_refused() {
    let refused = |change: fn(&mut RetentionSettings)| {
        let mut s = RetentionSettings::default();
        change(&mut s);
        s.validate().expect_err("refused").to_string()
    };
    assert!(refused(|s| s.dedupe = Window::secs(30)).contains("--retain-dedupe"));
    assert!(refused(|s| s.progress = Window::secs(3600)).contains("--retain-progress"));
    // Progress is what recognises a redelivery past the dedupe window: never shorter.
    assert!(refused(|s| {
        s.dedupe = Window::days(30);
        s.progress = Window::days(10);
    })
    .contains("at least as long as the dedupe rows"));
    assert!(refused(|s| s.history = Window::secs(1)).contains("--retain-history"));
    assert!(refused(|s| s.operator_actions = Window::days(7)).contains("--retain-operator-actions"));
    RetentionSettings::default()
        .validate()
        .expect("the defaults are valid");
}
