//! The effect history in time partitions: a database of the layout before them migrates
//! without losing or rewriting a row, the consumers create partitions ahead, and retention drops
//! whole partitions once past the window, keeping what an open dead letter still needs.

use std::time::{Duration, Instant};

use chrono::Utc;
use consumer::retention::{ensure_partitions, rules, RetentionSettings, EFFECT_PARTITIONS};
use pipeline_core::retention::{partitions, Report, Runner, TableReport, Window};
use sqlx::migrate::Migrator;
use sqlx::PgPool;

use crate::common;

/// The last migration of the layout before time partitions.
const BEFORE_PARTITIONS: i64 = 20261126000106;

/// Rows the old layout holds in the test.
const OLD_ROWS: i64 = 200_000;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// The effect history's part of a retention run.
fn effects_part(report: Report) -> TableReport {
    report
        .tables
        .into_iter()
        .find(|t| t.table == "applied_effect")
        .expect("applied_effect's part")
}

/// `n` effects of distinct orders applied 30 days ago (in the partition of everything before
/// the migration).
async fn insert_old_effects(pool: &PgPool, n: i32) {
    sqlx::query(
        "INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type,
                                     applied_at)
         SELECT 'g', gen_random_uuid(), 'order-' || n, 1, 'order.placed',
                now() - interval '30 days'
         FROM generate_series(1, $1) n",
    )
    .bind(n)
    .execute(pool)
    .await
    .expect("old effects");
}

/// A transaction that has read the effect history and keeps its snapshot until it ends: a
/// detach of one of its partitions waits for it.
async fn reader_of_effects(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut reader = pool.begin().await.expect("reader");
    sqlx::raw_sql(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM applied_effect",
    )
    .execute(&mut *reader)
    .await
    .expect("reader's snapshot");
    reader
}

/// The consumer's migrations up to `last` (all of them: `i64::MAX`).
pub(crate) async fn migrate_up_to(pool: &PgPool, last: i64) {
    let mut migrator = Migrator {
        migrations: consumer::MIGRATOR.migrations.clone(),
        ..Migrator::DEFAULT
    };
    migrator.migrations = std::borrow::Cow::Owned(
        migrator
            .migrations
            .iter()
            .filter(|m| m.version <= last)
            .cloned()
            .collect(),
    );
    migrator.set_ignore_missing(true);
    migrator.run(pool).await.expect("migrate");
}

