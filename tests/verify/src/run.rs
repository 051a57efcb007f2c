//! One verification run from start to clean-up: the world created, the pipeline started, the
//! load and the fault plan run side by side, the drain awaited and the history checked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::driver::{self, DriverSettings};
use crate::environment::Environment;
use crate::faults::Injector;
use crate::postgres::PgCluster;
use crate::processes::Supervisor;
use crate::progress::say;
use crate::report::Report;
use crate::topology::Topology;
use crate::{checks, drain, fault_plan, kafka_cluster};

/// How often the server checkpoints during a run (see [`PgCluster::checkpoint_every`]).
const RUN_CHECKPOINT_TIMEOUT: &str = "30s";

/// Runs the whole verification and cleans up after it, whatever happens (Ctrl-C included):
/// every process stopped, PostgreSQL running, the databases dropped unless `--keep`.
pub async fn run(settings: &Settings) -> Report {
    let started = Instant::now();
    let mut report = Report::new(settings);
    let postgres = match PgCluster::discover(&settings.server_url).await {
        Ok(p) => p,
        Err(e) => {
            report.errors.push(format!("{e:#}"));
            return report;
        }
    };
    let env = match Environment::create(settings).await {
        Ok(env) => env,
        Err(e) => {
            report.errors.push(format!("{e:#}"));
            return report;
        }
    };
    let checkpoints = match postgres.checkpoint_every(RUN_CHECKPOINT_TIMEOUT).await {
        Ok(previous) => Some(previous),
        Err(e) => {
            report
                .errors
                .push(format!("setting the run's checkpoint_timeout: {e:#}"));
            None
        }
    };
    report.work_dir = Some(env.work_dir.display().to_string());
    say(&format!(
        "seed {}, at least {} events at {}/s, {} faults; logs in {}",
        settings.seed,
        settings.min_events,
        settings.rate,
        settings.faults,
        env.log_dir.display()
    ));

    let supervisor = Supervisor::default();
    let stop_watching = CancellationToken::new();
    let watcher = tokio::spawn({
        let (supervisor, stop) = (supervisor.clone(), stop_watching.clone());
        async move { supervisor.watch(stop).await }
    });
    // SIGINT or SIGTERM ends the load and the faults early; the run then cleans up as usual.
    let interrupted = CancellationToken::new();
    let interrupt_listener = tokio::spawn({
        let interrupted = interrupted.clone();
        async move {
            interrupt().await;
            say("interrupted: stopping the load and the faults");
            interrupted.cancel();
        }
    });
    let outcome = exercise(
        settings,
        &env,
        &postgres,
        supervisor.clone(),
        &interrupted,
        &mut report,
    )
    .await;
    interrupt_listener.abort();
    if let Err(e) = outcome {
        report.errors.push(format!("{e:#}"));
    }

    say("stopping the run's processes");
    stop_watching.cancel();
    let _ = watcher.await;
    report.unplanned_exits = supervisor.unplanned_exits();
    // The pipeline first, then the three nodes together: one by one, the last would wait for a
    // controller quorum that is gone. Nodes whose data is removed next are killed: nothing of
    // theirs is read again, and a clean shutdown costs seconds.
    let nodes = kafka_cluster::labels();
    supervisor
        .stop_all_but(&nodes, Duration::from_secs(15))
        .await;
    if settings.keep {
        supervisor
            .stop_together(&nodes, Duration::from_secs(10))
            .await;
    } else {
        supervisor.kill_together(&nodes);
    }
    if !settings.keep {
        if let Err(e) = kafka_cluster::remove_data(&env.broker_dir) {
            report.errors.push(format!("{e:#}"));
        }
    }
    if let Err(e) = postgres.restore().await {
        report
            .errors
            .push(format!("PostgreSQL could not be started again: {e:#}"));
    }
    if let Some(previous) = checkpoints {
        if let Err(e) = postgres.restore_checkpoints(&previous).await {
            report
                .errors
                .push(format!("restoring checkpoint_timeout {previous}: {e:#}"));
        }
    }
    if settings.keep {
        say(&format!("kept database {}", env.database));
        say(&format!(
            "kept the Kafka nodes' data in {}",
            env.broker_dir.display()
        ));
    } else if let Err(e) = env.drop_databases().await {
        report
            .errors
            .push(format!("dropping the run's databases: {e:#}"));
    }
    report.duration_seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
    report
}

