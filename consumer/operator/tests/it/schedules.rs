//! `pipeline schedules` on a real PostgreSQL (`DATABASE_URL`): add (and every bad input refused
//! with exit status 2 and nothing written), list, show, pause, resume, run-now and remove, each
//! change recorded with who and why, and `trace` of a schedule's name showing its occurrences
//! and the changes.

use clap::Parser;
use consumer::Groups;
use operator::cli::Cli;
use operator::error::exit_code;
use pipeline_testkit::db::{database_url, drop_database, migrated_database, server_url};
use sqlx::PgPool;

async fn pipeline(pool: &PgPool, args: &[&str]) -> anyhow::Result<()> {
    let url = database_url(pool);
    let argv = ["pipeline", "--database-url", &url]
        .into_iter()
        .map(str::to_owned)
        .chain(args.iter().map(|a| (*a).to_owned()));
    let cli = Cli::try_parse_from(argv).expect("arguments");
    operator::run(cli, &Groups::new()).await
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

const ADD: [&str; 6] = [
    "schedules",
    "add",
    "daily-digest",
    "--event-type",
    "digest.daily",
    "--event-topic",
];

/// A schedule that fires every second: more often than the database's default floor (1 minute).
const FAST: [&str; 13] = [
    "schedules",
    "add",
    "fast",
    "--cron",
    "* * * * * *",
    "--event-type",
    "tick",
    "--event-topic",
    "ticks",
    "--note",
    "n",
    "--actor",
    "ops",
];

#[tokio::test]
async fn schedules_are_managed_from_the_command_line_and_recorded() {
    let (name, pool) = migrated_database("operator_schedules")
        .await
        .expect("database");
    let add = |extra: &'static [&'static str]| {
        let pool = pool.clone();
        async move {
            let mut args: Vec<&str> = ADD.to_vec();
            args.extend_from_slice(extra);
            args.extend_from_slice(&["--actor", "ops"]);
            pipeline(&pool, &args).await
        }
    };
    // Bad input: exit status 2, nothing written.
    for (extra, says) in [
        (
            &["digests", "--note", "n", "--cron", "0 9 * *"][..],
            "invalid cron expression",
        ),
        (
            &[
                "digests",
                "--note",
                "n",
                "--cron",
                "0 9 * * *",
                "--time-zone",
                "Mars/Base",
            ][..],
            "time zone",
        ),
        (
            &[
                "digests",
                "--note",
                "n",
                "--cron",
                "0 9 * * *",
                "--payload",
                "{not json",
            ][..],
            "--payload is not JSON",
        ),
        (
            &["bad topic!", "--note", "n", "--cron", "0 9 * * *"][..],
            "refused",
        ),
    ] {
        let e = add(extra).await.expect_err("refused");
        assert_eq!(exit_code(&e), 2, "{e:#}");
        assert!(e.to_string().contains(says), "{e:#}");
    }
    let every_second = pipeline(&pool, &FAST).await.expect_err("too frequent");
    assert!(
        every_second.to_string().contains("floor"),
        "{every_second:#}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_schedule").await,
        0
    );

    add(&[
        "digests",
        "--note",
        "morning digest",
        "--cron",
        "0 9 * * *",
        "--time-zone",
        "Europe/Berlin",
        "--payload",
        r#"{"at": "{{local_time}}"}"#,
    ])
    .await
    .expect("add");
    let e = add(&["digests", "--note", "again", "--cron", "0 10 * * *"])
        .await
        .expect_err("duplicate");
    assert_eq!(exit_code(&e), 2);
    assert!(e.to_string().contains("already exists"), "{e:#}");

    pipeline(&pool, &["schedules", "list"]).await.expect("list");
    pipeline(&pool, &["schedules", "show", "daily-digest"])
        .await
        .expect("show");
    let e = pipeline(&pool, &["schedules", "show", "nope"])
        .await
        .expect_err("unknown");
    assert_eq!(exit_code(&e), 2);

    for action in ["pause", "resume", "run-now"] {
        pipeline(
            &pool,
            &[
                "schedules",
                action,
                "daily-digest",
                "--note",
                "checking",
                "--actor",
                "ops",
            ],
        )
        .await
        .expect(action);
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM outbox_delayed WHERE event_type = 'digest.daily'"
        )
        .await,
        1,
        "run-now appended one event"
    );
    pipeline(&pool, &["trace", "daily-digest"])
        .await
        .expect("trace");
    pipeline(
        &pool,
        &[
            "schedules",
            "remove",
            "daily-digest",
            "--note",
            "done",
            "--actor",
            "ops",
        ],
    )
    .await
    .expect("remove");
    let actions: Vec<String> =
        sqlx::query_scalar("SELECT action FROM operator_action WHERE actor = 'ops' ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("actions");
    assert_eq!(
        actions,
        vec![
            "schedule.add",
            "schedule.pause",
            "schedule.resume",
            "schedule.run_now",
            "schedule.remove"
        ]
    );
    let e = pipeline(
        &pool,
        &[
            "schedules",
            "pause",
            "daily-digest",
            "--note",
            "x",
            "--actor",
            "ops",
        ],
    )
    .await
    .expect_err("removed");
    assert_eq!(exit_code(&e), 2);

    // The floor is the deployment's, in the database: no flag of the command lifts it, and what
    // the database's owner sets holds for every schedule added after.
    assert!(Cli::try_parse_from(
        ["pipeline", "schedules", "add", "fast", "--floor", "0s"]
            .into_iter()
            .chain(FAST.into_iter().skip(3))
    )
    .is_err());
    let _ = sqlx::query("UPDATE outbox_schedule_floor SET least_gap = interval '1 second'")
        .execute(&pool)
        .await
        .expect("lower the floor");
    pipeline(&pool, &FAST)
        .await
        .expect("every second, under a 1 s floor");
    pool.close().await;
    drop_database(&server_url(), &name).await.expect("drop");
}