#[tokio::test]
async fn a_database_of_the_old_layout_migrates_without_rewriting_its_history_and_drops_it_whole() {
    // A database of the old layout, its history filled: an old order with an open dead letter,
    // and many others.
    let (pool, name) = common::empty_database("partitions").await;
    migrate_up_to(&pool, BEFORE_PARTITIONS).await;
    sqlx::raw_sql(&format!(
        "INSERT INTO applied_effect (group_name, event_id, order_id, sequence, event_type,
                                     applied_at)
         SELECT 'g', gen_random_uuid(), 'order-' || (n % 20000), n / 20000 + 1, 'order.placed',
                now() - interval '30 days' + n * interval '1 millisecond'
         FROM generate_series(1, {OLD_ROWS}) n;
         INSERT INTO dead_letter (group_name, topic, partition, kafka_offset, order_id, reason)
         VALUES ('g', 't', 0, 1, 'order-7', 'kept for the test');"
    ))
    .execute(&pool)
    .await
    .expect("fill the old layout");
    let old_max: i64 = count(&pool, "SELECT max(id) FROM applied_effect").await;

    // The migration reads no row: it takes a moment whatever the history's size.
    let started = Instant::now();
    migrate_up_to(&pool, i64::MAX).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "the migration took {took:?}");

    // Until a consumer attaches them, the old rows are apart but all there; new effects go to
    // the partitioned table, numbered after the old ones.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM applied_effect_before").await,
        OLD_ROWS
    );
    sqlx::query(
        "INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type)
         VALUES ('g', gen_random_uuid(), 'order-new', 1, 'order.placed')",
    )
    .execute(&pool)
    .await
    .expect("a new effect has a partition");
    assert!(count(&pool, "SELECT max(id) FROM applied_effect").await > old_max);

    // A consumer's start: partitions ahead, the old rows attached, every one of them visible
    // in the table and in the history view, with its id.
    let settings = RetentionSettings::default();
    let created = ensure_partitions(&pool, &settings).await.expect("ensure");
    assert!(created >= 1, "partitions made ahead: {created}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM applied_effect").await,
        OLD_ROWS + 1
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM applied_effect WHERE id <= (SELECT max(id) FROM applied_effect_before)").await,
        OLD_ROWS
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM group_history WHERE transition = 'applied'"
        )
        .await,
        OLD_ROWS + 1
    );
    // Each of the partitioned table's indexes has its part on the old rows (the one the old
    // table lacked built beforehand, so the attach built none).
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_inherits i JOIN pg_index x ON x.indexrelid = i.inhrelid
             WHERE x.indrelid = 'applied_effect_before'::regclass"
        )
        .await,
        count(
            &pool,
            "SELECT count(*) FROM pg_index WHERE indrelid = 'applied_effect'::regclass"
        )
        .await
    );
    // Again: nothing more to do, and the partitions cover the time ahead.
    assert_eq!(ensure_partitions(&pool, &settings).await.expect("again"), 0);
    let span = partitions::span(settings.history.duration());
    let covered_until: chrono::DateTime<Utc> = EFFECT_PARTITIONS
        .list(&mut pool.acquire().await.expect("conn"))
        .await
        .expect("list")
        .last()
        .expect("a partition")
        .to;
    let runway = chrono::Duration::from_std(partitions::runway(span)).expect("runway");
    assert!(covered_until >= Utc::now() + runway - chrono::Duration::seconds(60));

    // Retention a little later than the history window after the migration: the partition of
    // the old rows goes whole, but for the history of the order with an open dead letter.
    let runner = Runner::new(rules(&settings), "test");
    let later = Utc::now() + chrono::Duration::days(8);
    let effects = effects_part(runner.run_once(&pool, later, false).await.expect("run"));
    assert!(effects.partitions_removed >= 1, "{effects:?}");
    let kept = count(&pool, "SELECT count(*) FROM applied_effect_held").await;
    assert_eq!(kept, OLD_ROWS / 20_000, "the dead-lettered order's history");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM applied_effect_held WHERE aggregate_id <> 'order-7'"
        )
        .await,
        0
    );
    assert!(effects.removed >= (OLD_ROWS - kept) as u64, "{effects:?}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_class WHERE relname = 'applied_effect_before'"
        )
        .await,
        0,
        "dropped, not deleted row by row"
    );
    // What is kept still shows in the history; the effect applied since the migration is in a
    // partition whose time has not passed, and stays.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM group_history WHERE transition = 'applied' AND aggregate_id = 'order-7'").await,
        kept
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM applied_effect").await, 1);

    // Once the dead letter is resolved, the held rows go by the steps.
    sqlx::query("UPDATE dead_letter SET status = 'discarded', resolved_at = now()")
        .execute(&pool)
        .await
        .expect("resolve");
    runner.run_once(&pool, later, false).await.expect("run");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM applied_effect_held").await,
        0
    );
    common::drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_dry_run_drops_no_partition_and_windows_give_partition_spans_of_a_quarter_or_less() {
    let (pool, name) = common::database("partitions_dry", "").await;
    insert_old_effects(&pool, 500).await;
    let runner = Runner::new(rules(&RetentionSettings::default()), "test");
    let later = Utc::now() + chrono::Duration::days(8);
    let part = effects_part(runner.run_once(&pool, later, true).await.expect("dry run"));
    assert!(
        part.partitions_removed >= 1 && part.removed >= 500,
        "{part:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM applied_effect").await,
        500
    );

    for (window, span) in [(60, 60), (3_600, 900), (7 * 86_400, 86_400)] {
        assert_eq!(
            partitions::span(Window::secs(window).duration()),
            Duration::from_secs(span)
        );
    }
    common::drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_table_in_the_way_of_a_partition_is_an_error_not_a_loop() {
    let (pool, name) = common::database("partitions_taken", "").await;
    let settings = RetentionSettings::default();
    // Tomorrow's partition is detached and dropped, and a table of its name left in its place.
    let tomorrow = (Utc::now() + chrono::Duration::days(1))
        .format("applied_effect_p%Y%m%dt000000")
        .to_string();
    sqlx::raw_sql(&format!(
        "ALTER TABLE applied_effect DETACH PARTITION {tomorrow};
         DROP TABLE {tomorrow};
         CREATE TABLE {tomorrow} (x int);"
    ))
    .execute(&pool)
    .await
    .expect("a table in the way");
    let error = tokio::time::timeout(Duration::from_secs(30), ensure_partitions(&pool, &settings))
        .await
        .expect("ensure ends")
        .expect_err("the name is taken");
    assert!(
        error.to_string().contains("is not its partition"),
        "{error}"
    );
    common::drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_lowered_history_window_narrows_the_partitions_made_ahead() {
    // Made with the default window: a partition a day, four days ahead.
    let (pool, name) = common::database("partitions_narrow", "").await;
    // A row already in a partition ahead (a clock that ran ahead, say): that one stays.
    sqlx::raw_sql(
        "INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type,
                                     applied_at)
         VALUES ('g', gen_random_uuid(), 'order-ahead', 1, 'order.placed',
                 date_trunc('day', now()) + interval '3 days 1 hour')",
    )
    .execute(&pool)
    .await
    .expect("a row ahead");
    let ahead = |conn_pool: PgPool| async move {
        let mut conn = conn_pool.acquire().await.expect("connection");
        let now: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *conn)
            .await
            .expect("now");
        EFFECT_PARTITIONS
            .list(&mut conn)
            .await
            .expect("partitions")
            .into_iter()
            .filter(|p| {
                p.from
                    .is_some_and(|f| f > now + chrono::Duration::minutes(11))
            })
            .collect::<Vec<_>>()
    };
    assert!(ahead(pool.clone()).await.len() >= 3, "days made ahead");

    let short = RetentionSettings {
        history: Window::secs(120),
        ..RetentionSettings::default()
    };
    ensure_partitions(&pool, &short).await.expect("ensure");
    let left = ahead(pool.clone()).await;
    assert_eq!(
        left.len(),
        1,
        "only the partition with a row is left ahead: {left:?}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM applied_effect WHERE aggregate_id = 'order-ahead'"
        )
        .await,
        1
    );
    // The time to come is still covered: the runway of the short window.
    sqlx::raw_sql(
        "INSERT INTO applied_effect (group_name, event_id, aggregate_id, sequence, event_type,
                                     applied_at)
         SELECT 'g', gen_random_uuid(), 'order-' || m, 1, 'order.placed',
                now() + m * interval '1 minute'
         FROM generate_series(0, 9) m",
    )
    .execute(&pool)
    .await
    .expect("the next ten minutes have partitions");
    common::drop_database(pool, &name).await;
}