/// Resolves on SIGINT or SIGTERM (e.g. from `timeout`), so the run still cleans up.
async fn interrupt() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Starts the pipeline, drives it through the fault plan, waits for the drain and checks.
async fn exercise(
    settings: &Settings,
    env: &Environment,
    postgres: &PgCluster,
    supervisor: Supervisor,
    interrupted: &CancellationToken,
    report: &mut Report,
) -> anyhow::Result<()> {
    say("starting the Kafka cluster and the pipeline");
    let topology = tokio::select! {
        topology = Topology::start(settings, env, supervisor) => topology?,
        () = interrupted.cancelled() => anyhow::bail!("interrupted"),
    };
    let plan = fault_plan::plan(
        settings.seed,
        settings.faults,
        &settings.timing,
        &settings.skip,
    );
    let acknowledged = Arc::new(AtomicU64::new(0));
    let (faults_done, abort) = (CancellationToken::new(), interrupted.child_token());
    let load_started = Instant::now();
    let injector = Injector {
        topology: &topology,
        env,
        postgres,
        started: load_started,
    };
    let driver_settings = DriverSettings {
        base_url: topology.order_service_url(),
        seed: settings.seed,
        rate: settings.rate,
        min_events: settings.min_events,
        concurrency: settings.concurrency,
    };
    say(&format!("load and {} faults under way", plan.len()));
    let progress = tokio::spawn(report_progress(
        env.pool.clone(),
        acknowledged.clone(),
        abort.clone(),
    ));
    let (history, fault_log) = tokio::join!(
        async {
            let history =
                driver::drive(&driver_settings, &faults_done, &abort, &acknowledged).await;
            if history.is_err() {
                abort.cancel();
            }
            history
        },
        async {
            let log = injector.run(&plan, &abort).await;
            faults_done.cancel();
            log
        },
    );
    abort.cancel();
    let _ = progress.await;
    report.set_faults(fault_log);
    let history = history?;
    report.set_history(&history);
    if interrupted.is_cancelled() {
        anyhow::bail!("interrupted");
    }
    say(&format!(
        "load done: {} events acknowledged in {:.0} s; waiting for the drain",
        history.acknowledged.len(),
        history.seconds
    ));
    let drained = tokio::select! {
        drained = drain::wait_drained(env, &topology, settings.drain_timeout) => drained,
        () = interrupted.cancelled() => anyhow::bail!("interrupted"),
    };
    let mut undrained = Vec::new();
    match drained {
        Ok(seconds) => report.drain_seconds = Some((seconds * 10.0).round() / 10.0),
        Err(e) => {
            report.errors.push(format!("{e:#}"));
            undrained = drain::snapshot_lag(env, &topology)
                .await
                .unwrap_or_else(|e| vec![format!("no lag snapshot: {e:#}")]);
        }
    }
    if let Err(e) = drain::write_metrics(env, &topology).await {
        report.errors.push(format!("{e:#}"));
    }
    say("checking the history against the database and the topic");
    let mut results = checks::run(env, &topology, &history).await?;
    results.undrained_partitions = undrained;
    report.set_checks(results);
    Ok(())
}

/// Every 10 s: acknowledged events and applied effects so far.
async fn report_progress(
    pool: sqlx::PgPool,
    acknowledged: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let started = Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
        let counts: Result<(i64, i64), sqlx::Error> = sqlx::query_as(&format!(
            "SELECT ({}), (SELECT coalesce(max(id), 0) FROM applied_effect)",
            crate::publishing::PENDING_SQL
        ))
        .fetch_one(&pool)
        .await;
        say(&format!(
            "{:>4.0} s: {} events acknowledged, {} pending in the outbox, {} effects applied",
            started.elapsed().as_secs_f64(),
            acknowledged.load(Ordering::Relaxed),
            counts.as_ref().map_or("?".to_owned(), |c| c.0.to_string()),
            counts.as_ref().map_or("?".to_owned(), |c| c.1.to_string()),
        ));
    }
}
