//! The library calls behind `pipeline group pause|resume` (`operator::group`), as a web console
//! would make them: a pause and a resume are each recorded once with who and why, in the group's
//! database; doing either again changes and records nothing and says so; `status` shows the group
//! paused (since when, by whom, why) or running; bad input (no note, no actor, an unknown group,
//! a command line without `--note`) is refused with exit status 2 and changes nothing. Against a
//! real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`) holding only the libraries' tables.

use clap::Parser;
use consumer::{Event, Groups, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use operator::cli::Cli;
use operator::error::exit_code;
use operator::group::{self, PausedSince};
use operator::targets::Targets;
use pipeline_testkit::db::database_url;
use sqlx::{PgConnection, PgPool};

/// A group that applies nothing.
struct Idle(String);

impl Handler for Idle {
    fn group(&self) -> &str {
        &self.0
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(IdleTransaction)
    }
}

struct IdleTransaction;

impl HandlerTransaction for IdleTransaction {
    fn apply<'a>(
        &'a mut self,
        _: &'a mut PgConnection,
        _: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The targets of `pipeline --database-url <pool's> --group-prefix p- <extra…> status` with
/// `tally` registered.
fn targets(pool: &PgPool, extra: &[&str]) -> Targets {
    let url = database_url(pool);
    let argv = ["pipeline", "--database-url", &url, "--group-prefix", "p-"]
        .into_iter()
        .chain(extra.iter().copied())
        .chain(["status"]);
    let cli = Cli::try_parse_from(argv).expect("arguments");
    Targets::new(cli.targets, &Groups::new().register("tally", Idle))
}

/// The recorded actions on group `p-tally`: action, actor, reason, and whom the pause a resume
/// ended was by.
async fn actions(pool: &PgPool) -> Vec<(String, String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT action, actor, reason, detail ->> 'paused_by' FROM operator_action
         WHERE group_name = 'p-tally' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .expect("actions")
}

async fn group_state(targets: &Targets) -> (String, Option<PausedSince>) {
    let status = operator::status::read(targets).await.expect("status");
    let tally = status
        .groups
        .into_iter()
        .find(|g| g.group == "tally")
        .expect("tally in the status");
    (tally.state.to_owned(), tally.paused)
}

#[sqlx::test(migrations = false)]
async fn a_pause_and_a_resume_are_recorded_once_each_and_show_in_the_status(pool: PgPool) {
    outbox::MIGRATOR.run(&pool).await.expect("outbox tables");
    consumer::MIGRATOR
        .run(&pool)
        .await
        .expect("consumer tables");
    let targets = targets(&pool, &["--group", "tally"]);
    assert_eq!(group_state(&targets).await, ("running".to_owned(), None));

    let paused = group::pause(&targets, "tally", "ops", "deploying the stock service")
        .await
        .expect("pause");
    assert!(paused.paused && paused.changed, "{paused:?}");
    let pause = paused.pause.clone().expect("the pause in force");
    assert_eq!(
        (pause.actor.as_str(), pause.note.as_str()),
        ("ops", "deploying the stock service")
    );
    // The state lives under the group's id, prefix included.
    assert_eq!(
        group::state(&pool, "p-tally").await.expect("state"),
        Some(pause.clone())
    );
    assert_eq!(group::state(&pool, "tally").await.expect("state"), None);
    assert_eq!(
        group_state(&targets).await,
        ("paused".to_owned(), Some(pause.clone()))
    );

    // Pausing again: nothing changes, the first pause stays as it was.
    let again = group::pause(&targets, "tally", "someone-else", "again")
        .await
        .expect("pause again");
    assert!(again.paused && !again.changed, "{again:?}");
    assert_eq!(again.pause, Some(pause.clone()));

    let resumed = group::resume(&targets, "tally", "ops", "deployed")
        .await
        .expect("resume");
    assert!(!resumed.paused && resumed.changed, "{resumed:?}");
    assert_eq!(resumed.pause, Some(pause), "the pause it ended");
    assert_eq!(group::state(&pool, "p-tally").await.expect("state"), None);
    assert_eq!(group_state(&targets).await, ("running".to_owned(), None));

    // Resuming again: nothing changes.
    let again = group::resume(&targets, "tally", "ops", "again")
        .await
        .expect("resume again");
    assert!(
        !again.paused && !again.changed && again.pause.is_none(),
        "{again:?}"
    );

    assert_eq!(
        actions(&pool).await,
        vec![
            (
                "group.pause".to_owned(),
                "ops".to_owned(),
                "deploying the stock service".to_owned(),
                None
            ),
            (
                "group.resume".to_owned(),
                "ops".to_owned(),
                "deployed".to_owned(),
                Some("ops".to_owned())
            ),
        ]
    );
}

#[sqlx::test(migrations = false)]
async fn bad_input_is_refused_with_exit_status_2_and_changes_nothing(pool: PgPool) {
    consumer::MIGRATOR
        .run(&pool)
        .await
        .expect("consumer tables");
    let targets = targets(&pool, &[]);
    for (group, actor, note, says) in [
        ("tally", "ops", "  ", "--note"),
        ("tally", " ", "why", "--actor"),
        (
            "nosuchgroup",
            "ops",
            "why",
            "unknown consumer group nosuchgroup",
        ),
    ] {
        let error = group::pause(&targets, group, actor, note)
            .await
            .expect_err("refused");
        assert_eq!(exit_code(&error), 2, "{error:#}");
        assert!(format!("{error:#}").contains(says), "{error:#}");
        let error = group::resume(&targets, group, actor, note)
            .await
            .expect_err("refused");
        assert_eq!(exit_code(&error), 2, "{error:#}");
    }
    let rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM group_pause) + (SELECT count(*) FROM operator_action)",
    )
    .fetch_one(&pool)
    .await
    .expect("rows");
    assert_eq!(rows, 0, "nothing written");

    // The command line: a note is required (clap's usage errors exit with status 2).
    for action in ["pause", "resume"] {
        let error =
            Cli::try_parse_from(["pipeline", "group", action, "tally"]).expect_err("no --note");
        assert_eq!(error.exit_code(), 2, "{error}");
        assert!(error.to_string().contains("--note"), "{error}");
        let error = Cli::try_parse_from(["pipeline", "group", action, "--note", "why"])
            .expect_err("no group");
        assert_eq!(error.exit_code(), 2, "{error}");
    }
    Cli::try_parse_from(["pipeline", "group", "pause", "tally", "--note", "why"])
        .expect("a pause with a note parses");
}