#[tokio::test]
async fn a_detach_waiting_for_a_reader_shows_as_retention_and_the_session_is_named_back() {
    let (pool, name) = common::database("partitions_mark", "").await;
    insert_old_effects(&pool, 100).await;
    // A reader whose snapshot the detach must wait out.
    let reader = reader_of_effects(&pool).await;

    let runner = Runner::new(rules(&RetentionSettings::default()), "test");
    let later = Utc::now() + chrono::Duration::days(8);
    let run = {
        let pool = pool.clone();
        tokio::spawn(async move { runner.run_once(&pool, later, false).await })
    };
    let waiting = "SELECT count(*) FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event_type = 'Lock'
                     AND query LIKE '%DETACH PARTITION%'
                     AND application_name LIKE '%(retention)'";
    let deadline = Instant::now() + Duration::from_millis(1_500);
    let mut seen = false;
    while !seen && Instant::now() < deadline {
        seen = count(&pool, waiting).await == 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reader.commit().await.expect("reader done");
    assert!(seen, "the waiting detach is marked as retention's");
    let part = effects_part(run.await.expect("run").expect("retention run"));
    assert!(part.partitions_removed >= 1, "{part:?}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name LIKE '%(retention)'"
        )
        .await,
        0,
        "no session keeps the mark"
    );
    common::drop_database(pool, &name).await;
}

