//! One benchmark run: the phases asked for, one after the other, and the clean-up after them.

use std::time::Instant;

use crate::config::{Phase, Settings};
use crate::envs::EnvRegistry;
use crate::report::{self, Report};
use crate::{
    broker, consumer_drain, database, delayed, idle, latency, relay_cost, relay_drain, retention,
    sustained,
};

/// Runs the phases asked for, then drops what they created (unless `--keep`). Ctrl-C stops the
/// run, cleans up and returns what was measured so far.
pub async fn run_and_clean_up(settings: &Settings) -> Report {
    let envs = EnvRegistry::new(settings.keep);
    let mut report = Report::new(settings, report::host().await);
    if let Err(e) = crate::statements::ensure_client_roles().await {
        report.notes.push(format!(
            "no statement profile: pg_stat_statements could not be read or the programs' roles \
             made ({e:#}); PostgreSQL loads it with shared_preload_libraries, as \
             deploy/postgres/pipeline.conf has it"
        ));
    }
    if report.host.broker.is_none() {
        report.notes.push(format!(
            "no Apache Kafka broker (a java process running kafka.Kafka) with a listener on {} \
             found on this machine: the broker's CPU is not measured",
            report.host.kafka_brokers
        ));
    }
    let interrupted = tokio::select! {
        () = run(settings, &envs, &mut report) => false,
        _ = tokio::signal::ctrl_c() => true,
    };
    if interrupted {
        report.errors.push("interrupted".into());
    }
    say("cleaning up");
    report.notes.extend(envs.cleanup().await);
    report.finish();
    report
}

/// A progress line on stderr.
pub fn say(what: &str) {
    eprintln!("[bench {}] {what}", chrono::Local::now().format("%H:%M:%S"));
}

async fn run(settings: &Settings, envs: &EnvRegistry, report: &mut Report) {
    let started = Instant::now();
    if settings.runs(Phase::Idle) {
        say("phase 0: idle (every service running, no traffic)");
        match idle::run(settings, envs).await {
            Ok((idle, notes)) => {
                report.notes.extend(notes);
                report.idle = Some(idle);
            }
            Err(e) => report.errors.push(format!("idle phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Broker) {
        say("phase 1: broker ceiling (plain producer and consumer)");
        match broker::run(settings, envs).await {
            Ok(b) => {
                report.notes.extend(envs.release_topic(&b.topic).await);
                report.broker = Some(b);
            }
            Err(e) => report.errors.push(format!("broker phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Database) {
        say("phase 1b: PostgreSQL ceiling (one-row commits, batched inserts)");
        match database::run(settings, envs, &mut report.notes).await {
            Ok(d) => report.database = Some(d),
            Err(e) => report.errors.push(format!("database phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Relay) || settings.runs(Phase::Consumer) {
        say("phase 2: relay drain of a preloaded outbox");
        match relay_drain::run(settings, envs, report.broker.as_ref(), &mut report.notes).await {
            Ok((relay, mut env)) => {
                if settings.runs(Phase::Consumer) {
                    say("phase 3: consumer drains, one group at a time, batched and per message");
                    match consumer_drain::run(settings, &mut env, relay.events, &mut report.notes)
                        .await
                    {
                        Ok(c) => report.consumer = c,
                        Err(e) => report.errors.push(format!("consumer phase: {e:#}")),
                    }
                }
                report.notes.extend(envs.release(env).await);
                report.relay = Some(relay);
            }
            Err(e) => report.errors.push(format!("relay phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Latency) {
        say("phase 4: end-to-end latency at fixed rates");
        match latency::run(settings, envs, &mut report.notes).await {
            Ok(l) => report.latency = l,
            Err(e) => report.errors.push(format!("latency phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Sustained) {
        say("phase 5: sustained rate");
        match sustained::run(settings, envs, &mut report.notes).await {
            Ok(s) => report.sustained = Some(s),
            Err(e) => report.errors.push(format!("sustained phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Delayed) {
        say(&format!(
            "phase 6: relay claim with {} delayed events waiting",
            settings.delayed_events
        ));
        match delayed::run(settings, envs, &mut report.notes).await {
            Ok(s) => report.delayed = Some(s),
            Err(e) => report.errors.push(format!("delayed phase: {e:#}")),
        }
    }
    if settings.runs(Phase::Retention) {
        say("phase 7: retention under load over a large history");
        match retention::run(settings, envs, &mut report.notes).await {
            Ok(r) => report.retention = Some(r),
            Err(e) => report.errors.push(format!("retention phase: {e:#}")),
        }
    }
    if settings.runs(Phase::RelayCost) {
        say("phase 8: what each source of the relay costs PostgreSQL");
        match relay_cost::run(settings, envs, &mut report.notes).await {
            Ok(c) => report.relay_cost = Some(c),
            Err(e) => report.errors.push(format!("relay cost phase: {e:#}")),
        }
    }
    say(&format!(
        "phases done in {:.0} s",
        started.elapsed().as_secs_f64()
    ));
}
