//! Recurring schedules on a real PostgreSQL (`DATABASE_URL`): each occurrence is materialised
//! once whichever relay gets to it and however often the step runs, a relay that lost its lease
//! materialises nothing, the missed-occurrence policies (all, latest, skip) decide what fell due
//! while no relay ran, run-now adds one occurrence, and bad schedules are refused with nothing
//! written. Time is moved by materialising as if it were later.

use crate::common;

use chrono::{DateTime, Utc};
use outbox::schedule::{
    add_schedule, materialise_due, occurrences, run_now, set_enabled, Missed, NewSchedule,
    ScheduleError, MISSED_GRACE,
};
use outbox::Outbox;
use relay::mark::MarkError;
use relay::schedule::materialise_step;
use sqlx::PgPool;

fn every_ten_seconds(name: &str, missed: Missed) -> NewSchedule {
    NewSchedule {
        name: name.to_owned(),
        cron: "*/10 * * * * *".to_owned(),
        time_zone: "UTC".to_owned(),
        event_type: "report.hourly".to_owned(),
        aggregate_id: format!("schedule-{name}"),
        topic: "reports".to_owned(),
        payload: serde_json::json!({"report": "{{schedule}}", "at": "{{fire_at}}"}),
        missed,
    }
}

/// Adds `schedule` under a floor of 1 s and returns its first fire time.
async fn add(pool: &PgPool, schedule: &NewSchedule) -> DateTime<Utc> {
    let mut tx = pool.begin().await.expect("begin");
    let _ = sqlx::query("UPDATE outbox_schedule_floor SET least_gap = interval '1 second'")
        .execute(&mut *tx)
        .await
        .expect("lower the floor");
    let row = add_schedule(&mut tx, &Outbox::default(), schedule)
        .await
        .expect("add");
    tx.commit().await.expect("commit");
    row.next_fire_at.expect("next fire time")
}

/// Materialises as if the time were `now`; returns (fired, skipped).
async fn materialise_at(pool: &PgPool, now: DateTime<Utc>) -> (usize, usize) {
    let mut tx = pool.begin().await.expect("begin");
    let done = materialise_due(&mut tx, &Outbox::default(), now, Some(1))
        .await
        .expect("materialise");
    tx.commit().await.expect("commit");
    (
        done.iter().map(|m| m.fired.len()).sum(),
        done.iter().map(|m| m.skipped).sum(),
    )
}

async fn delayed_times(pool: &PgPool, aggregate: &str) -> Vec<DateTime<Utc>> {
    sqlx::query_scalar(
        "SELECT publish_at FROM outbox_delayed WHERE aggregate_id = $1 ORDER BY publish_at",
    )
    .bind(aggregate)
    .fetch_all(pool)
    .await
    .expect("delayed")
}

fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn every_missed_occurrence_fires_once_under_all(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("all", Missed::All)).await;
    // No relay for 35 s: four occurrences fell due.
    assert_eq!(materialise_at(&pool, first + secs(35)).await, (4, 0));
    let want: Vec<DateTime<Utc>> = (0..4).map(|i| first + secs(10 * i)).collect();
    assert_eq!(delayed_times(&pool, "schedule-all").await, want);
    // Again, and again later: the same occurrences are never materialised twice.
    assert_eq!(materialise_at(&pool, first + secs(35)).await, (0, 0));
    assert_eq!(materialise_at(&pool, first + secs(45)).await, (1, 0));
    assert_eq!(delayed_times(&pool, "schedule-all").await.len(), 5);
    // The payload template is filled in.
    let payload: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM outbox_delayed WHERE aggregate_id = 'schedule-all'
         ORDER BY publish_at LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .expect("payload");
    assert_eq!(payload["report"], "all");
    assert!(payload["at"]
        .as_str()
        .expect("at")
        .starts_with(&first.format("%Y-%m-%dT%H:%M:%S").to_string()));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn retention_removes_old_occurrences_but_each_schedules_latest(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("kept", Missed::All)).await;
    assert_eq!(materialise_at(&pool, first + secs(35)).await, (4, 0));
    sqlx::query("UPDATE outbox_schedule_occurrence SET fire_at = fire_at - interval '30 days'")
        .execute(&pool)
        .await
        .expect("age");
    let rules = relay::retention::rules(&relay::retention::RetentionSettings::default(), false);
    let run = pipeline_core::retention::Runner::new(rules, "test")
        .run_once(&pool, Utc::now(), false)
        .await
        .expect("retention");
    let removed = run
        .tables
        .iter()
        .find(|t| t.table == "outbox_schedule_occurrence")
        .expect("rule")
        .removed;
    assert_eq!(removed, 3);
    // The schedule goes on from its next fire time: nothing is materialised again.
    assert_eq!(materialise_at(&pool, first + secs(35)).await, (0, 0));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn only_the_latest_missed_occurrence_fires_under_latest(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("latest", Missed::Latest)).await;
    assert_eq!(materialise_at(&pool, first + secs(35)).await, (1, 3));
    assert_eq!(
        delayed_times(&pool, "schedule-latest").await,
        vec![first + secs(30)]
    );
    let all = occurrences(&mut pool.acquire().await.expect("conn"), "latest", 10)
        .await
        .expect("occurrences");
    let outcomes: Vec<&str> = all.iter().map(|o| o.outcome.as_str()).collect();
    assert_eq!(outcomes, vec!["fired", "skipped", "skipped", "skipped"]);
    assert_eq!(all[0].event_state.as_deref(), Some("delayed"));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn occurrences_over_a_minute_late_do_not_fire_under_skip(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("skip", Missed::Skip)).await;
    let now = first + secs(95);
    // Ten occurrences fell due (0 s … 90 s); those more than a minute late are passed over.
    let grace = chrono::Duration::from_std(MISSED_GRACE).expect("grace");
    let on_time = (0..10)
        .filter(|i| now - (first + secs(10 * i)) <= grace)
        .count();
    assert_eq!(materialise_at(&pool, now).await, (on_time, 10 - on_time));
    let times = delayed_times(&pool, "schedule-skip").await;
    assert!(times.iter().all(|t| now - *t <= grace));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_relay_that_lost_its_lease_materialises_nothing(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("fenced", Missed::All)).await;
    let (elector, lease) = common::hold_lease(&pool).await;
    let stale = lease.fence();
    // Another relay takes the lease over (the epoch moves on).
    sqlx::query("UPDATE relay_lease SET epoch = epoch + 1 WHERE lease_key = $1")
        .bind(stale.lock_key)
        .execute(&pool)
        .await
        .expect("takeover");
    sqlx::query("UPDATE outbox_schedule SET next_fire_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .expect("due");
    let refused = materialise_step(&pool, &Outbox::default(), stale).await;
    assert!(
        matches!(refused, Err(MarkError::LeaseLost(_))),
        "{refused:?}"
    );
    assert!(delayed_times(&pool, "schedule-fenced").await.is_empty());
    drop(elector);
    let _ = first;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn run_now_adds_one_occurrence_and_a_paused_schedule_fires_nothing(pool: PgPool) {
    let first = add(&pool, &every_ten_seconds("manual", Missed::All)).await;
    let mut tx = pool.begin().await.expect("begin");
    set_enabled(&mut tx, "manual", false).await.expect("pause");
    let (at, event_id) = run_now(&mut tx, &Outbox::default(), "manual")
        .await
        .expect("run now");
    tx.commit().await.expect("commit");
    assert_eq!(
        materialise_at(&pool, first + secs(600)).await,
        (0, 0),
        "paused"
    );
    let times = delayed_times(&pool, "schedule-manual").await;
    assert_eq!(times, vec![at]);
    let id: uuid::Uuid = sqlx::query_scalar("SELECT event_id FROM outbox_delayed")
        .fetch_one(&pool)
        .await
        .expect("event");
    assert_eq!(id, event_id);
    // Resumed, it fires from its next occurrence after now, not what fell due while paused.
    let mut tx = pool.begin().await.expect("begin");
    let row = set_enabled(&mut tx, "manual", true).await.expect("resume");
    tx.commit().await.expect("commit");
    assert!(row.next_fire_at.expect("next") > Utc::now() - secs(1));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn bad_schedules_are_refused_and_write_nothing(pool: PgPool) {
    let try_add = |change: fn(&mut NewSchedule)| {
        let pool = pool.clone();
        async move {
            let mut s = every_ten_seconds("report", Missed::Latest);
            change(&mut s);
            let mut tx = pool.begin().await.expect("begin");
            let r = add_schedule(&mut tx, &Outbox::default(), &s).await;
            tx.commit().await.expect("commit");
            r.map(|_| ())
        }
    };
    // Every ten seconds is more often than the database's floor (one minute, its default).
    assert!(matches!(
        try_add(|_| {}).await,
        Err(ScheduleError::TooFrequent { .. })
    ));
    assert!(matches!(
        try_add(|s| s.cron = "0 61 * * *".to_owned()).await,
        Err(ScheduleError::InvalidCron { .. })
    ));
    assert!(matches!(
        try_add(|s| s.cron = "every day".to_owned()).await,
        Err(ScheduleError::InvalidCron { .. })
    ));
    assert!(matches!(
        try_add(|s| {
            s.cron = "0 9 * * *".to_owned();
            s.time_zone = "Europe/Atlantis".to_owned();
        })
        .await,
        Err(ScheduleError::InvalidTimeZone(_))
    ));
    assert!(matches!(
        try_add(|s| {
            s.cron = "0 9 * * *".to_owned();
            s.name = "Bad Name".to_owned();
        })
        .await,
        Err(ScheduleError::InvalidName(_))
    ));
    assert!(matches!(
        try_add(|s| {
            s.cron = "0 9 * * *".to_owned();
            s.topic = "not a topic!".to_owned();
        })
        .await,
        Err(ScheduleError::Event(_))
    ));
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_schedule")
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    assert_eq!(count().await, 0);
    try_add(|s| s.cron = "0 9 * * *".to_owned())
        .await
        .expect("valid");
    assert!(matches!(
        try_add(|s| s.cron = "0 10 * * *".to_owned()).await,
        Err(ScheduleError::Duplicate(_))
    ));
    assert_eq!(count().await, 1);
}