/// A reader that keeps its snapshot past the detach's bound (a long report, a backup) does not
/// fail the run: the detach is left pending, the tables after the effect history are still
/// trimmed, and a run after the reader is gone finishes the detach and drops the partition.
#[tokio::test]
async fn a_detach_cut_short_by_a_long_reader_is_finished_later_and_the_run_goes_on() {
    let (pool, name) = common::database("partitions_cut_short", "").await;
    insert_old_effects(&pool, 100).await;
    let old_transition =
        "INSERT INTO group_transition (group_name, event_id, aggregate_id, sequence,
                                                       event_type, transition, at)
                          VALUES ('g', gen_random_uuid(), 'order-old', 1, 'order.placed',
                                  'duplicate', now() - interval '30 days')";
    let old_transitions = "SELECT count(*) FROM group_transition WHERE aggregate_id = 'order-old'";
    let pending = "SELECT count(*) FROM pg_inherits
                   WHERE inhparent = 'applied_effect'::regclass AND inhdetachpending";
    let old_effects =
        "SELECT count(*) FROM applied_effect WHERE applied_at < now() - interval '1 day'";
    sqlx::query(old_transition)
        .execute(&pool)
        .await
        .expect("old transition");
    let reader = reader_of_effects(&pool).await;

    let runner = Runner::new(rules(&RetentionSettings::default()), "test");
    let later = Utc::now() + chrono::Duration::days(8);
    for run in 1..=2 {
        let report = runner
            .run_once(&pool, later, false)
            .await
            .unwrap_or_else(|e| panic!("run {run} beside a long reader failed: {e}"));
        assert!(!report.skipped);
        assert_eq!(
            report.tables.len(),
            runner.rules().len(),
            "run {run}: every table had its part"
        );
        assert_eq!(effects_part(report).partitions_removed, 0, "run {run}");
        assert_eq!(
            count(&pool, pending).await,
            1,
            "run {run}: the detach is pending"
        );
        assert_eq!(count(&pool, old_transitions).await, 0, "run {run}");
        // A partition pending detach is left out of new queries: its rows are counted in it.
        let partition: String = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'applied_effect'::regclass AND i.inhdetachpending",
        )
        .fetch_one(&pool)
        .await
        .expect("the pending partition");
        assert_eq!(
            count(&pool, &format!("SELECT count(*) FROM {partition}")).await,
            100,
            "run {run}: its rows are all still there"
        );
        sqlx::query(old_transition)
            .execute(&pool)
            .await
            .expect("old transition");
    }

    reader.commit().await.expect("reader done");
    let part = effects_part(
        runner
            .run_once(&pool, later, false)
            .await
            .expect("the run after the reader"),
    );
    assert!(part.partitions_removed >= 1, "{part:?}");
    assert_eq!(count(&pool, pending).await, 0, "the detach was finished");
    assert_eq!(count(&pool, old_effects).await, 0);
    assert_eq!(count(&pool, old_transitions).await, 0);
    common::drop_database(pool, &name).await;
}
